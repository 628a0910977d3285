//! Calendar quotas end to end: exactly N a window, then 429 until the window's end, with the
//! headers saying so; a fresh quota once the window is over; all-or-nothing with a token bucket
//! on the same route; in process on tokio's paused clock (which the wall clock the windows are
//! taken from follows), and over Redis: two replicas sharing one redis-server, Redis's clock
//! choosing the window, and a Redis Cluster.

use crate::common;
use crate::common::redis as redis_helpers;

use std::time::Duration;

use common::{check, config, Http, TestProxy};
use redis_helpers::{RedisCluster, RedisServer};

pub(crate) fn answering(limiter: &str, limits: &str) -> String {
    config(&format!(
        "{limiter}routes:\n  - name: r\n    respond: {{ status: 200, body: \"ok\\n\" }}\n    limits:\n{limits}"
    ))
}

pub(crate) fn redis_block(url: &str) -> String {
    format!("limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    url: \"{url}\"\n    timeout: 2s\n")
}

pub(crate) fn cluster_block(cluster: &RedisCluster) -> String {
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    cluster: [{}]\n    timeout: 2s\n",
        nodes.join(", ")
    )
}

/// Seconds from now to the end of the current `period` ("hour"/"day") in `tz`, by jiff.
fn secs_to_end(tz: &str, day: bool) -> f64 {
    let now = jiff::Timestamp::now().to_zoned_datetime(jiff::tz::TimeZone::get(tz).unwrap());
    let end = if day {
        now.date()
            .tomorrow()
            .unwrap()
            .to_zoned_datetime(now.time_zone().clone())
            .unwrap()
    } else {
        let start = now
            .with()
            .minute(0)
            .second(0)
            .subsec_nanosecond(0)
            .build()
            .unwrap();
        start
            .checked_add(jiff::SignedDuration::from_hours(1))
            .unwrap()
    };
    (end.timestamp().as_microsecond() - now.timestamp().as_microsecond()) as f64 / 1e6
}

/// On the paused clock: 5 an hour, exactly; the sixth is told to come back at the hour's end,
/// and once the clock crosses it the quota is whole again.
#[tokio::test(start_paused = true)]
async fn exactly_n_per_hour_then_afresh_at_the_hours_end() {
    let proxy = TestProxy::inline(&answering(
        "",
        "      - { name: hourly, quota: 5/hour, key: [ip] }\n",
    ))
    .await;
    let http = Http::new();
    let url = proxy.url("/");
    let to_end = secs_to_end("UTC", false);
    for left in (0..5).rev() {
        let r = http.get(&url).await;
        assert_eq!(r.code(), 200);
        assert_eq!(r.header("ratelimit-policy"), "\"hourly\";q=5;w=3600");
        let t: f64 = r
            .header("ratelimit")
            .rsplit("t=")
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            (t - to_end).abs() <= 2.0,
            "t={t}, the hour ends in {to_end}"
        );
        assert!(r
            .header("ratelimit")
            .starts_with(&format!("\"hourly\";r={left};")));
    }
    let r = http.get(&url).await;
    assert_eq!(r.code(), 429);
    let retry: u64 = r.header("retry-after").parse().unwrap();
    assert!(
        (retry as f64 - to_end).abs() <= 2.0,
        "retry {retry}, end in {to_end}"
    );
    // A second before the end: still nothing.
    tokio::time::sleep(Duration::from_secs(retry.saturating_sub(2))).await;
    let http = Http::new();
    assert_eq!(http.get(&url).await.code(), 429);
    // Past the end: five again, and only five.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let codes = Http::new().statuses(7, &url, &[]).await;
    assert_eq!(codes, [200, 200, 200, 200, 200, 429, 429]);
}

