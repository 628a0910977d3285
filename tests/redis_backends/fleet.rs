//! The Redis backend through the real proxy: replicas sharing buckets, the failure policies
//! with Redis killed, frozen or flushed, and a Redis Cluster. Every Redis here is a real
//! `redis-server` this file starts on a free port.
//!
//! The proxies are served in-process (`TestProxy`), except where a test reads the proxy's log
//! (`BinaryProxy`). Refills here are Redis's, on its own clock: these tests run on real time.

use crate::common;
use crate::common::redis as redis_helpers;

use std::time::{Duration, Instant};

use common::{config, upstream_app, BinaryProxy, Http, MockUpstream, TestProxy};
use redis_helpers::{until_redis_decides, RedisCluster, RedisServer};

fn redis_block(url: &str, extra: &str) -> String {
    redis_block_timed(url, "100ms", extra)
}

/// A Redis block with its own check timeout. Tests that count exactly under concurrency use a
/// long one: on a loaded test machine a check can take over 100 ms, and one that timed out is
/// admitted by the default policy, `open`, which would look like over-admission.
fn redis_block_timed(url: &str, timeout: &str, extra: &str) -> String {
    format!(
        "limiter:\n  backend: redis\n  redis:\n    url: \"{url}\"\n    timeout: {timeout}\n{extra}"
    )
}

/// A Redis block for `cluster`'s nodes, with this check timeout.
fn cluster_block(cluster: &RedisCluster, timeout: &str) -> String {
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "limiter:\n  backend: redis\n  redis:\n    cluster: [{}]\n    timeout: {timeout}\n",
        nodes.join(", ")
    )
}

