//! Window limits end to end (`window: N/DURATION` with `algorithm: sliding`, `exact` or
//! `fixed`): the counts, `Retry-After` and the headers in process on tokio's paused clock
//! (which the wall clock the windows are taken from follows); all or nothing beside a token
//! bucket; over Redis two replicas sharing one window, Redis's clock deciding, and a Redis
//! Cluster with a route's windows in different slots.

use crate::common;
use crate::common::redis as redis_helpers;
use crate::quotas::{answering, cluster_block, redis_block, until_redis_answers};

use std::time::Duration;

use common::{config, Http, TestProxy};
use redis_helpers::{RedisCluster, RedisServer};

/// Seconds from now to the end of the epoch-aligned window of `secs` seconds.
fn secs_to_window_end(secs: u64) -> f64 {
    let now = jiff::Timestamp::now().as_microsecond();
    let len = i64::try_from(secs).unwrap() * 1_000_000;
    (len - now.rem_euclid(len)) as f64 / 1e6
}

fn retry_after(r: &common::Reply) -> u64 {
    r.header("retry-after").parse().unwrap()
}

/// A fixed window on the paused clock, beside a token bucket: N per epoch-aligned window, the
/// next request told to come back at the window's end, N again after it.
#[tokio::test(start_paused = true)]
async fn a_fixed_window_admits_n_per_aligned_window() {
    let proxy = TestProxy::inline(&answering(
        "",
        "      - { name: logins, window: 3/1d, algorithm: fixed, key: [ip] }\n      - { name: fast, rate: 1/min, burst: 4, key: [ip] }\n",
    ))
    .await;
    let url = proxy.url("/");
    // A long window: the paused clock may jump ahead while the runtime waits on sockets.
    let to_end = secs_to_window_end(86_400);
    let codes = Http::new().statuses(3, &url, &[]).await;
    assert_eq!(codes, [200, 200, 200], "three a window");
    let r = Http::new().get(&url).await;
    assert_eq!(r.code(), 429);
    assert!(r
        .header("ratelimit-policy")
        .contains("\"logins\";q=3;w=86400"));
    let retry = retry_after(&r);
    assert!(
        (retry as f64 - to_end).abs() <= 2.0,
        "retry {retry}, end in {to_end}"
    );
    // Past the window's end: three again (the bucket refilled meanwhile), and only three.
    tokio::time::sleep(Duration::from_secs(retry + 1)).await;
    let codes = Http::new().statuses(4, &url, &[]).await;
    assert_eq!(codes, [200, 200, 200, 429], "a new window");
}

/// The default algorithm, the sliding window counter: N in the window, then a retry time at
/// which the estimate leaves room again (a quarter of a window into the next one for 4 of 4),
/// and exactly one request there.
#[tokio::test(start_paused = true)]
async fn a_sliding_window_says_when_its_estimate_leaves_room() {
    let proxy = TestProxy::inline(&answering(
        "",
        "      - { name: sms, window: 4/1m, key: [ip] }\n",
    ))
    .await;
    let url = proxy.url("/");
    let http = Http::new();
    let to_end = secs_to_window_end(60);
    let first = http.get(&url).await;
    assert_eq!(first.code(), 200);
    assert_eq!(first.header("ratelimit-policy"), "\"sms\";q=4;w=60");
    assert!(first.header("ratelimit").starts_with("\"sms\";r=3;"));
    assert_eq!(http.statuses(4, &url, &[]).await, [200, 200, 200, 429]);
    let r = http.get(&url).await;
    let retry = retry_after(&r);
    // cur = 4 slides out of the next window: 4 * (1 - g) <= 3 at g = 1/4.
    assert!(
        (retry as f64 - (to_end + 15.0)).abs() <= 2.0,
        "retry {retry}, window ends in {to_end}"
    );
    assert!(r.text().contains("sms"), "{}", r.text());
    tokio::time::sleep(Duration::from_secs(retry)).await;
    // A fresh client: the wait can outlast the proxy's keep-alive idle timeout, and a pooled
    // connection it closed would fail the next request.
    let http = Http::new();
    assert_eq!(http.statuses(2, &url, &[]).await, [200, 429]);
}

