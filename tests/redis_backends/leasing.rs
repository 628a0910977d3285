//! `leasing` through the real proxy: replicas sharing a hot identity's bucket within the
//! stated bound, a replica lost with a lease, and everything else a limit can carry: another
//! limit on the route refusing, `cost`, `shadow`, an operator's override and ban made on another
//! replica, Redis killed under a lease (the failure policy), a Redis Cluster and a Sentinel
//! failover. Every Redis here is a real `redis-server`; the tests run on real time.
//!
//! Each limit refills one token a minute or an hour: within a test's few seconds the bucket
//! hands out its burst and no more, so the admitted counts are exact.

use crate::common;
use crate::common::redis as redis_helpers;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{config, sample, Http, Reply, TestProxy};
use http_body_util::BodyExt;
use redis_helpers::{until_redis_decides, RedisCluster, RedisServer, SentinelSet, MASTER};

/// A `limiter:` block on the Redis at `url`, failing `closed`.
fn redis_block(url: &str) -> String {
    format!("limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    url: \"{url}\"\n    timeout: 2s\n")
}

/// Route `r` answering 200 itself, with `limits` (YAML flow mappings, one a line).
fn routes(limits: &[&str]) -> String {
    let limits = limits.join("\n      - ");
    format!("routes:\n  - name: r\n    respond: {{ status: 200 }}\n    limits:\n      - {limits}\n")
}

async fn count_200(http: &Http, url: &str, n: usize, headers: &[(&str, &str)]) -> usize {
    let s = http.statuses(n, url, headers).await;
    s.iter().filter(|&&c| c == 200).count()
}

fn leased_checks(scrape: &str) -> f64 {
    sample(scrape, "tollgate_redis_leased_checks_total")
}

/// Two replicas lease a hot identity's tokens from one bucket: together they admit no more than
/// the bucket hands out (burst + rate x t; leases only ever come out of it) and, with leases of
/// at most L held at the end, at least burst - 2L; and they ask Redis far less than once per
/// request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_leasing_a_hot_identity_stay_within_the_bound_and_spare_redis() {
    let redis = RedisServer::start();
    let routes = "admin: { address: 127.0.0.1:0 }\nroutes:\n  - name: r\n    match: { path_prefix: / }\n    respond: { status: 200 }\n    limits:\n      - { name: hot, rate: 1/s, burst: 300, key: [ip], leasing: { tokens: 20, hold: 5s } }\n";
    let yaml = config(&format!("{}{routes}", redis_block(&redis.url())));
    let (a, b) = (TestProxy::start(&yaml), TestProxy::start(&yaml));
    let http = Http::new();
    until_redis_decides(&http, &a.url("/"), &[]).await;
    until_redis_decides(&http, &b.url("/"), &[]).await;
    let calls_before = redis.script_calls();
    let started = Instant::now();
    let (mut admitted_a, mut admitted_b) = (0, 0);
    for _ in 0..40 {
        admitted_a += count_200(&http, &a.url("/"), 10, &[]).await;
        admitted_b += count_200(&http, &b.url("/"), 10, &[]).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let calls = redis.script_calls() - calls_before;
    let admitted = admitted_a + admitted_b;
    // Two requests went before the clock started; the bucket refills 1 a second.
    eprintln!(
        "leased: {admitted_a} + {admitted_b} admitted of 800, {calls} script calls, {elapsed:.2}s"
    );
    let most = 300 - 2 + elapsed.ceil() as usize + 1;
    assert!(
        admitted <= most,
        "admitted {admitted} > {most} in {elapsed:.1}s"
    );
    assert!(admitted >= 300 - 2 - 2 * 20, "admitted only {admitted}");
    assert!(
        admitted_a > 50 && admitted_b > 50,
        "{admitted_a} / {admitted_b}"
    );
    assert!(calls * 8 <= 800, "{calls} script calls for 800 requests");
    // Each replica counts what it admitted from its leases.
    for proxy in [&a, &b] {
        let leased: f64 =
            common::sample(&proxy.scrape().await, "tollgate_redis_leased_checks_total");
        assert!(leased > 100.0, "{leased} checks admitted from leases");
    }
}

