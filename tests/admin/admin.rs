//! The admin listener end to end: `/healthz`, `/readyz` with and without a reachable Redis,
//! `/metrics` counting admitted and limited requests exactly, `/config` with secrets masked.
//! Every proxy here is served in-process (`TestProxy`).

use crate::common;

use std::future::Future;
use std::time::Duration;

use common::{config, Http, Reply, TestProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// No test here may take longer than this, whatever the proxy does.
const TEST_TIMEOUT: Duration = Duration::from_secs(20);

/// A Redis URL with a password, where nothing listens (port 1).
const DEAD_REDIS: &str = "redis://user:secret@127.0.0.1:1";

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test did not finish in time")
}

/// A proxy with an admin listener, `extra` appended to the config.
fn with_admin(extra: &str) -> TestProxy {
    TestProxy::start(&config(&format!("admin:\n  address: 127.0.0.1:0\n{extra}")))
}

async fn admin_get(proxy: &TestProxy, path: &str) -> Reply {
    Http::new()
        .get(&format!("http://{}{path}", proxy.admin_addr()))
        .await
}

/// The value of the sample `series` (name and labels exactly as exposed) in a scrape.
fn sample(scrape: &str, series: &str) -> Option<u64> {
    scrape.lines().find_map(|l| {
        let value = l.strip_prefix(series)?.strip_prefix(' ')?;
        value.trim().parse().ok()
    })
}

/// One route `api` answering 200 itself, with the `limits:` items given.
fn answering(limits: &str) -> String {
    format!(
        "routes:\n  - name: api\n    match: {{ path_prefix: /api/ }}\n    \
         respond: {{ status: 200, body: \"ok\\n\" }}\n    limits:\n{limits}"
    )
}