/// The sliding window log counts the last W exactly: a request is refused while N were
/// admitted in the W before it, and told to come back when the oldest of them leaves.
#[tokio::test(start_paused = true)]
async fn an_exact_window_counts_the_last_w_exactly() {
    let proxy = TestProxy::inline(&answering(
        "",
        "      - { name: logins, window: 3/10s, algorithm: exact, key: [ip] }\n",
    ))
    .await;
    let url = proxy.url("/");
    let http = Http::new();
    for _ in 0..3 {
        let r = http.get(&url).await;
        assert_eq!(r.code(), 200);
        assert_eq!(r.header("ratelimit-policy"), "\"logins\";q=3;w=10");
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    // Now t = 9: requests at 0, 3 and 6 count; the one at 0 leaves at 10.
    let r = http.get(&url).await;
    assert_eq!((r.code(), retry_after(&r)), (429, 1));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(http.statuses(2, &url, &[]).await, [200, 429]);
    // At 10: 3, 6 and 10 count; the next room comes at 13.
    let r = http.get(&url).await;
    assert_eq!((r.code(), retry_after(&r)), (429, 3));
}

/// A request a token bucket refuses takes nothing from the route's window, and the other way
/// round.
#[tokio::test(start_paused = true)]
async fn a_request_refused_by_a_bucket_takes_nothing_from_a_window() {
    for algorithm in ["sliding", "exact", "fixed"] {
        let proxy = TestProxy::inline(&answering(
            "",
            &format!(
                "      - {{ name: w, window: 3/31d, algorithm: {algorithm}, key: [ip] }}\n      - {{ name: b, rate: 1/s, burst: 2, key: [ip] }}\n"
            ),
        ))
        .await;
        let url = proxy.url("/");
        let http = Http::new();
        assert_eq!(http.statuses(3, &url, &[]).await, [200, 200, 429]);
        tokio::time::sleep(Duration::from_secs(2)).await;
        // The bucket is full again; the window holds 2 of 3 (the refused one took nothing).
        let r = http.get(&url).await;
        assert_eq!(r.code(), 200, "{algorithm}");
        assert!(
            r.header("ratelimit").starts_with("\"w\";r=0;"),
            "{algorithm}: {}",
            r.header("ratelimit")
        );
        let r = http.get(&url).await;
        assert_eq!(r.code(), 429, "{algorithm}");
        assert!(r.text().contains("\"w\""), "{algorithm}: {}", r.text());
    }
}

/// Two replicas sharing one Redis hand out one window between them, never two, for each
/// algorithm; the keys expire on their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_window_exactly() {
    let redis = RedisServer::start();
    for algorithm in ["sliding", "exact", "fixed"] {
        let yaml = answering(
            &redis_block(&redis.url()),
            &format!("      - {{ name: sms-{algorithm}, window: 40/31d, algorithm: {algorithm}, key: [\"header:x-api-key\"] }}\n"),
        );
        let (a, b) = (TestProxy::start(&yaml), TestProxy::start(&yaml));
        let http = Http::new();
        until_redis_answers(&http, &a.url("/"), "warm").await;
        until_redis_answers(&http, &b.url("/"), "warm").await;
        let mut tasks = Vec::new();
        for url in [a.url("/"), b.url("/")] {
            for _ in 0..4 {
                let url = url.clone();
                tasks.push(tokio::spawn(async move {
                    Http::new()
                        .statuses(15, &url, &[("x-api-key", "shared")])
                        .await
                }));
            }
        }
        let mut ok = 0;
        for t in tasks {
            ok += t.await.unwrap().iter().filter(|c| **c == 200).count();
        }
        assert_eq!(
            ok, 40,
            "{algorithm}: 120 requests over two replicas, a window of 40"
        );
        let keys: Vec<String> = (redis.keys().into_iter())
            .filter(|k| k.contains(&format!("sms-{algorithm}")))
            .collect();
        assert!(!keys.is_empty(), "{algorithm}");
        for key in keys {
            let ttl: i64 = redis.cli(&["PTTL", &key]).trim().parse().unwrap();
            assert!(
                ttl > 0 && ttl <= 2 * 31 * 86_400_000,
                "{algorithm}: {key} expires in {ttl} ms"
            );
        }
        if algorithm == "exact" {
            // One log per identity: the two warm-up requests', and the shared key's 40.
            let mut held: Vec<u32> = (redis.keys().into_iter())
                .filter(|k| k.contains("sms-exact") && k.ends_with(":x"))
                .map(|log| redis.cli(&["ZCARD", &log]).trim().parse().unwrap())
                .collect();
            held.sort_unstable();
            assert_eq!(held, [2, 40]);
        }
    }
}