/// Four replicas leasing one identity under bursty load (all four flooded at once, then idle)
/// and then steady load over the limit (one request every 5 ms, round the replicas): at every
/// step the fleet has admitted no more than the bucket handed out since the start,
/// `burst + rate x t` (which the stated `+ R x L` only loosens: the leases were empty at the
/// start), and, the burst being larger than every lease the replicas can hold together, at
/// least `burst - R x L`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_replicas_under_bursty_then_steady_load_stay_within_the_bound() {
    const BURST: usize = 400;
    const RATE: f64 = 20.0;
    // `auto`: min(1024, burst / 4, rate x hold of 1 s) = 20.
    const L: usize = 20;
    let redis = RedisServer::start();
    let limit =
        format!("{{ name: hot, rate: {RATE}/s, burst: {BURST}, key: [ip], leasing: auto }}");
    let yaml = config(&format!(
        "admin: {{ address: 127.0.0.1:0 }}\n{}{}",
        redis_block(&redis.url()),
        routes(&[&limit])
    ));
    let fleet: Vec<TestProxy> = (0..4).map(|_| TestProxy::start(&yaml)).collect();
    let http = Http::new();
    // Each replica answers from Redis once before the clock starts: 4 tokens spent.
    for proxy in &fleet {
        until_redis_decides(&http, &proxy.url("/"), &[]).await;
    }
    let started = Instant::now();
    let mut admitted = fleet.len();
    let check = |admitted: usize, phase: &str| {
        let t = started.elapsed().as_secs_f64();
        let most = BURST + (RATE * t).ceil() as usize + 1;
        assert!(
            admitted <= most,
            "{phase}: {admitted} admitted > {most} in {t:.2}s"
        );
    };
    // Bursty: 40 requests at each replica at once, six times, 250 ms apart.
    for _ in 0..6 {
        let mut burst = tokio::task::JoinSet::new();
        for proxy in &fleet {
            for _ in 0..40 {
                let (http, url) = (http.clone(), proxy.url("/"));
                burst.spawn(async move { http.get(&url).await.code() });
            }
        }
        while let Some(code) = burst.join_next().await {
            admitted += usize::from(code.expect("a request") == 200);
        }
        check(admitted, "bursty");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let after_bursts = admitted;
    assert!(
        after_bursts >= BURST - fleet.len() * L,
        "only {after_bursts} admitted of a burst of {BURST}"
    );
    // Steady, over the limit: a request every 5 ms for 2 s, round the replicas. What refills
    // is leased and admitted, no more.
    let mut pace = tokio::time::interval(Duration::from_millis(5));
    for i in 0..400 {
        pace.tick().await;
        admitted += count_200(&http, &fleet[i % fleet.len()].url("/"), 1, &[]).await;
        if i % 50 == 49 {
            check(admitted, "steady");
        }
    }
    check(admitted, "steady");
    assert!(admitted > after_bursts, "nothing refilled was admitted");
    let leased: f64 = futures_util::future::join_all(fleet.iter().map(TestProxy::scrape))
        .await
        .iter()
        .map(|s| leased_checks(s))
        .sum();
    eprintln!(
        "four replicas: {after_bursts} admitted after the bursts, {admitted} in all in {:.2}s, {leased} from leases",
        started.elapsed().as_secs_f64()
    );
    assert!(leased > 100.0, "only {leased} checks admitted from leases");
}

/// A replica that stops holding a lease takes its unused tokens with it, at most one lease's
/// worth: the replica left admits the rest of the bucket, no more, and at most L less.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_gone_with_a_lease_costs_the_fleet_at_most_that_lease() {
    let redis = RedisServer::start();
    let routes = "routes:\n  - name: r\n    match: { path_prefix: / }\n    respond: { status: 200 }\n    limits:\n      - { name: hot, rate: 1/s, burst: 100, key: [ip], leasing: { tokens: 20, hold: 5s } }\n";
    let yaml = config(&format!("{}{routes}", redis_block(&redis.url())));
    let http = Http::new();
    let (a, b) = (TestProxy::start(&yaml), TestProxy::start(&yaml));
    until_redis_decides(&http, &a.url("/"), &[]).await;
    until_redis_decides(&http, &b.url("/"), &[]).await;
    let started = Instant::now();
    let by_a = count_200(&http, &a.url("/"), 10, &[]).await;
    drop(a);
    let by_b = count_200(&http, &b.url("/"), 200, &[]).await;
    let elapsed = started.elapsed().as_secs_f64();
    let total = by_a + by_b;
    eprintln!("gone with a lease: {by_a} + {by_b} admitted in {elapsed:.2}s");
    assert_eq!(by_a, 10);
    let most = 100 - 2 + elapsed.ceil() as usize + 1;
    assert!(total <= most, "{total} > {most}");
    assert!(total >= 100 - 2 - 20, "{total}: more than one lease lost");
}

