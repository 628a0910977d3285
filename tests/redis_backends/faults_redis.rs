//! Redis faults through the real proxy: Redis's wall clock stepping back and forward (a real
//! redis-server under libfaketime), replies lost on a live connection (a TCP relay between the
//! proxy and redis-server that swallows them), and readiness that runs the bucket script.
//!
//! The proxies are served in-process (`TestProxy`) on real time: refills are Redis's.

use crate::common;
use crate::common::redis as redis_helpers;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{config, Http, Reply, TestProxy};
use redis_helpers::RedisServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// No test here may take longer than this, whatever the proxy does.
const TEST_TIMEOUT: Duration = Duration::from_secs(40);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test did not finish in time")
}

/// Route `/warm` (a roomy limit, to see Redis answer without touching the bucket under test)
/// and every other path under `per-ip`: `rate`, `burst`, failing closed, so a 200 is always
/// Redis's decision.
fn limited(url: &str, timeout: &str, rate: &str, burst: u32) -> String {
    config(&format!(
        "admin:\n  address: 127.0.0.1:0\n\
         limiter:\n  backend: redis\n  redis:\n    url: \"{url}\"\n    timeout: {timeout}\n\
         routes:\n  - name: warm\n    match: {{ path: /warm }}\n    respond: {{ status: 200 }}\n    \
         limits:\n      - {{ name: warm, rate: 1000/s, burst: 1000, key: [ip], on_failure: closed }}\n  \
         - name: api\n    respond: {{ status: 200 }}\n    limits:\n      \
         - {{ name: per-ip, rate: {rate}, burst: {burst}, key: [ip], on_failure: closed }}\n"
    ))
}

