//! `cost: { reserve, from_response }`: a reserve taken at admission, settled to what the
//! response says the request cost (`X-Cost` from a backend answering `/cost/N`): refunds,
//! charges past the bucket into debt (the next request told the real wait), a missing header
//! charged the reserve, the units counted; over Redis two replicas sharing the debt.

use crate::common;
use crate::common::redis as redis_helpers;

use std::time::Duration;

use common::{config, sample, upstream_app, Http, MockUpstream, TestProxy};
use redis_helpers::RedisServer;

/// A route to `app` with a tenant's token budget of 1000 an hour, 100 reserved a request.
fn budget(app: std::net::SocketAddr, extra: &str) -> String {
    config(&format!(
        "admin: {{ address: 127.0.0.1:0 }}\n{extra}{}routes:\n  - name: llm\n    match: {{ path_prefix: / }}\n    upstream: app\n    limits:\n      - {{ name: tokens, rate: 1000/h, burst: 1000, key: [\"header:x-tenant\"], cost: {{ reserve: 100, from_response: x-cost }} }}\n",
        upstream_app(app, "5s")
    ))
}

/// `r=` of a response's `RateLimit` header: what was left after its reserve.
fn remaining(r: &common::Reply) -> i64 {
    let v = r.header("ratelimit");
    let r = v.split(";r=").nth(1).expect("r=");
    r[..r.find(';').unwrap_or(r.len())]
        .parse()
        .expect("a number")
}

async fn settles_and_owes(a: &TestProxy, b: &TestProxy, pause: Duration) {
    let http = Http::new();
    let acme = [("x-tenant", "acme")];
    // 100 reserved, 10 charged: 90 back.
    let first = http.get_with(&a.url("/cost/10"), &acme).await;
    assert_eq!((first.code(), remaining(&first)), (200, 900));
    tokio::time::sleep(pause).await;
    let second = http.get_with(&b.url("/cost/1500"), &acme).await;
    assert_eq!(
        (second.code(), remaining(&second)),
        (200, 890),
        "990 left, 100 reserved"
    );
    tokio::time::sleep(pause).await;
    // 1500 charged where 100 was reserved: 890 - 1400 = 510 owed. The next request waits for
    // the debt and its own reserve: 610 tokens at 1000 an hour, 2,196 s.
    let owing = http.get_with(&a.url("/cost/1"), &acme).await;
    assert_eq!(owing.code(), 429);
    let retry: u64 = owing.header("retry-after").parse().unwrap();
    assert!(
        (2150..=2200).contains(&retry),
        "the debt's real wait: {retry}"
    );
    // Another tenant has its own budget; a response without the header is charged its reserve.
    let other = [("x-tenant", "globex")];
    let plain = http.get_with(&b.url("/plain"), &other).await;
    assert_eq!(remaining(&plain), 900);
    tokio::time::sleep(pause).await;
    let next = http.get_with(&a.url("/cost/0"), &other).await;
    assert_eq!(
        remaining(&next),
        800,
        "the reserve of the request without X-Cost stayed charged"
    );
}

#[tokio::test]
async fn a_reserve_is_settled_to_the_response_and_a_debt_is_waited_out() {
    let app = MockUpstream::start();
    let proxy = TestProxy::start(&budget(app.addr(), ""));
    settles_and_owes(&proxy, &proxy, Duration::ZERO).await;
    let units: u64 = sample(
        &proxy.scrape().await,
        "tollgate_limit_units_total{route=\"llm\",limit=\"tokens\"}",
    );
    assert_eq!(units, 10 + 1500 + 100, "the settled units");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_budget_and_its_debt_over_redis() {
    let redis = RedisServer::start();
    let app = MockUpstream::start();
    let block = format!(
        "limiter:\n  backend: redis\n  on_failure: closed\n  redis: {{ url: \"{}\", timeout: 2s }}\n",
        redis.url()
    );
    let yaml = budget(app.addr(), &block);
    let (a, b) = (TestProxy::start(&yaml), TestProxy::start(&yaml));
    let http = Http::new();
    for p in [&a, &b] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while http
            .get_with(&p.url("/cost/0"), &[("x-tenant", "warm")])
            .await
            .code()
            != 200
        {
            assert!(std::time::Instant::now() < deadline, "Redis never answered");
        }
    }
    // The settlement is one more script call, sent after the response: a pause lets it land.
    settles_and_owes(&a, &b, Duration::from_millis(200)).await;
}

/// `explain` shows a bucket's debt and when the next request would pass.
#[tokio::test]
async fn explain_shows_the_debt() {
    let app = MockUpstream::start();
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let yaml = budget(app.addr(), "").replace(
        "admin: { address: 127.0.0.1:0 }",
        &format!(
            "admin: {{ address: 127.0.0.1:0, token_file: {} }}",
            token.display()
        ),
    );
    let proxy = TestProxy::start(&yaml);
    let http = Http::new();
    let acme = [("x-tenant", "acme")];
    assert_eq!(
        http.get_with(&proxy.url("/cost/1500"), &acme).await.code(),
        200
    );
    let url = format!(
        "http://{}/api/v1/explain?path=/x&header=x-tenant:acme",
        proxy.admin_addr()
    );
    let e = http
        .get_with(&url, &[("authorization", "Bearer s3cret")])
        .await;
    let v: serde_json::Value = serde_json::from_str(e.text()).unwrap();
    assert_eq!(v["limits"][0]["now"]["owed"], 500, "{v}");
    assert_eq!(v["decision"]["outcome"], "limited");
    let retry = v["decision"]["retry_after_s"].as_f64().unwrap();
    assert!(
        (2150.0..2170.0).contains(&retry),
        "600 tokens at 1000 an hour: {retry}"
    );
}

/// The access log records what the response said the request cost, in text and JSON.
#[tokio::test]
async fn the_access_log_records_the_settled_cost() {
    let app = MockUpstream::start();
    let yaml = budget(app.addr(), "");
    let proxy = common::BinaryProxy::start(&yaml);
    let http = Http::new();
    let url = format!("http://{}/cost/42", proxy.addr());
    assert_eq!(
        http.get_with(&url, &[("x-tenant", "acme")]).await.code(),
        200
    );
    let wait = Duration::from_secs(5);
    assert!(
        proxy.wait_for_log("status=200 cost=42 ", wait),
        "{:#?}",
        proxy.logs()
    );
    let json = common::BinaryProxy::start_with_env(&yaml, &[("TOLLGATE_LOG_FORMAT", "json")]);
    let url = format!("http://{}/cost/7", json.addr());
    assert_eq!(
        http.get_with(&url, &[("x-tenant", "acme")]).await.code(),
        200
    );
    assert!(
        json.wait_for_log("\"tollgate.cost\":7", wait),
        "{:#?}",
        json.logs()
    );
}
