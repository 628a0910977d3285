//! Limits end to end: burst then 429 with every header, refill against the token-bucket formula,
//! cost, shadow, exempt, several limits on one route, and many clients racing for one bucket.
//!
//! The proxies are served in-process (`TestProxy`). Refill tests whose route answers itself run
//! the proxy on the test's own runtime (`TestProxy::inline`) with tokio's clock paused: the
//! limiter reads that clock, so `tokio::time::advance` (or a `sleep`, which then returns at once)
//! refills buckets without waiting, to the microsecond. One refill test stays on real time.

use crate::common;

use std::time::{Duration, Instant};

use common::{config, upstream_app, Http, MockUpstream, Reply, TestProxy};

/// A proxy with one route `r` forwarding everything to `up`, with the given `limits:` items.
fn forwarding(up: &MockUpstream, limits: &str) -> TestProxy {
    TestProxy::start(&config(&format!(
        "{}routes:\n  - name: r\n    upstream: app\n    limits:\n{limits}",
        upstream_app(up.addr(), "5s")
    )))
}

/// A proxy with one `respond` route answering 200 to everything, with the given limits.
fn answering(limits: &str) -> TestProxy {
    TestProxy::start(&answering_config(limits))
}

/// `answering`, served on the calling runtime: under a paused clock, the proxy's time is the
/// test's. Only for routes that answer themselves: an upstream on a thread of its own would be
/// waited for on real time while the paused clock jumps ahead to the next timer.
async fn answering_inline(limits: &str) -> TestProxy {
    TestProxy::inline(&answering_config(limits)).await
}

fn answering_config(limits: &str) -> String {
    config(&format!(
        "routes:\n  - name: r\n    respond: {{ status: 200, body: \"ok\\n\" }}\n    limits:\n{limits}"
    ))
}

fn problem(r: &Reply) -> serde_json::Value {
    assert_eq!(r.header("content-type"), "application/problem+json");
    serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("429 body is not JSON ({e}): {}", r.text()))
}