/// Poll `/warm` until Redis decides it (200), for up to 10 s.
async fn until_redis_answers(http: &Http, proxy: &TestProxy) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while http.get(&proxy.url("/warm")).await.code() != 200 {
        assert!(Instant::now() < deadline, "Redis never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn retry_after(r: &Reply) -> u64 {
    r.header("retry-after")
        .parse()
        .expect("Retry-After is whole seconds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_clock_stepped_back_withholds_at_most_one_period() {
    bounded(async {
        // The failover case: buckets written by a Redis whose clock ran an hour ahead, then
        // read by one on the right time (or the same one after an NTP step).
        let server = RedisServer::start_with_fake_clock();
        server.set_clock_offset(3600);
        // 1/s, burst 3: the refill period (tau) is 3 s.
        let proxy = TestProxy::start(&limited(&server.url(), "1s", "1/s", 3));
        let http = Http::new();
        until_redis_answers(&http, &proxy).await;
        let api = proxy.url("/api");
        assert_eq!(http.statuses(3, &api, &[]).await, [200, 200, 200]);
        let r = http.get(&api).await;
        assert_eq!(r.code(), 429);
        // Past the rejection the proxy's negative cache replays (a token's time, 1 s), so the
        // next check asks Redis.
        tokio::time::sleep(Duration::from_millis(1200)).await;

        server.set_clock_offset(0);
        let stepped = Instant::now();
        // Clamped to one token left: the first request passes, the next is refused for at
        // most the period.
        let r = http.get(&api).await;
        assert_eq!(r.code(), 200, "{:?}", r.text());
        let r = http.get(&api).await;
        assert_eq!(r.code(), 429, "{:?}", r.text());
        let first = retry_after(&r);
        assert!(
            first <= 3,
            "Retry-After {first} s after the clock stepped back an hour: more than the 3 s period"
        );
        // And it tells the truth: admitted again within the period, the negative cache too.
        let mut longest = first;
        let admitted_after = loop {
            let r = http.get(&api).await;
            if r.code() == 200 {
                break stepped.elapsed();
            }
            longest = longest.max(retry_after(&r));
            assert!(
                stepped.elapsed() < Duration::from_secs(5),
                "still rejected {:?} after the clock step: {:?}",
                stepped.elapsed(),
                r.text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(longest <= 3, "a Retry-After of {longest} s");
        println!(
            "clock stepped back 3600 s: Retry-After {first} s (longest seen {longest} s), \
             admitted again {} ms after the step (period 3 s)",
            admitted_after.as_millis()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_clock_stepped_forward_mints_one_bucket() {
    bounded(async {
        let server = RedisServer::start_with_fake_clock();
        let proxy = TestProxy::start(&limited(&server.url(), "1s", "1/min", 3));
        let http = Http::new();
        until_redis_answers(&http, &proxy).await;
        let api = proxy.url("/api");
        // Emptied without a rejection (which the negative cache would replay locally).
        let r: Vec<String> = {
            let mut left = Vec::new();
            for _ in 0..3 {
                let r = http.get(&api).await;
                assert_eq!(r.code(), 200);
                left.push(r.header("x-ratelimit-remaining").to_owned());
            }
            left
        };
        assert_eq!(r, ["2", "1", "0"]);

        // A day forward: the bucket is full, and full is `burst`, not a day of tokens.
        server.set_clock_offset(86_400);
        let after = http.statuses(10, &api, &[]).await;
        let admitted = after.iter().filter(|&&s| s == 200).count();
        assert_eq!(admitted, 3, "after a day's step forward: {after:?}");
        assert_eq!(after[..3], [200, 200, 200]);
        println!("clock stepped forward 86400 s: {admitted} of 10 admitted (burst 3)");
    })
    .await;
}

/// A TCP relay between the proxy and redis-server that passes everything from the proxy to
/// Redis, and passes Redis's replies back unless told to swallow them: the replies are lost,
/// the connection stays up.
struct Swallower {
    addr: SocketAddr,
    swallow: Arc<AtomicBool>,
    swallowed: Arc<AtomicU64>,
}

impl Swallower {
    async fn start(redis: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("an address");
        let swallow = Arc::new(AtomicBool::new(false));
        let swallowed = Arc::new(AtomicU64::new(0));
        let (flag, count) = (swallow.clone(), swallowed.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", redis)).await else {
                    continue;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                });
                let (flag, count) = (flag.clone(), count.clone());
                tokio::spawn(async move {
                    // Redis writes each reply with one write; on loopback a read takes whole
                    // replies, so what is swallowed is whole replies, not a torn one that
                    // would break the client's parser and make it reconnect by itself.
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match server_read.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if flag.load(Ordering::SeqCst) {
                            count.fetch_add(1, Ordering::SeqCst);
                            continue;
                        }
                        if client_write.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            addr,
            swallow,
            swallowed,
        }
    }

    fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_replies_on_a_live_connection_heal_within_seconds() {
    bounded(async {
        let server = RedisServer::start();
        let relay = Swallower::start(server.port()).await;
        // Roomy: every request is admitted when Redis answers, 503 (closed) when it does not.
        let proxy = TestProxy::start(&limited(&relay.url(), "100ms", "10000/s", 10_000));
        let http = Http::new();
        until_redis_answers(&http, &proxy).await;
        let api = proxy.url("/api");
        assert_eq!(http.get(&api).await.code(), 200);

        // Steady traffic while replies are lost for a second.
        relay.swallow.store(true, Ordering::SeqCst);
        let lost_from = Instant::now();
        let mut during = Vec::new();
        while lost_from.elapsed() < Duration::from_secs(1) {
            during.push(http.get(&api).await.code());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        relay.swallow.store(false, Ordering::SeqCst);
        let healed_from = Instant::now();
        let swallowed = relay.swallowed.load(Ordering::SeqCst);
        assert!(swallowed > 0, "no reply was swallowed");
        assert!(during.contains(&503), "{during:?}");

        // Steady traffic goes on: the checks must be decided by Redis again within seconds
        // (20 answered in a row), not after the connection's lag is worked off (never).
        let mut streak = 0;
        let mut first_ok = None;
        while streak < 20 {
            let code = http.get(&api).await.code();
            if code == 200 {
                first_ok.get_or_insert_with(|| healed_from.elapsed());
                streak += 1;
            } else {
                streak = 0;
                first_ok = None;
            }
            assert!(
                healed_from.elapsed() < Duration::from_secs(8),
                "checks still fail {:?} after the replies came back (last {code})",
                healed_from.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let healed = first_ok.expect("a streak has a start");
        let scrape = Http::new()
            .get(&format!("http://{}/metrics", proxy.admin_addr()))
            .await;
        let text = scrape.text();
        assert!(text.contains("tollgate_redis_breaker_open 0"), "{text}");
        let reconnects: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("tollgate_redis_reconnects_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no reconnect counter: {text}"));
        assert!(reconnects >= 1, "{text}");
        println!(
            "replies swallowed for 1 s ({swallowed} reads lost, {} of {} requests failed): \
             checks decided by Redis again {} ms after the replies came back \
             ({reconnects} connection(s) replaced)",
            during.iter().filter(|&&c| c == 503).count(),
            during.len(),
            healed.as_millis()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_runs_the_bucket_script_not_only_ping() {
    bounded(async {
        // A server that answers PING but cannot run the script: EVALSHA renamed away, as an
        // operator locking scripting down (or an ACL without it) would leave it.
        let broken = RedisServer::start_with(&["--rename-command", "EVALSHA", "evalsha-off"]);
        assert!(broken.cli(&["ping"]).contains("PONG"));
        let proxy = TestProxy::start(&limited(&broken.url(), "200ms", "10/s", 10));
        let http = Http::new();
        let readyz = format!("http://{}/readyz", proxy.admin_addr());
        let r = http.get(&readyz).await;
        assert_eq!(r.code(), 503, "{}", r.text());
        assert!(
            r.text().contains("Redis cannot decide limits"),
            "{}",
            r.text()
        );
        println!("readyz with EVALSHA refused: {}", r.text().trim());
        // The checks it stands for fail too (closed: 503), so red was the truth.
        assert_eq!(http.get(&proxy.url("/api")).await.code(), 503);

        let healthy = RedisServer::start();
        let proxy = TestProxy::start(&limited(&healthy.url(), "200ms", "10/s", 10));
        let readyz = format!("http://{}/readyz", proxy.admin_addr());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let r = http.get(&readyz).await;
            if r.code() == 200 {
                break;
            }
            assert!(Instant::now() < deadline, "never ready: {}", r.text());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Readiness touches no key.
        assert!(healthy.keys().is_empty(), "{:?}", healthy.keys());
        // Redis gone: not ready, and the reason says so.
        drop(healthy);
        let deadline = Instant::now() + Duration::from_secs(10);
        let down = loop {
            let r = http.get(&readyz).await;
            if r.code() == 503 {
                break r.text().to_owned();
            }
            assert!(Instant::now() < deadline, "still ready with Redis gone");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(down.contains("Redis cannot decide limits ("), "{down}");
        assert!(
            down.contains("refused") || down.contains("closed"),
            "{down}"
        );
        println!(
            "readiness: 503 with a server that answers PING but not EVALSHA; 200 once it runs"
        );
    })
    .await;
}

/// Keys Redis evicts at its `maxmemory` are shown (`tollgate_redis_evicted_keys`, read at each
/// 5 s sweep), so an operator learns that clients were handed fresh allowances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_keys_are_shown() {
    let redis = RedisServer::start();
    let proxy = TestProxy::start(&limited(&redis.url(), "500ms", "10/s", 10));
    let http = Http::new();
    until_redis_answers(&http, &proxy).await;
    redis.cli(&["debug", "populate", "20000", "filler", "100"]);
    redis.cli(&["config", "set", "maxmemory-policy", "allkeys-random"]);
    redis.cli(&["config", "set", "maxmemory", "1mb"]);
    redis.cli(&["set", "one-more", "x"]);
    let evicted: u64 = redis
        .cli(&["info", "stats"])
        .lines()
        .find_map(|l| l.strip_prefix("evicted_keys:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(evicted > 0, "Redis evicted nothing");
    assert!(
        common::eventually(Duration::from_secs(12), || async {
            common::find_sample::<u64>(&proxy.scrape().await, "tollgate_redis_evicted_keys")
                .is_some_and(|n| n >= evicted)
        })
        .await,
        "tollgate shows the evictions"
    );
}

/// With Redis down, connects are retried at most about once a second per connection, however
/// many requests, readiness probes and background polls come meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_retried_about_once_a_second_per_connection() {
    bounded(async {
        let mut redis = RedisServer::start();
        let proxy = TestProxy::start(&limited(&redis.url(), "200ms", "1000/s", 1000));
        let http = Http::new();
        until_redis_answers(&http, &proxy).await;
        let metrics = format!("http://{}/metrics", proxy.admin_addr());
        let reconnects = || async {
            common::find_sample::<u64>(
                http.get(&metrics).await.text(),
                "tollgate_redis_reconnects_total",
            )
            .unwrap_or(0)
        };
        let before = reconnects().await;
        redis.kill();
        let readyz = format!("http://{}/readyz", proxy.admin_addr());
        let outage = Duration::from_secs(3);
        let started = Instant::now();
        while started.elapsed() < outage {
            let _ = http.get(&proxy.url("/api")).await;
            let _ = http.get(&readyz).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let during = reconnects().await - before;
        println!("{during} reconnects in a {outage:?} outage");
        // Two workers' connections and the control poll's, each at most once a second (plus
        // the first reconnect of each when the connection died).
        assert!(during <= 3 * 5, "{during} reconnects in {outage:?}");
    })
    .await;
}