/// Send `n` requests and count the 200s.
async fn admitted(http: &Http, url: &str, n: usize, headers: &[(&str, &str)]) -> usize {
    http.statuses(n, url, headers)
        .await
        .iter()
        .filter(|s| **s == 200)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_and_local_give_the_same_answers() {
    let redis = RedisServer::start();
    let routes = "routes:\n  - name: r\n    match: { path_prefix: / }\n    respond: { status: 200 }\n    limits:\n      - { name: l, rate: 2/s, burst: 4, key: [ip] }\n";
    let local = TestProxy::start(&config(routes));
    let shared = TestProxy::start(&config(&format!(
        "{}{routes}",
        redis_block(&redis.url(), "")
    )));
    let http = Http::new();
    let mut seen = Vec::new();
    for proxy in [&local, &shared] {
        let mut answers = Vec::new();
        for _ in 0..6 {
            let r = http.get(&proxy.url("/")).await;
            answers.push((r.code(), r.header("ratelimit").to_owned()));
        }
        seen.push(answers);
    }
    assert_eq!(seen[0], seen[1], "local and Redis disagree");
    assert_eq!(
        seen[0].iter().map(|(c, _)| *c).collect::<Vec<_>>(),
        [200, 200, 200, 200, 429, 429]
    );
    // Refill: 2/s gives one token back after 0.5 s on both.
    tokio::time::sleep(Duration::from_millis(600)).await;
    for proxy in [&local, &shared] {
        assert_eq!(admitted(&http, &proxy.url("/"), 3, &[]).await, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_hand_out_one_burst_not_three() {
    let redis = RedisServer::start();
    let backend = MockUpstream::start();
    let yaml = config(&format!(
        "{}{}routes:\n  - name: api\n    match: {{ path_prefix: / }}\n    upstream: app\n    limits:\n      - {{ name: per-key, rate: 1/min, burst: 10, key: [header:X-API-Key] }}\n",
        redis_block(&redis.url(), ""),
        upstream_app(backend.addr(), "5s")
    ));
    let replicas = [
        TestProxy::start(&yaml),
        TestProxy::start(&yaml),
        TestProxy::start(&yaml),
    ];
    let http = Http::new();
    let mut total = 0;
    for i in 0..30 {
        let r = http
            .get_with(&replicas[i % 3].url("/x"), &[("x-api-key", "k1")])
            .await;
        total += usize::from(r.code() == 200);
    }
    assert_eq!(total, 10, "the fleet admitted {total} of a burst of 10");
    assert_eq!(
        backend.count(),
        10,
        "the backend saw only admitted requests"
    );
    // Another key has its own bucket across the fleet.
    let other = admitted(&http, &replicas[1].url("/x"), 12, &[("x-api-key", "k2")]).await;
    assert_eq!(other, 10);
    // Keys hold digests, never the raw API key, and expire once full again (10 min at 1/min).
    for key in redis.keys() {
        assert!(
            !key.contains("k1") && !key.contains("k2"),
            "raw identity in {key}"
        );
        assert!(key.starts_with("tollgate:per-key:{"), "{key}");
        let ttl: i64 = redis.cli(&["PTTL", &key]).trim().parse().unwrap();
        assert!(ttl > 0 && ttl <= 600_000, "{key} has PTTL {ttl}");
    }
}

/// Concurrent requests share script calls (each worker sends the checks waiting at the same
/// moment as one call), and the batch changes nothing about what is admitted: two clients with
/// a burst of 50 each get exactly 50 requests through, however their requests interleave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_checks_are_batched_and_stay_exact() {
    let redis = RedisServer::start();
    let calls = || redis.script_calls();
    batched_and_exact(&redis_block_timed(&redis.url(), "2s", ""), calls).await;
}

/// The same on a Redis Cluster: the checks waiting at the same moment whose buckets live in
/// one slot share a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_checks_are_batched_by_slot_and_stay_exact() {
    let cluster = RedisCluster::start();
    let block = cluster_block(&cluster, "2s");
    let calls = || cluster.script_calls();
    batched_and_exact(&block, calls).await;
}

/// 300 concurrent requests of two clients against a burst of 50 each admit exactly 100; 300
/// against a burst never reached take fewer than 300 script calls (`calls` counts them).
/// `limiter_block` must give checks a long timeout (see `redis_block_timed`).
async fn batched_and_exact(limiter_block: &str, calls: impl Fn() -> u64) {
    const REQUESTS: usize = 300;
    let backend = MockUpstream::start();
    let route = |name: &str, burst: u32| {
        format!(
            "  - name: {name}\n    match: {{ path_prefix: /{name} }}\n    upstream: app\n    limits:\n      - {{ name: {name}, rate: 1/min, burst: {burst}, key: [header:X-API-Key] }}\n"
        )
    };
    // The admin listener's Redis error counters say, if the count is off, whether Redis
    // left checks undecided (an in-process proxy has no log to show).
    let proxy = TestProxy::start(&config(&format!(
        "admin:\n  address: 127.0.0.1:0\n{limiter_block}{}routes:\n{}{}{}",
        upstream_app(backend.addr(), "5s"),
        route("exact", 50),
        route("roomy", 10_000),
        route("probe", 10_000),
    )));
    let http = Http::new();
    until_redis_decides(&http, &proxy.url("/probe"), &[]).await;
    let seen_before = backend.count();
    let burst = |path: &'static str| {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..REQUESTS {
            let (http, url) = (Http::new(), proxy.url(path));
            let key = if i % 2 == 0 { "a" } else { "b" };
            tasks.spawn(async move { http.get_with(&url, &[("x-api-key", key)]).await.code() });
        }
        async move {
            let mut codes = Vec::new();
            while let Some(code) = tasks.join_next().await {
                codes.push(code.expect("request task"));
            }
            codes
        }
    };
    let codes = burst("/exact").await;
    let ok = codes.iter().filter(|c| **c == 200).count();
    let limited = codes.iter().filter(|c| **c == 429).count();
    let scrape = http
        .get(&format!("http://{}/metrics", proxy.admin_addr()))
        .await;
    let undecided: Vec<&str> = scrape
        .text()
        .lines()
        .filter(|l| {
            l.starts_with("tollgate_redis_errors") || l.starts_with("tollgate_redis_timeouts")
        })
        .collect();
    assert_eq!(
        (ok, limited),
        (100, REQUESTS - 100),
        "{codes:?}; checks Redis did not decide: {undecided:?}"
    );
    assert_eq!(backend.count() - seen_before, 100);

    // Never rejected, so the negative cache answers none of these: every check needs Redis.
    let before = calls();
    let codes = burst("/roomy").await;
    assert!(codes.iter().all(|c| *c == 200), "{codes:?}");
    let used = calls() - before;
    eprintln!("{used} script calls for {REQUESTS} concurrent checks");
    assert!(
        used < REQUESTS as u64,
        "{used} script calls for {REQUESTS} concurrent checks: nothing was batched"
    );
}