#[tokio::test]
async fn burst_then_429_with_headers_and_the_upstream_never_sees_rejections() {
    let up = MockUpstream::start();
    let proxy = forwarding(
        &up,
        "      - { name: per-ip, rate: 1/min, burst: 3, key: [ip] }\n",
    );
    let http = Http::new();
    for (used, left) in [(1, 2), (2, 1), (3, 0)] {
        let r = http.get(&proxy.url("/v1/items")).await;
        assert_eq!(r.code(), 200, "request {used} of the burst");
        assert_eq!(
            r.header("x-upstream"),
            "mock",
            "the upstream's own response"
        );
        assert_eq!(r.header("ratelimit-policy"), r#""per-ip";q=3;w=180"#);
        // One token per 60 s: the bucket is full again `used` minutes from now.
        let t = used * 60;
        assert_eq!(r.header("ratelimit"), format!(r#""per-ip";r={left};t={t}"#));
        assert_eq!(r.header("x-ratelimit-limit"), "3");
        assert_eq!(r.header("x-ratelimit-remaining"), left.to_string());
        assert_eq!(r.header("x-ratelimit-reset"), t.to_string());
        assert!(r.opt_header("retry-after").is_none());
    }
    for _ in 0..2 {
        let r = http.get(&proxy.url("/v1/items")).await;
        assert_eq!(r.code(), 429);
        assert_eq!(r.header("retry-after"), "60");
        assert_eq!(r.header("ratelimit-policy"), r#""per-ip";q=3;w=180"#);
        assert_eq!(r.header("ratelimit"), r#""per-ip";r=0;t=180"#);
        assert_eq!(r.header("x-ratelimit-limit"), "3");
        assert_eq!(r.header("x-ratelimit-remaining"), "0");
        assert_eq!(r.header("x-ratelimit-reset"), "180");
        assert!(r.opt_header("x-upstream").is_none());
        let body = problem(&r);
        assert_eq!(body["status"], 429);
        assert_eq!(body["title"], "Too Many Requests");
        assert_eq!(body["limit"], "per-ip");
        assert!(
            body["detail"].as_str().unwrap().contains("per-ip"),
            "{body}"
        );
    }
    assert_eq!(
        up.count(),
        3,
        "rejected requests must not reach the upstream"
    );
}

#[tokio::test]
async fn retry_after_rounds_up_to_whole_seconds_and_is_at_least_one() {
    // 4/s: a token every 250 ms, so the wait is well under a second but must read as 1.
    let proxy = answering("      - { name: fast, rate: 4/s, burst: 1, key: [ip] }\n");
    let http = Http::new();
    assert_eq!(http.get(&proxy.url("/")).await.code(), 200);
    let r = http.get(&proxy.url("/")).await;
    assert_eq!(r.code(), 429);
    assert_eq!(r.header("retry-after"), "1");
    assert_eq!(r.header("ratelimit-policy"), r#""fast";q=1;w=1"#);
    assert_eq!(r.header("ratelimit"), r#""fast";r=0;t=1"#);
}

#[tokio::test]
async fn x_ratelimit_headers_can_be_turned_off() {
    let proxy = TestProxy::start(&config(
        "rate_limit_headers: { x_ratelimit: false }\n\
         routes:\n  - name: r\n    respond: { status: 200 }\n    limits:\n\
         \x20     - { name: l, rate: 1/min, burst: 1, key: [ip] }\n",
    ));
    let http = Http::new();
    for code in [200, 429] {
        let r = http.get(&proxy.url("/")).await;
        assert_eq!(r.code(), code);
        assert!(r.opt_header("ratelimit").is_some());
        assert!(r.opt_header("ratelimit-policy").is_some());
        for h in [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ] {
            assert!(r.opt_header(h).is_none(), "{h} was turned off");
        }
    }
}

/// On the paused clock: the 2 s take no real time, and each `sleep` advances it exactly.
#[tokio::test(start_paused = true)]
async fn admitted_requests_follow_the_token_bucket_formula() {
    use tokio::time::Instant;
    // 10/s with a burst of 5, hammered for 2 s: the bucket never fills up again, so exactly
    // burst + rate * elapsed requests can pass (a token every 100 ms after the first five).
    let proxy =
        answering_inline("      - { name: refill, rate: 10/s, burst: 5, key: [ip] }\n").await;
    let http = Http::new();
    let url = proxy.url("/");
    let (mut admitted, mut rejected) = (0u32, 0u32);
    let first = Instant::now();
    let mut last_sent = first;
    while first.elapsed() < Duration::from_secs(2) {
        last_sent = Instant::now();
        match http.get(&url).await.code() {
            200 => admitted += 1,
            429 => rejected += 1,
            other => panic!("unexpected status {other}"),
        }
        // On the paused clock a request takes no time, and a poll every 10 ms lands on each
        // token's return (every 100 ms) exactly.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let elapsed = last_sent.duration_since(first).as_secs_f64();
    // Tokens return at 100 ms, 200 ms, ...: only whole ones count.
    let expected = 5.0 + (10.0 * elapsed).floor();
    eprintln!(
        "refill: {admitted} admitted, {rejected} rejected in {elapsed:.3} s; \
         the formula gives {expected}"
    );
    assert!(rejected > 0, "the bucket was never emptied");
    assert!(
        (f64::from(admitted) - expected).abs() <= 1.0,
        "{admitted} admitted in {elapsed:.3} s, expected {expected} (5 + 10/s)"
    );
}

/// On real time (the proxy on threads of its own): the one refill test that shows the limiter's
/// clock runs at the wall clock's pace when nothing pauses it.
#[tokio::test]
async fn a_token_comes_back_after_one_token_interval() {
    // 4/s: once the single token is taken, the next one exists 250 ms later, not before.
    let proxy = answering("      - { name: tick, rate: 4/s, burst: 1, key: [ip] }\n");
    let http = Http::new();
    let url = proxy.url("/");
    let taken_sent = Instant::now();
    assert_eq!(http.get(&url).await.code(), 200);
    let taken_done = Instant::now();
    loop {
        let sent = Instant::now();
        let code = http.get(&url).await.code();
        let done = Instant::now();
        if code == 200 {
            // The proxy took the first token between `taken_sent` and `taken_done` and gave
            // this one between `sent` and `done`: the interval lies between these bounds.
            let shortest = sent.duration_since(taken_done);
            let longest = done.duration_since(taken_sent);
            eprintln!(
                "token interval: between {:.1} ms and {:.1} ms (expected 250 ms)",
                shortest.as_secs_f64() * 1e3,
                longest.as_secs_f64() * 1e3
            );
            assert!(
                longest >= Duration::from_millis(249),
                "a token came back after at most {longest:?}, before 250 ms"
            );
            assert!(
                shortest <= Duration::from_millis(400),
                "a token took at least {shortest:?} to come back, expected 250 ms"
            );
            return;
        }
        assert_eq!(code, 429);
        assert!(
            taken_done.elapsed() < Duration::from_secs(2),
            "no token came back"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A spent burst on the paused clock: one token back after exactly a minute, none before.
#[tokio::test(start_paused = true)]
async fn a_spent_burst_refills_one_token_a_minute_on_a_paused_clock() {
    let proxy =
        answering_inline("      - { name: slow, rate: 1/min, burst: 2, key: [ip] }\n").await;
    let http = Http::new();
    let url = proxy.url("/");
    assert_eq!(http.statuses(2, &url, &[]).await, [200, 200]);
    let r = http.get(&url).await;
    assert_eq!(r.code(), 429);
    assert_eq!(r.header("retry-after"), "60");
    assert_eq!(r.header("ratelimit"), r#""slow";r=0;t=120"#);

    // A second short of the token: still limited, and told to wait that second.
    tokio::time::advance(Duration::from_secs(59)).await;
    let r = http.get(&url).await;
    assert_eq!(r.code(), 429);
    assert_eq!(r.header("retry-after"), "1");
    assert_eq!(r.header("ratelimit"), r#""slow";r=0;t=61"#);

    // The minute is up: one token, and only one.
    tokio::time::advance(Duration::from_secs(1)).await;
    let r = http.get(&url).await;
    assert_eq!(r.code(), 200, "{:?}", r.headers);
    assert_eq!(r.header("ratelimit"), r#""slow";r=0;t=120"#);
    let r = http.get(&url).await;
    assert_eq!(r.code(), 429);
    assert_eq!(r.header("retry-after"), "60");
    assert_eq!(problem(&r)["limit"], "slow");
}

#[tokio::test]
async fn cost_takes_several_tokens_per_request() {
    let proxy = answering("      - { name: costly, rate: 1/min, burst: 5, cost: 2, key: [ip] }\n");
    let http = Http::new();
    for left in ["3", "1"] {
        let r = http.get(&proxy.url("/")).await;
        assert_eq!(r.code(), 200);
        assert_eq!(r.header("x-ratelimit-remaining"), left);
    }
    // One token left, two needed: a minute until the second one.
    let r = http.get(&proxy.url("/")).await;
    assert_eq!(r.code(), 429);
    assert_eq!(r.header("x-ratelimit-remaining"), "1");
    assert_eq!(r.header("retry-after"), "60");
}

/// One route with only a shadow limit, one with a shadow limit before an enforced one.
fn shadow_routes(up: &MockUpstream) -> TestProxy {
    TestProxy::start(&config(&format!(
        "{}routes:
  - name: dry
    match: {{ path_prefix: /dry/ }}
    upstream: app
    limits:
      - {{ name: dry-run, rate: 1/min, burst: 1, key: [ip], shadow: true }}
  - name: mixed
    match: {{ path_prefix: /mixed/ }}
    upstream: app
    limits:
      - {{ name: mixed-shadow, rate: 1/min, burst: 1, key: [ip], shadow: true }}
      - {{ name: mixed-enforced, rate: 1/min, burst: 3, key: [ip] }}
",
        upstream_app(up.addr(), "5s")
    )))
}

#[tokio::test]
async fn shadow_limits_never_reject_and_never_block_enforced_ones() {
    let up = MockUpstream::start();
    let proxy = shadow_routes(&up);
    let http = Http::new();
    let statuses = http.statuses(5, &proxy.url("/dry/x"), &[]).await;
    assert_eq!(statuses, [200; 5], "a shadow limit never rejects");
    assert_eq!(
        up.count(),
        5,
        "the upstream sees every request of a shadow limit"
    );

    // The shadow limit is over after one request; the enforced one still admits three.
    let statuses = http.statuses(4, &proxy.url("/mixed/x"), &[]).await;
    assert_eq!(statuses, [200, 200, 200, 429]);
    let r = http.get(&proxy.url("/mixed/x")).await;
    assert_eq!(problem(&r)["limit"], "mixed-enforced");
    assert_eq!(
        r.header("ratelimit-policy"),
        r#""mixed-enforced";q=3;w=180"#
    );
    assert_eq!(up.count(), 8);
}

/// `Decision::reported` documents that shadow limits are never shown to clients ("a dry run
/// must not change what they see"), so turning `shadow: true` on must leave headers as they
/// were without the limit.
#[tokio::test]
async fn shadow_limits_do_not_appear_in_rate_limit_headers() {
    let up = MockUpstream::start();
    let proxy = shadow_routes(&up);
    let http = Http::new();
    for i in 1..=3 {
        let r = http.get(&proxy.url("/dry/x")).await;
        assert_eq!(r.code(), 200);
        assert!(
            r.opt_header("ratelimit").is_none() && r.opt_header("x-ratelimit-limit").is_none(),
            "request {i} on a route with only a shadow limit carries its headers: {:?}",
            r.headers
        );
    }
    // The shadow limit has fewer tokens left (0) than the enforced one (2), yet only the
    // enforced one may be reported.
    let r = http.get(&proxy.url("/mixed/x")).await;
    assert_eq!(r.code(), 200);
    assert_eq!(r.header("ratelimit"), r#""mixed-enforced";r=2;t=60"#);
}

#[tokio::test]
async fn exempt_networks_are_never_limited() {
    let proxy = TestProxy::start(&config(
        "routes:
  - name: one
    match: { path_prefix: /one/ }
    respond: { status: 200 }
    limits:
      - { name: one-ip, rate: 1/min, burst: 1, key: [ip], exempt: [127.0.0.2/32] }
  - name: all
    match: { path_prefix: /all/ }
    respond: { status: 200 }
    limits:
      - { name: all-ip, rate: 1/min, burst: 1, key: [ip], exempt: [127.0.0.0/8] }
",
    ));
    let exempt = Http::from_ip("127.0.0.2");
    let other = Http::from_ip("127.0.0.3");
    let local = Http::new();
    assert_eq!(exempt.statuses(5, &proxy.url("/one/"), &[]).await, [200; 5]);
    assert_eq!(
        other.statuses(2, &proxy.url("/one/"), &[]).await,
        [200, 429]
    );
    assert_eq!(
        local.statuses(2, &proxy.url("/one/"), &[]).await,
        [200, 429]
    );
    for client in [&exempt, &other, &local] {
        assert_eq!(client.statuses(3, &proxy.url("/all/"), &[]).await, [200; 3]);
    }
}

#[tokio::test]
async fn exempt_identities_are_never_limited() {
    let proxy = answering(
        "      - name: keyed
        rate: 1/min
        burst: 1
        key: [header:X-API-Key, ip]
        exempt: [\"header:X-API-Key=internal\"]
",
    );
    let http = Http::new();
    let url = proxy.url("/");
    let internal = [("x-api-key", "internal")];
    assert_eq!(http.statuses(5, &url, &internal).await, [200; 5]);
    let other = [("x-api-key", "internal-not")];
    assert_eq!(http.statuses(2, &url, &other).await, [200, 429]);
    assert_eq!(http.statuses(2, &url, &[]).await, [200, 429]);
    // Still exempt after the others ran out.
    assert_eq!(http.statuses(2, &url, &internal).await, [200; 2]);
}

#[tokio::test]
async fn a_request_rejected_by_one_limit_takes_no_token_from_another() {
    let up = MockUpstream::start();
    let proxy = forwarding(
        &up,
        "      - { name: everyone, rate: 1/min, burst: 3, key: [global] }
      - { name: per-key, rate: 1/min, burst: 1, key: [header:X-Key] }
",
    );
    let http = Http::new();
    let url = proxy.url("/");
    let r = http.get_with(&url, &[("x-key", "k1")]).await;
    assert_eq!(r.code(), 200);
    // The limit closest to rejecting is reported: per-key has 0 left, everyone 2.
    assert_eq!(r.header("ratelimit"), r#""per-key";r=0;t=60"#);
    for _ in 0..5 {
        let r = http.get_with(&url, &[("x-key", "k1")]).await;
        assert_eq!(r.code(), 429);
        assert_eq!(problem(&r)["limit"], "per-key");
    }
    // Had those five rejections been charged to `everyone`, it would be empty now.
    for key in ["k2", "k3"] {
        let r = http.get_with(&url, &[("x-key", key)]).await;
        assert_eq!(r.code(), 200, "key {key}");
    }
    let r = http.get_with(&url, &[("x-key", "k4")]).await;
    assert_eq!(r.code(), 429);
    assert_eq!(problem(&r)["limit"], "everyone");
    assert_eq!(r.header("ratelimit"), r#""everyone";r=0;t=180"#);
    assert_eq!(up.count(), 3);
}

/// A worker writes a repeated 429 again from the last one it wrote: two limits rejecting with
/// the same numbers, taking turns on one connection, must each still get their own 429.
#[tokio::test]
async fn two_limits_with_the_same_numbers_each_get_their_own_429() {
    let proxy = TestProxy::start(&config(
        "routes:\n\
         \x20 - name: a\n    match: { path_prefix: /a }\n    respond: { status: 200 }\n    limits:\n\
         \x20     - { name: limit-a, rate: 1/min, burst: 1, key: [ip] }\n\
         \x20 - name: b\n    match: { path_prefix: /b }\n    respond: { status: 200 }\n    limits:\n\
         \x20     - { name: limit-b, rate: 1/min, burst: 2, key: [ip] }\n",
    ));
    let http = Http::new();
    assert_eq!(http.get(&proxy.url("/a")).await.code(), 200);
    assert_eq!(http.statuses(2, &proxy.url("/b"), &[]).await, [200; 2]);
    let a = ("/a", "limit-a", 1, 60);
    let b = ("/b", "limit-b", 2, 120);
    // Each one twice in a row (written, then repeated), then the other.
    for _ in 0..2 {
        for (path, name, q, t) in [a, a, b, b] {
            let r = http.get(&proxy.url(path)).await;
            assert_eq!(r.code(), 429, "{path}");
            assert_eq!(problem(&r)["limit"], name);
            assert_eq!(r.header("retry-after"), "60");
            assert_eq!(
                r.header("ratelimit-policy"),
                format!(r#""{name}";q={q};w={t}"#)
            );
            assert_eq!(r.header("ratelimit"), format!(r#""{name}";r=0;t={t}"#));
            assert_eq!(r.header("x-ratelimit-limit"), q.to_string());
        }
    }
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_never_get_more_than_the_burst() {
    let up = MockUpstream::start();
    let proxy = forwarding(
        &up,
        "      - { name: shared, rate: 0.001/s, burst: 50, key: [global] }\n",
    );
    let http = Http::new();
    let url = proxy.url("/race");
    let tasks: Vec<_> = (0..300)
        .map(|_| {
            let (http, url) = (http.clone(), url.clone());
            tokio::spawn(async move { http.get(&url).await.code() })
        })
        .collect();
    let (mut ok, mut limited) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            200 => ok += 1,
            429 => limited += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!((ok, limited), (50, 250));
    assert_eq!(up.count(), 50);
}
