//! Envoy's rate limit service over Redis: two replicas counting one descriptor together, all or
//! nothing in one script, a leased hot descriptor, and each descriptor's failure policy with
//! Redis gone. Real `redis-server`, real time, a tonic client.

use crate::common;
use crate::common::redis as redis_helpers;
use crate::common::rls::{code, name, Rls};

use std::time::{Duration, Instant};

use common::{sample, TestProxy};
use redis_helpers::RedisServer;

/// The rules: hour-long windows and buckets refilling one an hour, so counts are exact.
const RULES: &str = "domain: api
descriptors:
  - key: user
    rate_limit: { unit: hour, requests_per_unit: 5 }
    on_failure: closed
  - key: narrow
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: wide
    rate_limit: { unit: hour, requests_per_unit: 10 }
  - key: hot
    rate_limit: { unit: hour, requests_per_unit: 200 }
    algorithm: token_bucket
    leasing: { tokens: 20, hold: 5s }
  - key: open
    rate_limit: { unit: hour, requests_per_unit: 1 }
    on_failure: open
  - key: local
    rate_limit: { unit: hour, requests_per_unit: 4 }
    on_failure: local
  - key: probe
    rate_limit: { unit: second, requests_per_unit: 1000000 }
    on_failure: closed
";

/// A replica serving `RULES` from `dir` over the Redis at `url`.
fn replica(dir: &std::path::Path, url: &str) -> TestProxy {
    replica_on(dir, &format!("{{ url: \"{url}\", timeout: 500ms }}"))
}

/// A replica serving `RULES` from `dir` over the Redis `redis:` block given.
fn replica_on(dir: &std::path::Path, redis: &str) -> TestProxy {
    let yaml = format!(
        "admin: {{ address: 127.0.0.1:0 }}\nlimiter:\n  backend: redis\n  local_fallback: {{ divide_by: 2 }}\n  redis: {redis}\nrls: {{ address: 127.0.0.1:0, config: {} }}\n",
        dir.display()
    );
    TestProxy::start(&yaml)
}

/// Wait until `rls` decides in Redis: a `closed` descriptor is answered `OK`.
async fn until_redis_decides(rls: &Rls) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while code(&rls.call("api", &[&[("probe", "p")]], 0).await) != "OK" {
        assert!(Instant::now() < deadline, "Redis never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_descriptors_in_redis_all_or_nothing() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("api.yaml"), RULES).unwrap();
    let (a, b) = (
        replica(dir.path(), &redis.url()),
        replica(dir.path(), &redis.url()),
    );
    let (ra, rb) = (Rls::to(a.rls_addr()), Rls::to(b.rls_addr()));
    until_redis_decides(&ra).await;
    until_redis_decides(&rb).await;
    // One user's five an hour, counted by both replicas together.
    let user = [("user", "ann")];
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.extend(ra.codes("api", &user, 1).await);
        codes.extend(rb.codes("api", &user, 1).await);
    }
    assert_eq!(codes, ["OK", "OK", "OK", "OK", "OK", "OVER_LIMIT"]);
    // A call the narrow limit refuses takes nothing from the wide one, on either replica.
    let both: [&[(&str, &str)]; 2] = [&[("narrow", "n")], &[("wide", "w")]];
    assert_eq!(code(&ra.call("api", &both, 0).await), "OK");
    for rls in [&ra, &rb, &ra, &rb] {
        let r = rls.call("api", &both, 0).await;
        assert_eq!(
            r.statuses.iter().map(|s| name(s.code)).collect::<Vec<_>>(),
            ["OVER_LIMIT", "OK"]
        );
    }
    let wide = rb.call("api", &[&[("wide", "w")]], 0).await;
    assert_eq!(
        wide.statuses[0].limit_remaining, 8,
        "only the admitted call took from it"
    );
    // A hot descriptor spends leased tokens without a Redis call each, within its 200.
    let mut ok = 0;
    for _ in 0..60 {
        ok += usize::from(code(&ra.call("api", &[&[("hot", "h")]], 0).await) == "OK");
    }
    assert_eq!(ok, 60);
    let leased: f64 = sample(&a.scrape().await, "tollgate_redis_leased_checks_total");
    assert!(leased >= 30.0, "{leased} of 60 calls answered from a lease");
    // The user's last call on A used all five (near), B's next was over.
    let series = |result: &str| {
        format!(
            "tollgate_rls_descriptors_total{{domain=\"api\",rule=\"user\",result=\"{result}\"}}"
        )
    };
    let near: f64 = sample(&a.scrape().await, &series("near_limit"));
    let over: f64 = sample(&b.scrape().await, &series("over_limit"));
    assert_eq!((near, over), (1.0, 1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_descriptor_follows_its_failure_policy_without_redis() {
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("api.yaml"), RULES).unwrap();
    let a = replica(dir.path(), &redis.url());
    let rls = Rls::to(a.rls_addr());
    until_redis_decides(&rls).await;
    redis.kill();
    // closed: refused; open: admitted however many; local: the fallback's share, 4 / 2.
    assert_eq!(
        rls.codes("api", &[("user", "bob")], 2).await,
        ["OVER_LIMIT"; 2]
    );
    assert_eq!(rls.codes("api", &[("open", "o")], 3).await, ["OK"; 3]);
    assert_eq!(
        rls.codes("api", &[("local", "l")], 3).await,
        ["OK", "OK", "OVER_LIMIT"]
    );
    let without: f64 = sample(&a.scrape().await, "tollgate_decided_without_backend_total");
    assert!(without >= 5.0, "decided without Redis: {without}");
}

/// Over a Redis Cluster: two replicas count one descriptor together, and a leased hot
/// descriptor stays within its bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_descriptors_over_a_redis_cluster() {
    let cluster = redis_helpers::RedisCluster::start();
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let block = format!("{{ cluster: [{}], timeout: 2s }}", nodes.join(", "));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("api.yaml"), RULES).unwrap();
    let (a, b) = (
        replica_on(dir.path(), &block),
        replica_on(dir.path(), &block),
    );
    let (ra, rb) = (Rls::to(a.rls_addr()), Rls::to(b.rls_addr()));
    until_redis_decides(&ra).await;
    until_redis_decides(&rb).await;
    for user in ["ann", "bob", "cyd"] {
        let mut codes = Vec::new();
        for _ in 0..3 {
            codes.extend(ra.codes("api", &[("user", user)], 1).await);
            codes.extend(rb.codes("api", &[("user", user)], 1).await);
        }
        assert_eq!(
            codes,
            ["OK", "OK", "OK", "OK", "OK", "OVER_LIMIT"],
            "{user}"
        );
    }
}