/// A leased limit and an exact one on one route: a request the exact one refuses takes nothing
/// from the leased bucket (its leased tokens go back to the lease), and a request costs its
/// `cost` whether it comes from the lease or from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_another_limit_refuses_costs_the_leased_limit_nothing() {
    let redis = RedisServer::start();
    let proxy = TestProxy::start(&config(&format!(
        "admin: {{ address: 127.0.0.1:0 }}\n{}{}",
        redis_block(&redis.url()),
        routes(&[
            "{ name: hot, rate: 1/min, burst: 60, cost: 3, key: [ip], leasing: { tokens: 15, hold: 10s } }",
            "{ name: per-user, rate: 1/min, burst: 2, key: [\"header:X-User\"] }",
        ])
    )));
    let http = Http::new();
    let url = proxy.url("/");
    // `a` is admitted twice, then refused ten times by per-user, leases running meanwhile.
    let a = http.statuses(12, &url, &[("x-user", "a")]).await;
    assert_eq!(&a[..3], [200, 200, 429], "{a:?}");
    // 60 tokens at 3 a request: 20 requests in all, 2 of them a's.
    let mut others = 0;
    for i in 0..30 {
        let user = format!("u{i}");
        others += count_200(&http, &url, 1, &[("x-user", &user)]).await;
    }
    let leased = leased_checks(&proxy.scrape().await);
    eprintln!("{others} others admitted, {leased} checks from leases");
    assert_eq!(others, 18);
    assert!(leased >= 10.0, "{leased} checks admitted from leases");
}

/// A shadow leased limit never refuses; what it would have refused is counted, and the lease
/// spends the bucket exactly as an enforced one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_leased_limit_counts_what_it_would_refuse() {
    let redis = RedisServer::start();
    let proxy = TestProxy::start(&config(&format!(
        "admin: {{ address: 127.0.0.1:0 }}\n{}{}",
        redis_block(&redis.url()),
        routes(&["{ name: hot, rate: 1/min, burst: 12, key: [ip], shadow: true, leasing: { tokens: 5, hold: 10s } }"])
    )));
    let http = Http::new();
    assert_eq!(count_200(&http, &proxy.url("/"), 30, &[]).await, 30);
    let scrape = proxy.scrape().await;
    let decided = |outcome: &str| -> u64 {
        sample(
            &scrape,
            &format!(
                "tollgate_limit_decisions_total{{route=\"r\",limit=\"hot\",outcome=\"{outcome}\"}}"
            ),
        )
    };
    assert_eq!((decided("admitted"), decided("shadow_limited")), (12, 18));
    assert!(leased_checks(&scrape) >= 5.0);
}