/// A request another limit rejects takes nothing from the quota.
#[tokio::test(start_paused = true)]
async fn a_request_rejected_elsewhere_takes_no_quota() {
    let proxy = TestProxy::inline(&answering(
        "",
        "      - { name: daily, quota: 3/day, key: [ip] }\n      - { name: pace, rate: 1/min, burst: 1, key: [ip] }\n",
    ))
    .await;
    let http = Http::new();
    let url = proxy.url("/");
    assert_eq!(http.get(&url).await.code(), 200);
    for _ in 0..5 {
        let r = http.get(&url).await;
        assert_eq!(r.code(), 429);
        assert!(r.text().contains("pace"), "{}", r.text());
    }
    // Two more a minute apart: the five rejections took no quota. (A fresh client after each
    // wait: the idle keep-alive connection is closed meanwhile.)
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_mins(1)).await;
        assert_eq!(Http::new().get(&url).await.code(), 200);
    }
    tokio::time::sleep(Duration::from_mins(1)).await;
    let r = Http::new().get(&url).await;
    assert_eq!(r.code(), 429);
    assert!(r.text().contains("daily"), "{}", r.text());
    let retry: f64 = r.header("retry-after").parse().unwrap();
    assert!(
        retry > 60.0 || secs_to_end("UTC", true) < 200.0,
        "retry {retry}"
    );
}

/// `cost` takes several; `timezone` sets where the day ends.
#[tokio::test(start_paused = true)]
async fn cost_and_timezone() {
    let proxy = TestProxy::inline(&answering(
        "",
        "      - { name: tokyo, quota: 10/day, timezone: Asia/Tokyo, cost: 4, key: [ip] }\n",
    ))
    .await;
    let http = Http::new();
    let url = proxy.url("/");
    let to_end = secs_to_end("Asia/Tokyo", true);
    let r = http.get(&url).await;
    assert!(r.header("ratelimit").starts_with("\"tokyo\";r=6;"));
    let t: f64 = r
        .header("ratelimit")
        .rsplit("t=")
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (t - to_end).abs() <= 2.0,
        "t={t}, Tokyo's day ends in {to_end}"
    );
    assert_eq!(http.statuses(2, &url, &[]).await, [200, 429]);
}

#[test]
fn rate_and_quota_together_or_neither_are_refused_with_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    for (limit, says) in [
        (
            "{ name: a, rate: 1/s, quota: 5/day, key: [ip] }",
            "has both `rate` and `quota`",
        ),
        ("{ name: a, key: [ip] }", "needs `rate`"),
        (
            "{ name: a, quota: 5/fortnight, key: [ip] }",
            "quota `5/fortnight` must look like",
        ),
        (
            "{ name: a, quota: 5/day, timezone: Mars/Olympus, key: [ip] }",
            "not an IANA time zone",
        ),
    ] {
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, answering("", &format!("      - {limit}\n"))).unwrap();
        let out = check(path.to_str().unwrap());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{limit} was accepted");
        assert!(stderr.contains(says), "{limit}: {stderr}");
        assert!(stderr.contains("c.yaml:7:"), "no line and column: {stderr}");
    }
}