/// Checks of several limits batch as groups of identical checks (one per client here), and
/// each check stays all-or-nothing across its limits: with a per-key burst of 40, a global
/// burst of 60 and a shadow limit that rejects nearly everything, 300 concurrent requests of
/// three clients admit exactly 60, no client more than 40, and the shadow limit blocks none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_checks_of_several_limits_stay_exact() {
    let redis = RedisServer::start();
    let calls = || redis.script_calls();
    several_limits_stay_exact(&redis_block_timed(&redis.url(), "2s", ""), calls, true).await;
}

/// The same on a Redis Cluster, where the per-key and the global buckets live in different
/// slots: each request's two slot groups are checked at once, each batched with the other
/// checks of its slot. A group that admits while the other rejects is refunded, so a burst
/// may admit a few fewer than 60 while refunds are on their way (never more), and once the
/// refunds are in, the tokens left make up exactly 60.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_checks_spanning_slots_are_batched_and_never_over_admit() {
    let cluster = RedisCluster::start();
    let calls = || cluster.script_calls();
    several_limits_stay_exact(&cluster_block(&cluster, "2s"), calls, false).await;
}

/// 300 concurrent requests of three clients on a route with a per-key limit (burst 40), a
/// global one (burst 60) and a shadow one; then a fourth client takes what is left, one
/// request at a time. `exact`: the burst itself admits exactly 60.
async fn several_limits_stay_exact(limiter_block: &str, calls: impl Fn() -> u64, exact: bool) {
    const REQUESTS: usize = 300;
    let backend = MockUpstream::start();
    let proxy = TestProxy::start(&config(&format!(
        "{limiter_block}{}routes:\n  - name: probe\n    match: {{ path_prefix: /probe }}\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: probe, rate: 1/min, burst: 10, key: [ip] }}\n  - name: multi\n    match: {{ path_prefix: / }}\n    upstream: app\n    limits:\n      - {{ name: per-key, rate: 1/min, burst: 40, key: [header:X-API-Key] }}\n      - {{ name: all, rate: 1/min, burst: 60, key: [global] }}\n      - {{ name: dry, rate: 1/min, burst: 1, key: [global], shadow: true }}\n",
        upstream_app(backend.addr(), "5s"),
    )));
    let http = Http::new();
    until_redis_decides(&http, &proxy.url("/probe"), &[]).await;
    let before = calls();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..REQUESTS {
        let (http, url) = (Http::new(), proxy.url("/"));
        let key = ["a", "b", "c"][i % 3];
        tasks.spawn(async move { (key, http.get_with(&url, &[("x-api-key", key)]).await.code()) });
    }
    let mut admitted = std::collections::HashMap::new();
    while let Some(done) = tasks.join_next().await {
        let (key, code) = done.expect("request task");
        assert!(code == 200 || code == 429, "{key}: {code}");
        *admitted.entry(key).or_insert(0) += usize::from(code == 200);
    }
    let used = calls() - before;
    let total: usize = admitted.values().sum();
    eprintln!("{total} of {REQUESTS} admitted ({admitted:?}) in {used} script calls");
    if exact {
        assert_eq!(total, 60, "{admitted:?}");
    } else {
        assert!((40..=60).contains(&total), "{admitted:?}");
    }
    assert!(admitted.values().all(|n| *n <= 40), "{admitted:?}");
    assert!(
        used < REQUESTS as u64,
        "{used} script calls for {REQUESTS} concurrent checks: nothing was batched"
    );
    // Refunds that went out from a background task (the check ran past a quarter of the
    // timeout, as on a machine busy with the whole suite) land first: the script calls stop.
    let settled = std::time::Instant::now();
    let mut seen = calls();
    while settled.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = calls();
        if now == seen {
            break;
        }
        seen = now;
    }
    // Whatever the burst left in the global bucket (refunds included) goes to client d.
    let late = admitted_until_rejected(&http, &proxy.url("/"), &[("x-api-key", "d")]).await;
    assert_eq!(total + late, 60, "burst {total}, then {late}");
    assert_eq!(backend.count(), 60);
}