/// Over Redis an exact window's retry time is on Redis's clock: the oldest entry's leaving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exact_window_over_redis_says_when_the_oldest_leaves() {
    let redis = RedisServer::start();
    let yaml = answering(
        &redis_block(&redis.url()),
        "      - { name: otp, window: 3/20s, algorithm: exact, key: [\"header:x-api-key\"] }\n",
    );
    let a = TestProxy::start(&yaml);
    let http = Http::new();
    until_redis_answers(&http, &a.url("/"), "warm").await;
    let key = [("x-api-key", "k")];
    assert_eq!(http.statuses(3, &a.url("/"), &key).await, [200, 200, 200]);
    let r = http.get_with(&a.url("/"), &key).await;
    assert_eq!(r.code(), 429);
    let retry = retry_after(&r);
    assert!((19..=20).contains(&retry), "retry {retry}");
    assert!(r.header("ratelimit").starts_with("\"otp\";r=0;"));
}

/// On a Redis Cluster a route's sliding and exact windows (different identities, so different
/// slots) are each exact across two replicas, and a request one slot refuses takes nothing
/// from the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_windows_are_exact_across_replicas_and_slots() {
    let cluster = RedisCluster::start();
    let limits = "      - { name: per-key, window: 10/31d, key: [\"header:x-api-key\"] }\n      - { name: per-tenant, window: 1000/31d, algorithm: exact, key: [\"header:x-tenant\"] }\n";
    let yaml = answering(&cluster_block(&cluster), limits);
    let (a, b) = (TestProxy::start(&yaml), TestProxy::start(&yaml));
    let http = Http::new();
    until_redis_answers(&http, &a.url("/"), "warm").await;
    until_redis_answers(&http, &b.url("/"), "warm").await;
    for client in ["c1", "c2", "c3", "c4"] {
        let headers = [("x-api-key", client), ("x-tenant", "t")];
        let mut ok = 0;
        for proxy in [&a, &b] {
            ok += (http.statuses(8, &proxy.url("/"), &headers).await)
                .iter()
                .filter(|c| **c == 200)
                .count();
        }
        assert_eq!(ok, 10, "client {client}");
    }
    // The tenant's log holds the 40 admitted requests only: the 24 the per-key windows
    // refused were given back.
    let only_tenant = answering(
        &cluster_block(&cluster),
        "      - { name: per-tenant, window: 1000/31d, algorithm: exact, key: [\"header:x-tenant\"] }\n",
    );
    let c = TestProxy::start(&only_tenant);
    until_redis_answers(&http, &c.url("/"), "warm").await;
    let r = http.get_with(&c.url("/"), &[("x-tenant", "t")]).await;
    assert_eq!(r.code(), 200);
    assert!(
        r.header("ratelimit").starts_with("\"per-tenant\";r=959;"),
        "{}",
        r.header("ratelimit")
    );
}

/// A window limit can ban: strikes are the window's refusals, in process and over Redis (the
/// script's window and ban parts in one argument), and the ban refuses past the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_with_a_ban_bans_on_its_refusals() {
    let redis = RedisServer::start();
    let limit = "      - { name: otp, window: 2/31d, algorithm: exact, key: [\"header:x-api-key\"], ban: { after: 2, within: 1m, for: 1h, max: 1h } }\n";
    for limiter in [String::new(), redis_block(&redis.url())] {
        let proxy = TestProxy::start(&answering(&limiter, limit));
        let http = Http::new();
        if !limiter.is_empty() {
            until_redis_answers(&http, &proxy.url("/"), "warm").await;
        }
        let key = [("x-api-key", "guesser")];
        let codes = http.statuses(4, &proxy.url("/"), &key).await;
        assert_eq!(codes, [200, 200, 429, 429], "{limiter}");
        let r = http.get_with(&proxy.url("/"), &key).await;
        assert_eq!(r.code(), 429);
        let problem: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(problem["ban"], true, "{limiter}: {problem}");
        let retry = retry_after(&r);
        assert!(
            (3000..=3600).contains(&retry),
            "{limiter}: {retry} s, the ban's hour, not the window's 31 days"
        );
    }
}