/// Redis killed while a replica holds a lease: the leased tokens are spent (Redis is not
/// asked), then the failure policy (`closed`: 503) applies; once Redis is back, Redis decides
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_tokens_are_spent_while_redis_is_down_then_the_policy_applies() {
    let mut redis = RedisServer::start();
    let proxy = TestProxy::start(&config(&format!(
        "{}{}",
        redis_block(&redis.url()).replace("timeout: 2s", "timeout: 200ms"),
        routes(&[
            "{ name: hot, rate: 1/min, burst: 100, key: [ip], leasing: { tokens: 20, hold: 10s } }"
        ])
    )));
    let http = Http::new();
    let url = proxy.url("/");
    until_redis_decides(&http, &url, &[]).await;
    assert_eq!(count_200(&http, &url, 9, &[]).await, 9);
    redis.kill();
    let after = http.statuses(40, &url, &[]).await;
    eprintln!("after the kill: {after:?}");
    let served = after.iter().take_while(|&&c| c == 200).count();
    assert!(
        (5..=20).contains(&served),
        "{served} admitted from the lease"
    );
    assert!(
        after[served..].iter().all(|&c| c == 503),
        "then the policy refuses: {after:?}"
    );
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = http.get(&url).await;
        if r.code() == 200 && r.opt_header("ratelimit").is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "Redis never decided again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const TOKEN: &str = "test-admin-token-0123456789";

/// `POST /api/v1{path}` with `body` on `proxy`'s admin listener.
async fn post(proxy: &TestProxy, path: &str, body: &str) -> Reply {
    let req = http::Request::post(format!("http://{}/api/v1{path}", proxy.admin_addr()))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(
            http_body_util::Full::new(Bytes::from(body.to_owned()))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("a request");
    Http::new().send(req).await
}

/// Two replicas holding leases of two identities: an override of one made on A hands A's
/// leased tokens back at once and B's within a second (its entries poll), well within the
/// hold; a ban of the other made on A refuses it on B, where it still holds leased tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_revokes_and_a_ban_refuses_across_replicas_holding_leases() {
    let redis = RedisServer::start();
    let mut token = tempfile::NamedTempFile::new().expect("a token file");
    std::io::Write::write_all(&mut token, TOKEN.as_bytes()).expect("write the token");
    let yaml = config(&format!(
        "admin:\n  address: 127.0.0.1:0\n  token_file: {}\n{}{}",
        token.path().display(),
        redis_block(&redis.url()),
        routes(&["{ name: hot, rate: 1/min, burst: 300, key: [\"header:X-Tenant\"], leasing: { tokens: 50, hold: 30s } }"])
    ));
    let (a, b) = (TestProxy::start(&yaml), TestProxy::start(&yaml));
    let http = Http::new();
    let (t1, t2) = ([("x-tenant", "t1")], [("x-tenant", "t2")]);
    for p in [&a, &b] {
        until_redis_decides(&http, &p.url("/"), &t1).await;
        for t in [&t1, &t2] {
            assert_eq!(count_200(&http, &p.url("/"), 10, t).await, 10);
        }
    }
    let returned =
        |scrape: &str| -> f64 { sample(scrape, "tollgate_redis_lease_tokens_returned_total") };
    let before = returned(&b.scrape().await);
    // The bucket keeps its level under the new numbers: burst 2 caps it at 2 tokens.
    let r = post(
        &a,
        "/overrides",
        r#"{"limit": "hot", "identity": "header:X-Tenant=t1", "rate": "1/min", "burst": 2, "ttl": "10m"}"#,
    )
    .await;
    assert_eq!(r.code(), 201, "{}", r.text());
    assert!(count_200(&http, &a.url("/"), 10, &t1).await <= 2);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let on_b = count_200(&http, &b.url("/"), 10, &t1).await;
    let handed = returned(&b.scrape().await) - before;
    eprintln!("after the override B admitted {on_b} and handed back {handed} leased tokens");
    assert!(on_b <= 2, "{on_b} admitted on B");
    assert!(handed >= 20.0, "B handed back {handed} tokens");

    let r = post(
        &a,
        "/bans",
        r#"{"identity": "header:X-Tenant=t2", "ttl": "10m"}"#,
    )
    .await;
    assert_eq!(r.code(), 201, "{}", r.text());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(http.get_with(&b.url("/"), &t2).await.code(), 403);
    assert_eq!(http.get_with(&a.url("/"), &t2).await.code(), 403);
}

/// On a Redis Cluster: a hot identity's leases come from its bucket's slot, the bucket hands
/// out its burst exactly, and Redis is asked a fraction of the requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_on_a_cluster_hand_out_the_burst_exactly() {
    let cluster = RedisCluster::start();
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let proxy = TestProxy::start(&config(&format!(
        "limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    cluster: [{}]\n    timeout: 2s\n{}",
        nodes.join(", "),
        routes(&["{ name: hot, rate: 1/h, burst: 100, key: [ip], leasing: { tokens: 20, hold: 10s } }"])
    )));
    let http = Http::new();
    until_redis_decides(&http, &proxy.url("/"), &[]).await;
    let calls = cluster.script_calls();
    let admitted = 1 + count_200(&http, &proxy.url("/"), 150, &[]).await;
    let calls = cluster.script_calls() - calls;
    eprintln!("cluster: {admitted} admitted, {calls} script calls for 150 requests");
    assert_eq!(admitted, 100);
    assert!(calls <= 150 / 4, "{calls} script calls");
}

/// Through a Sentinel failover: leased tokens are spent while the master changes, and the
/// bucket, replicated, hands out no more than its burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_survive_a_sentinel_failover_within_the_burst() {
    let set = SentinelSet::start(None, None);
    let proxy = TestProxy::start(&config(&format!(
        "limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    sentinel:\n      master: {MASTER}\n      nodes: [{}]\n    timeout: 500ms\n{}",
        set.sentinel_node(),
        routes(&["{ name: hot, rate: 1/h, burst: 60, key: [ip], leasing: { tokens: 10, hold: 10s } }"])
    )));
    let http = Http::new();
    let url = proxy.url("/");
    until_redis_decides(&http, &url, &[]).await;
    let mut admitted = 1 + count_200(&http, &url, 29, &[]).await;
    assert_eq!(admitted, 30);
    let old = set.index_of(set.master_port());
    set.wait_replicated(old, 1 - old);
    set.fail_over(old, 1 - old);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut refused = 0;
    while refused < 10 {
        match http.get(&url).await.code() {
            200 => admitted += 1,
            429 => refused += 1,
            503 => tokio::time::sleep(Duration::from_millis(20)).await,
            other => panic!("{other}"),
        }
        assert!(
            Instant::now() < deadline,
            "{admitted} admitted, {refused} refused"
        );
    }
    eprintln!("sentinel: {admitted} admitted in all");
    // At most one lease's tokens lost in the switch (a top-up the old master charged, whose
    // answer never came).
    assert!((50..=60).contains(&admitted), "{admitted}");
}