/// Send requests one after the other until one is rejected; count the 200s (at most 100).
async fn admitted_until_rejected(http: &Http, url: &str, headers: &[(&str, &str)]) -> usize {
    let mut n = 0;
    while n < 100 && http.get_with(url, headers).await.code() == 200 {
        n += 1;
    }
    n
}

fn policy_routes() -> String {
    let route = |name: &str, policy: &str| {
        format!(
            "  - name: {name}\n    match: {{ path_prefix: /{name} }}\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: {name}-l, rate: 1/min, burst: 4, key: [ip], on_failure: {policy} }}\n"
        )
    };
    format!(
        "routes:\n{}{}{}",
        route("open", "open"),
        route("closed", "closed"),
        route("local", "local")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_policies_with_redis_killed_then_restarted() {
    let mut redis = RedisServer::start();
    let yaml = config(&format!(
        "{}{}",
        redis_block(&redis.url(), "  local_fallback:\n    divide_by: 2\n"),
        policy_routes()
    ));
    // The binary: the test reads its log.
    let proxy = BinaryProxy::start(&yaml);
    // The startup lines name where limits are counted, and say Redis answers.
    let port = redis.url().rsplit(':').next().unwrap().to_owned();
    assert!(
        proxy.wait_for_log(
            &format!("limiter=redis 127.0.0.1:{port}"),
            Duration::from_secs(5)
        ),
        "{:#?}",
        proxy.logs()
    );
    assert!(proxy.wait_for_log(
        "Redis answers: limits are decided by Redis",
        Duration::from_secs(5)
    ));
    let http = Http::new();
    assert_eq!(admitted(&http, &proxy.url("/closed"), 1, &[]).await, 1);
    redis.kill();

    let started = Instant::now();
    let open = http.statuses(10, &proxy.url("/open"), &[]).await;
    assert!(open.iter().all(|s| *s == 200), "open admits: {open:?}");
    let closed = http.get(&proxy.url("/closed")).await;
    assert_eq!(closed.code(), 503);
    assert_eq!(closed.header("retry-after"), "1");
    // local: burst 4 divided by 2 replicas = 2 per replica while Redis is away.
    let local = http.statuses(5, &proxy.url("/local"), &[]).await;
    assert_eq!(local, [200, 200, 429, 429, 429]);
    // Sixteen requests without Redis: the breaker keeps each one far from the 100 ms timeout.
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(2),
        "16 requests took {elapsed:?}"
    );
    assert!(proxy.wait_for_log("not decided by Redis", Duration::from_secs(2)));

    redis.restart();
    // Once the breaker's cooldown lets a probe through, `closed` is decided by Redis again (a
    // restarted Redis without persistence starts with empty, hence full, buckets).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let code = http.get(&proxy.url("/closed")).await.code();
        if code == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "limiting did not resume after the restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!redis.keys().is_empty(), "checks reach Redis again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_redis_costs_the_timeout_then_recovers() {
    let redis = RedisServer::start();
    let proxy = TestProxy::start(&config(&format!(
        "{}{}",
        redis_block(&redis.url(), ""),
        policy_routes()
    )));
    let http = Http::new();
    assert_eq!(http.get(&proxy.url("/open")).await.code(), 200);
    redis.pause();
    let started = Instant::now();
    assert_eq!(http.get(&proxy.url("/open")).await.code(), 200);
    let first = started.elapsed();
    assert!(
        first < Duration::from_secs(1),
        "a frozen Redis held a request {first:?}"
    );
    assert_eq!(http.get(&proxy.url("/closed")).await.code(), 503);
    redis.resume();
    let deadline = Instant::now() + Duration::from_secs(10);
    while http.get(&proxy.url("/closed")).await.code() != 200 {
        assert!(Instant::now() < deadline, "no recovery after SIGCONT");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_does_not_break_limiting() {
    let redis = RedisServer::start();
    let proxy = TestProxy::start(&config(&format!(
        "{}{}",
        redis_block(&redis.url(), ""),
        policy_routes()
    )));
    let http = Http::new();
    assert_eq!(admitted(&http, &proxy.url("/closed"), 2, &[]).await, 2);
    redis.cli(&["SCRIPT", "FLUSH"]);
    // Two tokens left of four: the script is reloaded and the bucket kept.
    assert_eq!(
        http.statuses(3, &proxy.url("/closed"), &[]).await,
        [200, 200, 429]
    );
}

/// Wait up to 10 s for `redis` to have run `SCRIPT LOAD` at least `n` times.
fn until_script_loads(redis: &RedisServer, n: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let loads = redis.command_calls("script|load");
        if loads >= n || Instant::now() > deadline {
            return loads;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_connects_before_its_first_request_and_again_after_a_reload() {
    let redis = RedisServer::start();
    let yaml = |prefix: &str| {
        config(&format!(
            "{}{}",
            redis_block(&redis.url(), &format!("    key_prefix: \"{prefix}\"\n")),
            policy_routes()
        ))
    };
    let proxy = TestProxy::start_with_workers(&yaml("a:"), 2);
    // No request yet: each of the two workers has connected and loaded the script.
    assert_eq!(
        until_script_loads(&redis, 2),
        2,
        "one SCRIPT LOAD per worker"
    );
    // New Redis settings make a new client, whose workers connect at once too.
    std::fs::write(proxy.config_path(), yaml("b:")).expect("rewrite the config");
    // As SIGHUP does: reload now, whether or not the file watch has seen the edit yet.
    proxy.reload();
    assert_eq!(
        until_script_loads(&redis, 4),
        4,
        "and again after the reload"
    );
    // The first request is decided by Redis, under the new prefix.
    let r = Http::new().get(&proxy.url("/closed")).await;
    assert_eq!(r.code(), 200);
    assert!(r.opt_header("ratelimit").is_some());
    assert!(
        redis.keys().iter().all(|k| k.starts_with("b:")),
        "{:?}",
        redis.keys()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_enforces_a_per_client_and_a_global_limit() {
    let cluster = RedisCluster::start();
    let yaml = config(&format!(
        "{}routes:\n  - name: api\n    match: {{ path_prefix: / }}\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: per-key, rate: 1/min, burst: 3, key: [header:X-API-Key] }}\n      - {{ name: global, rate: 1/min, burst: 5, key: [global] }}\n",
        cluster_block(&cluster, "500ms")
    ));
    let proxy = TestProxy::start(&yaml);
    let http = Http::new();
    until_redis_decides(&http, &proxy.url("/"), &[("x-api-key", "probe")]).await;
    // One of five global tokens went to the probe.
    let a = admitted(&http, &proxy.url("/"), 4, &[("x-api-key", "a")]).await;
    let b = admitted(&http, &proxy.url("/"), 4, &[("x-api-key", "b")]).await;
    assert_eq!(
        (a, b),
        (3, 1),
        "per-key caps a at 3; the global cap of 5 leaves b one"
    );
}