/// One address minting fresh keys on an `exact` login window gets a log per key only up to
/// `max_buckets_per_peer`; its further keys share one log, and a client from another address
/// still gets its own window.
#[tokio::test(start_paused = true)]
async fn minted_keys_on_an_exact_window_are_capped_per_address() {
    let proxy = TestProxy::inline(&answering(
        "limiter: { local: { max_buckets_per_peer: 10 } }\n",
        "      - { name: logins, window: 5/15m, algorithm: exact, key: [header:X-Key] }\n",
    ))
    .await;
    let url = proxy.url("/");
    let minter = Http::new();
    let mut admitted = 0;
    for i in 0..300 {
        let key = format!("minted-{i}");
        admitted += usize::from(minter.get_with(&url, &[("x-key", &key)]).await.code() == 200);
    }
    // A request per key: ten keys with a window each, then one shared window of 5.
    assert_eq!(admitted, 10 + 5, "one address minting keys");
    let other = Http::from_ip("127.0.0.2");
    let codes = other.statuses(6, &url, &[("x-key", "alice")]).await;
    assert_eq!(codes, [200, 200, 200, 200, 200, 429], "another address");
}

/// Windows on Redis's clock survive a step of it, as token buckets do: with the clock stepped
/// back an hour, a spent window is told to come back within its length (not in an hour) and
/// admits again once its length has passed; a step forward then back leaves no window spent
/// for longer than its length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_survive_a_step_of_redis_clock() {
    let redis = RedisServer::start_with_fake_clock();
    let routes: String = ["exact", "sliding", "fixed"]
        .map(|algorithm| {
            format!(
                "  - name: {algorithm}\n    match: {{ path: /{algorithm} }}\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: {algorithm}, window: 3/4s, algorithm: {algorithm}, key: [\"header:x-api-key\"] }}\n"
            )
        })
        .concat();
    let proxy = TestProxy::start(&config(&format!(
        "{}routes:\n{routes}",
        redis_block(&redis.url())
    )));
    let http = Http::new();
    until_redis_answers(&http, &proxy.url("/exact"), "warm").await;
    for (path, step) in [("/exact", -3600), ("/sliding", 3600), ("/fixed", 3600)] {
        let header = path;
        let url = proxy.url(path);
        redis.set_clock_offset(0);
        // Keys written before a step back keep their absolute expiry (Redis's, not
        // tollgate's): only this case's keys are looked at.
        redis.cli(&["FLUSHALL"]);
        let key = [("x-api-key", "k")];
        if step > 0 {
            // Counted an hour ahead, then the clock comes back.
            redis.set_clock_offset(step);
        }
        // Four requests inside one aligned window of 4 s (the step, 3600 s, keeps the
        // alignment): a boundary in between would make a fresh window of the fourth.
        let to_end = secs_to_window_end(4);
        if to_end < 2.0 {
            tokio::time::sleep(Duration::from_secs_f64(to_end + 0.05)).await;
        }
        let spent = http.statuses(4, &url, &key).await;
        assert_eq!(spent, [200, 200, 200, 429], "{header}");
        // No key outlives twice the window's length, whatever the clock did.
        for k in redis.keys() {
            let ttl: i64 = redis.cli(&["PTTL", &k]).trim().parse().unwrap();
            assert!(ttl <= 8_000, "{header}: {k} expires in {ttl} ms");
        }
        redis.set_clock_offset(if step > 0 { 0 } else { step });
        let r = http.get_with(&url, &key).await;
        if r.code() == 429 {
            let retry: u64 = r.header("retry-after").parse().unwrap();
            // Within the window (twice it for `sliding`, whose last window still weighs), not
            // in an hour.
            assert!(retry <= 8, "{header}: come back in {retry} s");
        }
        // Within the window's length (and the negative cache's), the client gets in again.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let code = http.get_with(&url, &key).await.code();
            if code == 200 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{header}: still refused"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for k in redis.keys() {
            let ttl: i64 = redis.cli(&["PTTL", &k]).trim().parse().unwrap();
            assert!(
                ttl <= 8_000,
                "{header}, clock back: {k} expires in {ttl} ms"
            );
        }
    }
}
