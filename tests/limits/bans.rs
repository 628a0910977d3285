//! Escalating bans end to end: an identity a limit rejects `after` times within the window is
//! refused outright for `for`, past its bucket's refill, then let back in on time; the next ban
//! doubles; 429s say it is a ban; bans are counted in the metrics. In process on tokio's paused
//! clock, and fleet-wide over Redis: two replicas sharing one redis-server, each refusing the
//! identity the other banned.

use crate::common;
use crate::common::redis as redis_helpers;

use std::time::{Duration, Instant};

use common::{config, Http, Reply, TestProxy};
use redis_helpers::RedisServer;

fn answering(extra: &str, limits: &str) -> String {
    config(&format!(
        "admin:\n  address: 127.0.0.1:0\n{extra}routes:\n  - name: r\n    respond: {{ status: 200, body: \"ok\\n\" }}\n    limits:\n{limits}"
    ))
}

fn problem(r: &Reply) -> serde_json::Value {
    assert_eq!(r.header("content-type"), "application/problem+json");
    serde_json::from_slice(&r.body).unwrap()
}

fn retry(r: &Reply) -> u64 {
    r.header("retry-after").parse().unwrap()
}

/// On the paused clock: three rejections ban for 10 minutes (the bucket refills in one), the
/// ban lifts at its end, the next one lasts 20 minutes, and the metrics count them.
#[tokio::test(start_paused = true)]
async fn three_strikes_ban_past_the_refill_then_lift_and_the_next_ban_doubles() {
    let proxy = TestProxy::inline(&answering(
        "",
        "      - name: login\n        rate: 1/min\n        burst: 1\n        key: [ip]\n        ban: { after: 3, within: 1m, for: 10m, max: 40m }\n",
    ))
    .await;
    let url = proxy.url("/");
    // A fresh client after every wait: an idle keep-alive connection is closed meanwhile.
    let http = Http::new();
    assert_eq!(http.get(&url).await.code(), 200);
    for strike in 1..=3 {
        let r = http.get(&url).await;
        assert_eq!(r.code(), 429);
        let p = problem(&r);
        if strike < 3 {
            assert_eq!(p.get("ban"), None, "{p}");
            assert_eq!(retry(&r), 60);
        } else {
            assert_eq!(p["ban"], true, "{p}");
            assert_eq!(retry(&r), 600, "the third strike bans for `for`");
        }
    }
    // Two minutes on, the bucket is full again; the ban still refuses, with what is left of it.
    tokio::time::sleep(Duration::from_mins(2)).await;
    let r = Http::new().get(&url).await;
    assert_eq!(r.code(), 429);
    assert_eq!(problem(&r)["ban"], true);
    assert_eq!(retry(&r), 480);
    assert!(problem(&r)["detail"].as_str().unwrap().contains("Banned"));
    // A second before its end: still banned. At its end: admitted.
    tokio::time::sleep(Duration::from_secs(479)).await;
    assert_eq!(Http::new().get(&url).await.code(), 429);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let http = Http::new();
    assert_eq!(http.get(&url).await.code(), 200);
    // Three more strikes: the level is remembered, the ban doubles.
    for _ in 0..2 {
        assert_eq!(http.get(&url).await.code(), 429);
    }
    let r = http.get(&url).await;
    assert_eq!(retry(&r), 1200);
    let text = proxy.scrape().await;
    assert_eq!(
        common::sample::<u64>(&text, "tollgate_bans_total{route=\"r\",limit=\"login\"}"),
        2
    );
    assert_eq!(
        common::sample::<u64>(
            &text,
            "tollgate_ban_lifts_total{route=\"r\",limit=\"login\"}"
        ),
        1
    );
    assert_eq!(
        common::sample::<u64>(
            &text,
            "tollgate_banned_requests_total{route=\"r\",limit=\"login\"}"
        ),
        2
    );
}

/// A ban refuses only its own identity, and takes nothing from the route's other limits.
#[tokio::test(start_paused = true)]
async fn a_ban_is_per_identity() {
    let proxy = TestProxy::inline(&answering(
        "",
        "      - name: per-key\n        rate: 1/min\n        burst: 1\n        key: [\"header:x-api-key\"]\n        ban: { after: 2, within: 1m, for: 5m, max: 5m }\n",
    ))
    .await;
    let url = proxy.url("/");
    let http = Http::new();
    let a = [("x-api-key", "a")];
    assert_eq!(http.statuses(3, &url, &a).await, [200, 429, 429]);
    assert_eq!(problem(&http.get_with(&url, &a).await)["ban"], true);
    let b = [("x-api-key", "b")];
    assert_eq!(http.statuses(2, &url, &b).await, [200, 429]);
}

