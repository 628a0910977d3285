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
    let block = format!(
        "limiter:\n  backend: redis\n  on_failure: closed\n  redis: {{ url: \"{}\", timeout: 2s }}\n",
        redis.url()
    );
    two_replicas_share(&block).await;
}

/// The same over a three-node Redis Cluster: a settlement goes in its slot's batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_budget_and_its_debt_over_a_cluster() {
    let cluster = redis_helpers::RedisCluster::start();
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let block = format!(
        "limiter:\n  backend: redis\n  on_failure: closed\n  redis: {{ cluster: [{}], timeout: 2s }}\n",
        nodes.join(", ")
    );
    two_replicas_share(&block).await;
}

/// Two replicas on the store `block` names settle one tenant's budget together.
async fn two_replicas_share(block: &str) {
    let app = MockUpstream::start();
    let yaml = budget(app.addr(), block);
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

/// A thread-per-connection backend that answers in chunks and says the cost in a trailer
/// (`X-Cost: 700`) when asked `TE: trailers`; it counts the requests that asked.
fn chunked_backend() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::io::{BufRead, BufReader, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let asked = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = asked.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let counted = counted.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut out = stream;
                loop {
                    let mut te = false;
                    let mut line = String::new();
                    let mut first = true;
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" && !first {
                            break;
                        }
                        first = false;
                        te |= line.to_ascii_lowercase().starts_with("te: trailers");
                    }
                    let trailer = if te {
                        counted.fetch_add(1, Ordering::Relaxed);
                        "X-Cost: 700\r\n"
                    } else {
                        ""
                    };
                    let reply = format!("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Cost\r\n\r\n3\r\nok\n\r\n0\r\n{trailer}\r\n");
                    if out.write_all(reply.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, asked)
}

/// A chunked HTTP/1.1 response that says its cost in a trailer is settled by it, read ahead
/// (the default) or streamed; the trailer is asked for with `TE: trailers`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_in_a_chunked_responses_trailer_is_settled() {
    let (addr, asked) = chunked_backend();
    let yaml = budget(addr, "").replace(
        "routes:\n",
        "routes:\n  - name: streamed\n    match: { path_prefix: /streamed }\n    upstream: app\n    buffering: { response: false }\n    limits:\n      - { name: streamed_tokens, rate: 1000/h, burst: 1000, key: [\"header:x-tenant\"], cost: { reserve: 100, from_response: x-cost } }\n",
    );
    let proxy = TestProxy::start(&yaml);
    let http = Http::new();
    for (path, tenant) in [("/x", "acme"), ("/streamed", "globex")] {
        let who = [("x-tenant", tenant)];
        let first = http.get_with(&proxy.url(path), &who).await;
        assert_eq!((first.code(), first.text()), (200, "ok\n"));
        assert_eq!(remaining(&first), 900);
        // 700 charged for the first: 300 left, 100 reserved by the second.
        let second = http.get_with(&proxy.url(path), &who).await;
        assert_eq!(
            (path, remaining(&second)),
            (path, 200),
            "settled from the trailer"
        );
    }
    assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 4);
    let units: u64 = sample(
        &proxy.scrape().await,
        "tollgate_limit_units_total{route=\"llm\",limit=\"tokens\"}",
    );
    assert_eq!(units, 1400);
}