/// The Redis backend at `DEAD_REDIS`, then `rest`.
fn dead_redis(rest: &str) -> String {
    format!("limiter:\n  backend: redis\n  redis:\n    url: \"{DEAD_REDIS}\"\n{rest}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_and_readyz_without_redis() {
    bounded(async {
        let proxy = with_admin(&answering(
            "      - { name: per-ip, rate: 1/s, burst: 5, key: [ip] }\n",
        ));
        let r = admin_get(&proxy, "/healthz").await;
        assert_eq!((r.code(), r.text()), (200, "ok\n"));
        let r = admin_get(&proxy, "/readyz").await;
        assert_eq!((r.code(), r.text()), (200, "ready\n"));
        assert_eq!(admin_get(&proxy, "/nothing-here").await.code(), 404);
        // The admin endpoints live on the admin listener only, not on the proxy's port.
        let r = Http::new().get(&proxy.url("/healthz")).await;
        assert_eq!(r.code(), 404, "no route matches /healthz on the proxy port");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_429s_exactly() {
    bounded(async {
        let proxy = with_admin(&answering(
            "      - { name: per-ip, rate: 1/min, burst: 3, key: [ip] }\n",
        ));
        let http = Http::new();
        let (n, burst) = (10u64, 3u64);
        let codes = http.statuses(n as usize, &proxy.url("/api/x"), &[]).await;
        let limited = codes.iter().filter(|&&c| c == 429).count() as u64;
        assert_eq!(limited, n - burst, "{codes:?}");
        assert_eq!(http.get(&proxy.url("/elsewhere")).await.code(), 404);

        let r = admin_get(&proxy, "/metrics").await;
        assert_eq!(r.code(), 200);
        // Without an Accept header asking for OpenMetrics: the Prometheus text format.
        assert_eq!(
            r.header("content-type"),
            "text/plain; version=0.0.4; charset=utf-8"
        );
        let s = r.text();
        let count = |series: &str| {
            sample(s, series).unwrap_or_else(|| panic!("no `{series}` in the scrape:\n{s}"))
        };
        let decision = |outcome: &str| {
            count(&format!(
                r#"tollgate_limit_decisions_total{{route="api",limit="per-ip",outcome="{outcome}"}}"#
            ))
        };
        assert_eq!(decision("limited"), (n - burst));
        assert_eq!(decision("admitted"), burst);
        assert_eq!(
            count(r#"tollgate_requests_total{route="api",code="429",class="4xx"}"#),
            (n - burst)
        );
        assert_eq!(
            count(r#"tollgate_requests_total{route="api",code="200",class="2xx"}"#),
            burst
        );
        // The unmatched request has no route and made no decision.
        assert_eq!(
            count(r#"tollgate_requests_total{route="",code="404",class="4xx"}"#),
            1
        );
        assert_eq!(count(r#"tollgate_local_buckets{limit="per-ip"}"#), 1);
        assert_eq!(count("tollgate_config_generation"), 1);
        assert_eq!(
            count(r#"tollgate_config_reloads_total{result="failed"}"#),
            0
        );
        assert!(count("tollgate_open_connections") >= 1);
    })
    .await;
}

/// Prometheus's own Accept header gets OpenMetrics (counters' families without `_total`, the
/// body ending `# EOF`); any other client the text format.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_format_follows_the_accept_header() {
    bounded(async {
        let proxy = with_admin(&answering(
            "      - { name: per-ip, rate: 1/min, burst: 3, key: [ip] }\n",
        ));
        assert_eq!(Http::new().get(&proxy.url("/api/x")).await.code(), 200);
        let url = format!("http://{}/metrics", proxy.admin_addr());
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        let r = Http::new().get_with(&url, &[("accept", prometheus)]).await;
        assert_eq!(
            r.header("content-type"),
            "application/openmetrics-text; version=1.0.0; charset=utf-8"
        );
        let om = r.text();
        assert!(om.ends_with("# EOF\n"), "{om}");
        assert!(om.contains("# TYPE tollgate_requests counter\n"), "{om}");
        assert!(om.contains("# TYPE tollgate_build info\n"), "{om}");
        for accept in ["*/*", "text/plain", "text/plain;version=0.0.4"] {
            let r = Http::new().get_with(&url, &[("accept", accept)]).await;
            assert_eq!(
                r.header("content-type"),
                "text/plain; version=0.0.4; charset=utf-8",
                "{accept}"
            );
            let text = r.text();
            assert!(!text.contains("# EOF"), "{text}");
            assert!(text.contains("# TYPE tollgate_requests_total counter\n"), "{text}");
            assert!(text.contains("# TYPE tollgate_build_info gauge\n"), "{text}");
        }
    })
    .await;
}

/// A request two limits would reject counts `limited` once, on the limit that answered (the
/// first of the route's that rejected); the route's other limits count `rejected_by_other`,
/// since none took a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_rejected_by_two_limits_counts_limited_once() {
    bounded(async {
        let proxy = with_admin(&answering(
            "      - { name: wide, rate: 1/min, burst: 2, key: [ip] }\n      \
             - { name: narrow, rate: 1/min, burst: 1, key: [ip] }\n",
        ));
        let codes = Http::new().statuses(4, &proxy.url("/api/x"), &[]).await;
        assert_eq!(codes, [200, 429, 429, 429]);
        let s = admin_get(&proxy, "/metrics").await.text().to_owned();
        let decision = |limit: &str, outcome: &str| {
            let series = format!(
                r#"tollgate_limit_decisions_total{{route="api",limit="{limit}",outcome="{outcome}"}}"#
            );
            sample(&s, &series).unwrap_or_else(|| panic!("no `{series}` in:\n{s}"))
        };
        // `narrow` rejected the last three. `wide` alone would have admitted them (it kept its
        // second token), and took no token either: it counts them `rejected_by_other`.
        assert_eq!(decision("narrow", "limited"), 3);
        assert_eq!(decision("narrow", "admitted"), 1);
        assert_eq!(decision("wide", "limited"), 0);
        assert_eq!(decision("wide", "rejected_by_other"), 3);
        assert_eq!(decision("wide", "admitted"), 1);
        let limited: u64 = ["wide", "narrow"].iter().map(|l| decision(l, "limited")).sum();
        assert_eq!(
            Some(limited),
            sample(&s, r#"tollgate_requests_total{route="api",code="429",class="4xx"}"#),
            "one `limited` per 429"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_masks_the_redis_password() {
    bounded(async {
        let proxy = with_admin(&dead_redis(&answering(
            "      - { name: per-ip, rate: 1/s, burst: 5, key: [ip] }\n",
        )));
        let r = admin_get(&proxy, "/config").await;
        assert_eq!(r.code(), 200);
        let text = r.text();
        assert!(
            text.contains(r#"url: "redis://user:***@127.0.0.1:1""#),
            "{text}"
        );
        assert!(!text.contains("secret"), "the password leaked: {text}");
        // The rest is the config as loaded.
        assert!(text.contains("name: per-ip"), "{text}");
        assert!(text.contains("backend: redis"), "{text}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_with_redis_down_is_503_only_with_a_fail_closed_limit() {
    bounded(async {
        for (policy, want) in [
            ("", 200),
            (", on_failure: open", 200),
            (", on_failure: local", 200),
            (", on_failure: closed", 503),
            // A shadow limit never rejects, so it cannot make the proxy unready.
            (", on_failure: closed, shadow: true", 200),
        ] {
            let proxy = with_admin(&dead_redis(&answering(&format!(
                "      - {{ name: per-ip, rate: 1/s, burst: 5, key: [ip]{policy} }}\n"
            ))));
            let r = admin_get(&proxy, "/readyz").await;
            assert_eq!(r.code(), want, "limit with `{policy}`: {}", r.text());
            assert_eq!(admin_get(&proxy, "/healthz").await.code(), 200, "{policy}");
            if want == 503 {
                assert!(r.text().contains("Redis"), "{}", r.text());
                assert!(r.text().contains("fail closed"), "{}", r.text());
            }
        }
    })
    .await;
}

/// A listener's connections are spread evenly over the workers, whichever worker's socket the
/// kernel hands each one to, and a closed connection leaves its worker's count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_spread_evenly_over_the_workers() {
    bounded(async {
        let yaml = config(&format!(
            "admin:\n  address: 127.0.0.1:0\n{}",
            answering("      - { name: per-ip, rate: 100/s, burst: 100, key: [ip] }\n")
        ));
        let proxy = TestProxy::start_with_workers(&yaml, 4);
        let workers = |scrape: &str| -> Vec<u64> {
            (0..4)
                .map(|w| {
                    let series = format!(r#"tollgate_worker_connections{{worker="{w}"}}"#);
                    sample(scrape, &series).unwrap_or(0)
                })
                .collect()
        };
        // Each connection sends a request and waits for its answer, so it is being served
        // (by one worker or another) before the next one opens.
        let mut open = Vec::new();
        for _ in 0..12 {
            let mut c = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
            c.write_all(b"GET /api/x HTTP/1.1\r\nHost: t\r\n\r\n")
                .await
                .unwrap();
            let mut buf = [0u8; 512];
            let n = c.read(&mut buf).await.unwrap();
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
            open.push(c);
        }
        let scrape = admin_get(&proxy, "/metrics").await.text().to_owned();
        assert_eq!(workers(&scrape), [3, 3, 3, 3], "{scrape}");
        open.truncate(4);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let scrape = admin_get(&proxy, "/metrics").await.text().to_owned();
            let counts = workers(&scrape);
            if counts.iter().sum::<u64>() == 4 {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{counts:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// The config series follow the reloads: a new file changes the hash and the load time, a
/// broken one sets `last_reload_successful` to 0 and leaves the hash of the config still live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_metrics_follow_reloads() {
    bounded(async {
        let limits = |burst: u32| {
            format!("      - {{ name: per-ip, rate: 1/min, burst: {burst}, key: [ip] }}\n")
        };
        let yaml = |burst| {
            config(&format!(
                "admin:\n  address: 127.0.0.1:0\n{}",
                answering(&limits(burst))
            ))
        };
        let proxy = TestProxy::start(&yaml(3));
        // The load time is a float; every other series here is a whole number.
        let seconds = |s: &str| -> f64 {
            let name = "tollgate_config_last_reload_success_timestamp_seconds ";
            s.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
                .unwrap_or_else(|| panic!("no load time in:\n{s}"))
        };
        let read = |s: &str, name: &str| -> u64 {
            sample(s, name).unwrap_or_else(|| panic!("no `{name}` in:\n{s}"))
        };
        let scrape = async || admin_get(&proxy, "/metrics").await.text().to_owned();
        let first = scrape().await;
        assert_eq!(read(&first, "tollgate_config_last_reload_successful"), 1);
        let (hash, loaded) = (read(&first, "tollgate_config_hash"), seconds(&first));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(loaded <= now && loaded > now - 60.0, "{loaded} vs {now}");

        std::fs::write(proxy.config_path(), yaml(4)).expect("rewrite the config");
        proxy.reload();
        assert!(proxy.wait_for_generation(2, TEST_TIMEOUT).await);
        let second = scrape().await;
        assert_ne!(read(&second, "tollgate_config_hash"), hash);
        assert!(seconds(&second) >= loaded);
        assert_eq!(read(&second, "tollgate_config_last_reload_successful"), 1);

        std::fs::write(proxy.config_path(), "listeners: [").expect("break the config");
        proxy.reload();
        let deadline = tokio::time::Instant::now() + TEST_TIMEOUT;
        let third = loop {
            let s = scrape().await;
            if read(&s, r#"tollgate_config_reloads_total{result="failed"}"#) >= 1 {
                break s;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the failed reload is counted"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(read(&third, "tollgate_config_last_reload_successful"), 0);
        assert_eq!(
            read(&third, "tollgate_config_hash"),
            read(&second, "tollgate_config_hash"),
            "the live config is still the second one"
        );
    })
    .await;
}

/// The admin listener bounds its clients itself: a request head within 10 s, at most 64
/// connections, the oldest closed for a newcomer so that probes are always answered. Served
/// inline under tokio's paused clock, so the 10 s pass at once.
#[tokio::test(start_paused = true)]
async fn the_admin_listener_closes_slow_heads_and_caps_its_connections() {
    let proxy = common::TestProxy::inline(&common::config(
        "admin: { address: 127.0.0.1:0 }\nroutes:\n  - name: all\n    respond: { status: 200 }\n",
    ))
    .await;
    let admin = proxy.admin_addr();
    let started = tokio::time::Instant::now();
    let mut slow = tokio::net::TcpStream::connect(admin).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = slow.read(&mut buf).await.unwrap_or(0);
    let waited = started.elapsed();
    assert!(
        n == 0 || buf[..n].starts_with(b"HTTP/1.1 408"),
        "an unfinished head is closed: {:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    assert!(
        waited >= std::time::Duration::from_secs(10) && waited < std::time::Duration::from_mins(1),
        "after the head timeout: {waited:?}"
    );
    // 64 stalled request heads, then a probe: it is answered at once, and the oldest stalled
    // connection is closed to make room for it.
    let mut open = Vec::new();
    for _ in 0..64 {
        let mut s = tokio::net::TcpStream::connect(admin).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\n")
            .await
            .unwrap();
        open.push(s);
    }
    tokio::task::yield_now().await;
    let before = tokio::time::Instant::now();
    let mut probe = tokio::net::TcpStream::connect(admin).await.unwrap();
    probe
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    probe.read_to_end(&mut answer).await.unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    assert!(
        before.elapsed() < std::time::Duration::from_secs(1),
        "at once"
    );
    let n = open[0].read(&mut buf).await.unwrap_or(0);
    assert!(
        n == 0 || buf[..n].starts_with(b"HTTP/1.1 408"),
        "the oldest was closed"
    );
    drop(open);
    proxy.shutdown().await;
}