fn redis_block(url: &str) -> String {
    format!(
        "limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    url: \"{url}\"\n    timeout: 2s\n"
    )
}

/// Send until Redis answers (the connections open in the background).
async fn until_redis_answers(http: &Http, url: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while http.get_with(url, &[("x-api-key", "warm")]).await.code() == 503 {
        assert!(Instant::now() < deadline, "Redis never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Over Redis: a ban earned on one replica refuses the identity on the other at once, past
/// its bucket's refill (10 a second) on both, and lifts on both no earlier than its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ban_is_fleet_wide_outlives_the_refill_and_lifts_on_time() {
    let redis = RedisServer::start();
    let yaml = answering(
        &redis_block(&redis.url()),
        "      - name: login\n        rate: 10/s\n        burst: 1\n        key: [\"header:x-api-key\"]\n        ban: { after: 3, within: 10s, for: 2s, max: 8s }\n",
    );
    let (a, b) = (TestProxy::start(&yaml), TestProxy::start(&yaml));
    let http = Http::new();
    until_redis_answers(&http, &a.url("/")).await;
    until_redis_answers(&http, &b.url("/")).await;
    let key = [("x-api-key", "mallory")];
    // One admitted, three rejections at once (well within 100 ms: the bucket cannot refill
    // between them on a loaded machine either, or the test says so).
    let mut codes = Vec::new();
    let mut sent = Instant::now();
    for _ in 0..4 {
        sent = Instant::now();
        codes.push(http.get_with(&a.url("/"), &key).await);
    }
    let statuses: Vec<u16> = codes.iter().map(Reply::code).collect();
    assert_eq!(
        statuses,
        [200, 429, 429, 429],
        "the bucket refilled between the strikes (a slow machine)"
    );
    let banning = codes.last().unwrap();
    assert_eq!(problem(banning)["ban"], true, "{}", banning.text());
    assert_eq!(retry(banning), 2);
    // The other replica never saw this client: Redis tells it.
    let r = http.get_with(&b.url("/"), &key).await;
    assert_eq!(r.code(), 429);
    assert_eq!(problem(&r)["ban"], true);
    // Past the bucket's refill, both still refuse.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for proxy in [&a, &b] {
        let r = http.get_with(&proxy.url("/"), &key).await;
        assert_eq!((r.code(), problem(&r)["ban"].clone()), (429, true.into()));
    }
    // The ban hashes live beside the buckets, in their slots (mallory's, and the warm-up
    // client's strikes), and expire: within the ban plus `max` at most.
    let keys = redis.keys();
    let ban_keys: Vec<&String> = keys.iter().filter(|k| k.ends_with(":ban")).collect();
    assert!(!ban_keys.is_empty(), "{keys:?}");
    for key in ban_keys {
        assert!(keys.contains(&key.trim_end_matches(":ban").to_owned()) || key.contains('{'));
        let ttl: i64 = redis.cli(&["PTTL", key]).trim().parse().unwrap();
        assert!(ttl > 0 && ttl <= 10_000, "{key}: PTTL {ttl} ms");
    }
    // Each replica lets the client back in, never before the ban's end.
    for proxy in [&a, &b] {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let r = http.get_with(&proxy.url("/"), &key).await;
            // Redis decided the ban after `sent` and this admission before now: the two
            // are at least the ban's length apart (the request's own latency aside).
            let answered = Instant::now();
            if r.code() == 200 {
                assert!(
                    answered.duration_since(sent) >= Duration::from_secs(2),
                    "lifted {:?} after the banning request was sent",
                    answered.duration_since(sent)
                );
                break;
            }
            assert!(Instant::now() < deadline, "the ban never lifted");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // Three more strikes, on the other replica: the level is Redis's, the ban doubles.
    let statuses: Vec<u16> = http.statuses(4, &b.url("/"), &key).await;
    let r = http.get_with(&a.url("/"), &key).await;
    assert_eq!(
        statuses,
        [429, 429, 429, 429],
        "the bucket refilled between the strikes (a slow machine)"
    );
    assert_eq!(problem(&r)["ban"], true);
    assert!(retry(&r) >= 3, "a doubled ban (4 s): {}", r.text());
    let text = a.scrape().await;
    assert_eq!(
        common::sample::<u64>(&text, "tollgate_bans_total{route=\"r\",limit=\"login\"}"),
        1
    );
    let text = b.scrape().await;
    assert_eq!(
        common::sample::<u64>(&text, "tollgate_bans_total{route=\"r\",limit=\"login\"}"),
        1
    );
}