/// Send requests until Redis answers (the connection opens in the background).
pub(crate) async fn until_redis_answers(http: &Http, url: &str, key: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while http.get_with(url, &[("x-api-key", key)]).await.code() == 503 {
        assert!(std::time::Instant::now() < deadline, "Redis never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two replicas sharing one Redis admit exactly the quota between them, racing; the key
/// expires at the window's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_quota_exactly() {
    let redis = RedisServer::start();
    let yaml = answering(
        &redis_block(&redis.url()),
        "      - { name: daily, quota: 40/day, key: [\"header:x-api-key\"] }\n",
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
    assert_eq!(ok, 40, "120 requests over two replicas, a quota of 40");
    let keys: Vec<String> = redis
        .keys()
        .into_iter()
        .filter(|k| k.contains("daily"))
        .collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    let to_end = secs_to_end("UTC", true);
    for key in keys {
        let ttl: f64 = redis.cli(&["PTTL", &key]).trim().parse().unwrap();
        assert!(
            (ttl / 1000.0 - to_end).abs() < 5.0,
            "{key}: PTTL {ttl} ms, day ends in {to_end} s"
        );
    }
}

/// Redis's clock picks the window: with Redis an hour ahead, a replica whose own clock is still
/// in the exhausted hour counts in Redis's next hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_clock_chooses_the_window() {
    let redis = RedisServer::start_with_fake_clock();
    let yaml = answering(
        &redis_block(&redis.url()),
        "      - { name: hourly, quota: 3/hour, key: [\"header:x-api-key\"] }\n",
    );
    let a = TestProxy::start(&yaml);
    let http = Http::new();
    until_redis_answers(&http, &a.url("/"), "warm").await;
    let key = [("x-api-key", "k")];
    assert_eq!(
        http.statuses(4, &a.url("/"), &key).await,
        [200, 200, 200, 429]
    );
    // Redis steps an hour ahead; a replica that has never seen the client (no cached
    // rejection) asks it, and Redis counts in its own hour: a fresh 3.
    redis.set_clock_offset(3600);
    let b = TestProxy::start(&yaml);
    until_redis_answers(&http, &b.url("/"), "warm2").await;
    assert_eq!(
        http.statuses(4, &b.url("/"), &key).await,
        [200, 200, 200, 429]
    );
}

/// On a Redis Cluster, quotas of different clients live in their own slots, each exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_quotas_are_exact_across_replicas() {
    let cluster = RedisCluster::start();
    let yaml = answering(
        &cluster_block(&cluster),
        "      - { name: daily, quota: 10/day, key: [\"header:x-api-key\"] }\n      - { name: weekly, quota: 1000/week, key: [\"header:x-tenant\"] }\n",
    );
    let (a, b) = (TestProxy::start(&yaml), TestProxy::start(&yaml));
    let http = Http::new();
    until_redis_answers(&http, &a.url("/"), "warm").await;
    until_redis_answers(&http, &b.url("/"), "warm").await;
    for client in ["c1", "c2", "c3", "c4"] {
        let headers = [("x-api-key", client), ("x-tenant", "t")];
        let mut ok = 0;
        for proxy in [&a, &b] {
            ok += http
                .statuses(8, &proxy.url("/"), &headers)
                .await
                .iter()
                .filter(|c| **c == 200)
                .count();
        }
        assert_eq!(ok, 10, "client {client}");
    }
    // The tenant's weekly quota (its own slot) was charged by the 40 admitted requests only:
    // with a daily quota of its own left whole, the weekly one is what the headers report.
    let yaml = answering(
        &cluster_block(&cluster),
        "      - { name: weekly, quota: 1000/week, key: [\"header:x-tenant\"] }\n",
    );
    let c = TestProxy::start(&yaml);
    until_redis_answers(&http, &c.url("/"), "warm").await;
    let r = http.get_with(&c.url("/"), &[("x-tenant", "t")]).await;
    assert_eq!(r.code(), 200);
    assert!(
        r.header("ratelimit").starts_with("\"weekly\";r=959;"),
        "{}",
        r.header("ratelimit")
    );
}

/// Redis restarted without persistence lost a spent quota's count: the replica whose negative
/// cache held the rejection forgets it once its connection is replaced, and admits again as
/// Redis does (without, it would refuse until the day's end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_empties_the_negative_cache() {
    let mut redis = RedisServer::start();
    let yaml = answering(
        &redis_block(&redis.url()),
        "      - { name: daily, quota: 2/day, key: [\"header:x-api-key\"] }\n",
    );
    let a = TestProxy::start(&yaml);
    let http = Http::new();
    until_redis_answers(&http, &a.url("/"), "warm").await;
    let key = [("x-api-key", "spent")];
    assert_eq!(
        http.statuses(4, &a.url("/"), &key).await,
        [200, 200, 429, 429]
    );
    redis.restart();
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            http.get_with(&a.url("/"), &key).await.code() == 200
        })
        .await,
        "the replica went on refusing what Redis forgot"
    );
}

/// The same on a Redis Cluster, whose client replaces a node's connection by itself: the
/// sweep sees the node's `run_id` change and the negative cache is emptied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_restart_empties_the_negative_cache() {
    let mut cluster = RedisCluster::start();
    let yaml = answering(
        &cluster_block(&cluster),
        "      - { name: daily, quota: 2/day, key: [\"header:x-api-key\"] }\n",
    );
    let a = TestProxy::start(&yaml);
    let http = Http::new();
    until_redis_answers(&http, &a.url("/"), "warm").await;
    let key = [("x-api-key", "spent")];
    assert_eq!(
        http.statuses(4, &a.url("/"), &key).await,
        [200, 200, 429, 429]
    );
    // Let a sweep note every node's run_id first.
    tokio::time::sleep(Duration::from_secs(6)).await;
    for node in &mut cluster.nodes {
        node.restart();
    }
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            http.get_with(&a.url("/"), &key).await.code() == 200
        })
        .await,
        "the replica went on refusing what the cluster forgot"
    );
}
