//! Operators' bans and overrides through the admin API, end to end: the token, a ban refusing
//! a client before its upstream and lifted by DELETE, expiry, overrides of a rate and of a
//! quota, the answers to bad input, and fleet-wide: two replicas on one real redis-server, each
//! enforcing within a second what the other was told, and a replica restarted on the same
//! Redis enforcing the bans it holds from its first request.
//!
//! Entries expire on the wall clock (they are shared by replicas with clocks of their own), so
//! the expiry test waits on real time, polling with a deadline.

use crate::common;
use crate::common::redis as redis_helpers;

use std::io::Write;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{config, sample, upstream_app, BinaryProxy, Http, MockUpstream, Reply, TestProxy};
use http_body_util::BodyExt;
use redis_helpers::{RedisCluster, RedisServer};
use serde_json::{json, Value};

const TOKEN: &str = "test-admin-token-0123456789";

/// A file holding the admin token, for as long as the test holds it.
fn token_file() -> tempfile::TempPath {
    let mut f = tempfile::NamedTempFile::new().expect("a token file");
    writeln!(f, "{TOKEN}").expect("write the token");
    f.into_temp_path()
}

/// Routes `api` (`/v1/`, limit `per-key`: burst 2, then one a minute per API key) and `rest`
/// (everything else, unlimited), forwarding to `upstream`; `limiter` is a `limiter:` block or "".
fn yaml(token: &tempfile::TempPath, upstream: std::net::SocketAddr, limiter: &str) -> String {
    config(&format!(
        "admin:\n  address: 127.0.0.1:0\n  token_file: {}\n{limiter}{}routes:\n  - name: api\n    match: {{ path_prefix: /v1/ }}\n    upstream: app\n    limits:\n      - {{ name: per-key, rate: 1/min, burst: 2, key: [header:X-API-Key, ip] }}\n      - {{ name: daily, quota: 3/day, key: [header:X-API-Key, ip] }}\n  - name: rest\n    match: {{ path_prefix: / }}\n    upstream: app\n",
        token.display(),
        upstream_app(upstream, "5s"),
    ))
}

fn redis_block(url: &str) -> String {
    format!("limiter:\n  backend: redis\n  redis:\n    url: \"{url}\"\n    timeout: 500ms\n")
}

/// `method /api/v1{path}` on `proxy`'s admin listener with the token (or `token`), and `body`.
async fn api_as(
    proxy: &TestProxy,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: &str,
) -> Reply {
    api_at(proxy.admin_addr(), token, method, path, body).await
}

/// `api_as`, on the admin listener at `admin`.
async fn api_at(
    admin: std::net::SocketAddr,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: &str,
) -> Reply {
    let url = format!("http://{admin}/api/v1{path}");
    let mut b = http::Request::builder().method(method).uri(url);
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    let req = b
        .body(
            http_body_util::Full::new(Bytes::from(body.to_owned()))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("a request");
    Http::new().send(req).await
}

async fn api(proxy: &TestProxy, method: &str, path: &str, body: &Value) -> Reply {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    api_as(proxy, Some(TOKEN), method, path, &body).await
}

fn json_of(r: &Reply) -> Value {
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.text()))
}

async fn get_key(proxy: &TestProxy, path: &str, key: &str) -> Reply {
    Http::new()
        .get_with(&proxy.url(path), &[("x-api-key", key)])
        .await
}

/// Poll `proxy` with `key` until it answers `status`; the time it took, or a panic after
/// `within`.
async fn until_status(proxy: &TestProxy, key: &str, status: u16, within: Duration) -> Duration {
    until(proxy, key, |s| s == status, within).await
}

/// `until_status`, for any status `wanted` holds for.
async fn until(
    proxy: &TestProxy,
    key: &str,
    wanted: impl Fn(u16) -> bool,
    within: Duration,
) -> Duration {
    let started = Instant::now();
    loop {
        let r = get_key(proxy, "/v1/x", key).await;
        if wanted(r.code()) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "not the status wanted for key {key} within {within:?}, but {}: {}",
            r.code(),
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_api_wants_the_admin_token() {
    let (token, up) = (token_file(), MockUpstream::start());
    let proxy = TestProxy::start(&yaml(&token, up.addr(), ""));
    let body = r#"{"identity":"192.0.2.7","ttl":"1h"}"#;
    assert_eq!(api_as(&proxy, None, "GET", "/bans", "").await.code(), 401);
    assert_eq!(
        api_as(&proxy, None, "POST", "/bans", body).await.code(),
        401
    );
    let wrong = api_as(&proxy, Some("nope"), "DELETE", "/bans/x", "").await;
    assert_eq!(wrong.code(), 401);
    let r = api(&proxy, "GET", "/bans", &Value::Null).await;
    assert_eq!(r.code(), 200);
    assert_eq!(json_of(&r), json!({ "bans": [] }));
    assert_eq!(
        json_of(&api(&proxy, "GET", "/overrides", &Value::Null).await),
        json!({ "overrides": [] })
    );
}

#[tokio::test]
async fn a_ban_refuses_before_the_upstream_and_delete_lifts_it() {
    let (token, up) = (token_file(), MockUpstream::start());
    let proxy = TestProxy::start(&yaml(&token, up.addr(), ""));
    let ban = json!({"identity": "header:X-API-Key=evil-secret-key", "ttl": "1h", "reason": "INC-42 scraping"});
    let r = api(&proxy, "POST", "/bans", &ban).await;
    assert_eq!(r.code(), 201, "{}", r.text());
    let made = json_of(&r);
    let id = made["id"].as_str().unwrap().to_owned();
    assert_eq!(r.header("location"), format!("/api/v1/bans/{id}"));
    assert!(
        !r.text().contains("evil"),
        "the key is shown redacted: {made}"
    );
    let shown = made["identity"].as_str().unwrap();
    assert!(shown.starts_with("header:x-api-key=blake3:"), "{shown}");
    assert_eq!(made["reason"], "INC-42 scraping");
    assert_eq!(made["routes"], json!([]));
    assert!((3599..=3600).contains(&made["ttl_left_s"].as_u64().unwrap()));
    assert_eq!(
        made["expires_unix"].as_i64().unwrap() - made["created_unix"].as_i64().unwrap(),
        3600
    );
    assert!(made["expires"].as_str().unwrap().ends_with('Z'), "{made}");

    // Refused on every route, before any limit or the upstream; other keys go through.
    for path in ["/v1/x", "/other"] {
        let r = get_key(&proxy, path, "evil-secret-key").await;
        assert_eq!(r.code(), 403, "{path}");
        assert_eq!(r.header("content-type"), "application/problem+json");
        let p = json_of(&r);
        assert_eq!(p["type"], "urn:tollgate:problem:operator-ban", "{p}");
        assert_eq!(p["ban"], id.as_str());
        let retry: u64 = r.header("retry-after").parse().unwrap();
        assert!((3590..=3600).contains(&retry), "{retry}");
        assert!(r.opt_header("ratelimit").is_none(), "no limit was asked");
    }
    assert_eq!(up.count(), 0, "nothing banned reached the upstream");
    assert_eq!(get_key(&proxy, "/v1/x", "good").await.code(), 200);
    assert_eq!(up.count(), 1);
    let m = proxy.scrape().await;
    assert_eq!(
        sample::<u64>(&m, "tollgate_admin_banned_requests_total{route=\"api\"}"),
        1
    );
    assert_eq!(
        sample::<u64>(&m, "tollgate_admin_banned_requests_total{route=\"rest\"}"),
        1
    );

    let listed = json_of(&api(&proxy, "GET", "/bans", &Value::Null).await);
    assert_eq!(listed["bans"][0]["id"], id.as_str());
    assert_eq!(listed["bans"][0]["identity"], shown);
    assert_eq!(listed["bans"][0]["expires"], made["expires"]);

    let r = api(&proxy, "DELETE", &format!("/bans/{id}"), &Value::Null).await;
    assert_eq!(r.code(), 204, "{}", r.text());
    assert_eq!(
        get_key(&proxy, "/v1/x", "evil-secret-key").await.code(),
        200
    );
    assert_eq!(up.count(), 2);
    assert_eq!(
        api(&proxy, "DELETE", &format!("/bans/{id}"), &Value::Null)
            .await
            .code(),
        404
    );
    assert_eq!(
        json_of(&api(&proxy, "GET", "/bans", &Value::Null).await),
        json!({ "bans": [] })
    );
}

#[tokio::test]
async fn a_network_ban_holds_on_its_routes_only_and_survives_a_reload() {
    let (token, up) = (token_file(), MockUpstream::start());
    let proxy = TestProxy::start(&yaml(&token, up.addr(), ""));
    let ban = json!({"identity": "127.0.0.0/8", "ttl": "10m", "routes": ["api"]});
    let r = api(&proxy, "POST", "/bans", &ban).await;
    assert_eq!(r.code(), 201, "{}", r.text());
    assert_eq!(json_of(&r)["identity"], "127.0.0.0/8");
    assert_eq!(get_key(&proxy, "/v1/x", "k").await.code(), 403);
    assert_eq!(get_key(&proxy, "/other", "k").await.code(), 200);
    // A reload keeps it.
    proxy.reload();
    assert!(proxy.wait_for_generation(2, Duration::from_secs(5)).await);
    assert_eq!(get_key(&proxy, "/v1/x", "k").await.code(), 403);
}

#[tokio::test]
async fn a_ban_expires_on_time() {
    let (token, up) = (token_file(), MockUpstream::start());
    let proxy = TestProxy::start(&yaml(&token, up.addr(), ""));
    let ban = json!({"identity": "header:X-API-Key=brief", "ttl": "1s"});
    let posted = Instant::now();
    assert_eq!(api(&proxy, "POST", "/bans", &ban).await.code(), 201);
    let r = get_key(&proxy, "/v1/x", "brief").await;
    if posted.elapsed() < Duration::from_millis(900) {
        assert_eq!(r.code(), 403);
    }
    until_status(&proxy, "brief", 200, Duration::from_secs(3)).await;
    assert!(
        posted.elapsed() >= Duration::from_millis(900),
        "lifted early"
    );
    // The sweep (every 250 ms) takes it out of the listing too.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let listed = json_of(&api(&proxy, "GET", "/bans", &Value::Null).await);
        if listed["bans"] == json!([]) {
            break;
        }
        assert!(Instant::now() < deadline, "still listed: {listed}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn overrides_raise_a_rate_and_a_quota_for_one_key() {
    let (token, up) = (token_file(), MockUpstream::start());
    let proxy = TestProxy::start(&yaml(&token, up.addr(), ""));
    for key in ["big", "small"] {
        assert_eq!(
            Http::new()
                .statuses(3, &proxy.url("/v1/x"), &[("x-api-key", key)])
                .await,
            [200, 200, 429]
        );
    }
    let raise = json!({"limit": "per-key", "identity": "header:X-API-Key=big", "rate": "100/s", "burst": 100, "ttl": "5m", "reason": "launch"});
    let r = api(&proxy, "POST", "/overrides", &raise).await;
    assert_eq!(r.code(), 201, "{}", r.text());
    let made = json_of(&r);
    assert_eq!(made["limit"], "per-key");
    assert_eq!(made["rate"], "100/s");
    assert_eq!(made["burst"], 100);
    assert_eq!(made["quota"], Value::Null);
    assert!(!r.text().contains("=big"), "{made}");
    // The rate no longer stops `big`; the daily quota does, at its third admission (a
    // rejected request took nothing from it).
    // Its bucket, emptied at 1/min, is clamped to one token at 100/s: the next request
    // passes at once, not refused once with `Retry-After: 1`.
    assert_eq!(get_key(&proxy, "/v1/x", "big").await.code(), 200);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let r = get_key(&proxy, "/v1/x", "big").await;
    assert_eq!(r.code(), 429);
    assert!(r.text().contains("daily"), "{}", r.text());
    let quota = json!({"limit": "daily", "identity": "header:X-API-Key=big", "quota": "1000/day", "ttl": "5m"});
    let r = api(&proxy, "POST", "/overrides", &quota).await;
    assert_eq!(r.code(), 201, "{}", r.text());
    assert_eq!(json_of(&r)["quota"], "1000/day");
    // Five more admissions in the day (the raised rate refills 10 ms a token, and may refuse
    // one in between; the quota never does).
    let (mut admitted, deadline) = (0, Instant::now() + Duration::from_secs(2));
    while admitted < 5 {
        let r = get_key(&proxy, "/v1/x", "big").await;
        match r.code() {
            200 => admitted += 1,
            _ => assert!(r.text().contains("'per-key'"), "{}", r.text()),
        }
        assert!(Instant::now() < deadline, "{admitted} admitted");
    }
    assert_eq!(
        get_key(&proxy, "/v1/x", "small").await.code(),
        429,
        "others stay limited"
    );
    let listed = json_of(&api(&proxy, "GET", "/overrides", &Value::Null).await);
    assert_eq!(listed["overrides"].as_array().unwrap().len(), 2, "{listed}");
    // Deleted, the limit's own numbers count the same bucket again: at 100/s it refilled to
    // within a second of full, so 1/min admits once or twice, then refuses.
    let id = made["id"].as_str().unwrap();
    let r = api(&proxy, "DELETE", &format!("/overrides/{id}"), &Value::Null).await;
    assert_eq!(r.code(), 204);
    let after = Http::new()
        .statuses(3, &proxy.url("/v1/x"), &[("x-api-key", "big")])
        .await;
    assert_eq!((after[0], after[2]), (200, 429), "{after:?}");
}

#[tokio::test]
async fn bad_input_is_refused_with_a_clear_message() {
    let (token, up) = (token_file(), MockUpstream::start());
    let proxy = TestProxy::start(&yaml(&token, up.addr(), ""));
    let cases: [(&str, &str, &str); 15] = [
        (
            "/bans",
            r#"{"identity":"jwt:sub=alice","ttl":"1h"}"#,
            "needs `identity.jwt`",
        ),
        (
            "/overrides",
            r#"{"limit":"per-key","identity":"jwt:sub=alice","rate":"5/s","ttl":"1h"}"#,
            "needs `identity.jwt`",
        ),
        (
            "/bans",
            r#"{"identity":"1.2.3.4","ttl":"1h","reason":"txt.\u202eexe"}"#,
            "U+202E",
        ),
        ("/bans", "{\"identity\": ", "The body is not valid JSON"),
        ("/bans", r#"{"identity":"1.2.3.4"}"#, "missing field `ttl`"),
        (
            "/bans",
            r#"{"identity":"1.2.3.4","ttl":"1h","color":"red"}"#,
            "unknown field `color`",
        ),
        (
            "/bans",
            r#"{"identity":"nobody","ttl":"1h"}"#,
            "is neither a CIDR",
        ),
        (
            "/bans",
            r#"{"identity":"header:X-API-Key=","ttl":"1h"}"#,
            "empty value",
        ),
        (
            "/bans",
            r#"{"identity":"1.2.3.4","ttl":"5"}"#,
            "needs a unit",
        ),
        (
            "/bans",
            r#"{"identity":"1.2.3.4","ttl":"31d"}"#,
            "at most 30d",
        ),
        (
            "/bans",
            r#"{"identity":"1.2.3.4","ttl":"1h","routes":["nope"]}"#,
            "the routes are: api, rest",
        ),
        (
            "/overrides",
            r#"{"limit":"nope","identity":"1.2.3.4","rate":"5/s","ttl":"1h"}"#,
            "the limits are: per-key, daily",
        ),
        (
            "/overrides",
            r#"{"limit":"per-key","identity":"1.2.3.4","quota":"5/day","ttl":"1h"}"#,
            "is a token bucket",
        ),
        (
            "/overrides",
            r#"{"limit":"daily","identity":"1.2.3.4","quota":"5/week","ttl":"1h"}"#,
            "counts per day",
        ),
        (
            "/overrides",
            r#"{"limit":"per-key","identity":"1.2.3.4","rate":"fast","ttl":"1h"}"#,
            "rate `fast` must look like",
        ),
    ];
    for (path, body, says) in cases {
        let r = api_as(&proxy, Some(TOKEN), "POST", path, body).await;
        assert_eq!(r.code(), 400, "{body}: {}", r.text());
        assert_eq!(r.header("content-type"), "application/problem+json");
        let p = json_of(&r);
        let text = format!("{} {}", p["title"], p["detail"]);
        assert!(text.contains(says), "{body}: wanted `{says}` in {text}");
    }
    assert_eq!(
        json_of(&api(&proxy, "GET", "/bans", &Value::Null).await),
        json!({ "bans": [] }),
        "nothing was stored"
    );
}

/// Two replicas on one Redis: what one is told, the other enforces within a second (it polls
/// every 250 ms); a replica started afresh enforces the bans from its first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_on_one_redis_enforce_each_others_entries() {
    let redis = RedisServer::start();
    let (token, up) = (token_file(), MockUpstream::start());
    let config = yaml(&token, up.addr(), &redis_block(&redis.url()));
    let a = TestProxy::start(&config);
    let b = TestProxy::start(&config);
    // Redis decides (the RateLimit header says so) on both before anything is asserted.
    for p in [&a, &b] {
        until_header(p, "warm-up").await;
    }

    let ban = json!({"identity": "header:X-API-Key=stolen", "ttl": "10m", "reason": "leaked"});
    let r = api(&a, "POST", "/bans", &ban).await;
    assert_eq!(r.code(), 201, "{}", r.text());
    let id = json_of(&r)["id"].as_str().unwrap().to_owned();
    assert_eq!(
        get_key(&a, "/v1/x", "stolen").await.code(),
        403,
        "at once where it was made"
    );
    let took = until_status(&b, "stolen", 403, Duration::from_secs(1)).await;
    eprintln!("replica B enforced the ban after {took:?}");
    let listed = json_of(&api(&b, "GET", "/bans", &Value::Null).await);
    assert_eq!(listed["bans"][0]["id"], id.as_str(), "{listed}");
    assert!(listed["bans"][0]["ttl_left_s"].as_u64().unwrap() > 590);
    assert!(!redis
        .cli(&["HGETALL", "tollgate:control:{tollgate}:bans"])
        .contains("stolen"));

    // An override made on A lets its key through on B; other keys stay limited.
    for key in ["vip", "plain"] {
        assert_eq!(
            Http::new()
                .statuses(3, &b.url("/v1/x"), &[("x-api-key", key)])
                .await,
            [200, 200, 429]
        );
    }
    let raise = json!({"limit": "per-key", "identity": "header:X-API-Key=vip", "rate": "50/s", "burst": 50, "ttl": "10m"});
    assert_eq!(api(&a, "POST", "/overrides", &raise).await.code(), 201);
    until_status(&b, "vip", 200, Duration::from_secs(1)).await;
    assert_eq!(get_key(&b, "/v1/x", "plain").await.code(), 429);
    // `vip` spends its quota of 3 today (at 50/s its bucket gives a token every 20 ms, and
    // may refuse in between): then the quota refuses it, until a quota override made on A
    // (counted in Redis, in a bucket of its own) reaches B.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let r = get_key(&b, "/v1/x", "vip").await;
        if r.code() == 429 && r.text().contains("'daily'") {
            break;
        }
        assert!(Instant::now() < deadline, "{}: {}", r.code(), r.text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let more = json!({"limit": "daily", "identity": "header:X-API-Key=vip", "quota": "100/day", "ttl": "10m"});
    assert_eq!(api(&a, "POST", "/overrides", &more).await.code(), 201);
    until_status(&b, "vip", 200, Duration::from_secs(1)).await;
    until_status(&a, "vip", 200, Duration::from_secs(1)).await;

    // A replica started afresh on the same Redis refuses the banned key from its first request.
    drop(b);
    let c = TestProxy::start(&config);
    assert_eq!(get_key(&c, "/v1/x", "stolen").await.code(), 403);
    assert_eq!(
        json_of(&api(&c, "GET", "/overrides", &Value::Null).await)["overrides"][0]["limit"],
        "per-key"
    );

    // Deleted on the new replica, lifted on A (where its limits answer again: B admitted
    // `stolen` twice before it saw the ban, so its bucket is empty).
    let r = api(&c, "DELETE", &format!("/bans/{id}"), &Value::Null).await;
    assert_eq!(r.code(), 204, "{}", r.text());
    until(&a, "stolen", |s| s != 403, Duration::from_secs(1)).await;
    assert_eq!(
        api(&a, "DELETE", &format!("/bans/{id}"), &Value::Null)
            .await
            .code(),
        404
    );
}

/// Expired entries are dropped by every replica and deleted from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_entry_leaves_redis() {
    let redis = RedisServer::start();
    let (token, up) = (token_file(), MockUpstream::start());
    let config = yaml(&token, up.addr(), &redis_block(&redis.url()));
    let a = TestProxy::start(&config);
    let ban = json!({"identity": "192.0.2.9", "ttl": "1s"});
    assert_eq!(api(&a, "POST", "/bans", &ban).await.code(), 201);
    let key = "tollgate:control:{tollgate}:bans";
    assert_eq!(redis.cli(&["HLEN", key]).trim(), "1");
    let deadline = Instant::now() + Duration::from_secs(3);
    while redis.cli(&["HLEN", key]).trim() != "0" {
        assert!(Instant::now() < deadline, "the expired ban stays in Redis");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        json_of(&api(&a, "GET", "/bans", &Value::Null).await),
        json!({ "bans": [] })
    );
}

/// On a Redis Cluster: the entries share one hash tag, so each change is one script on one
/// slot, and a second replica reads them there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ban_on_a_redis_cluster_reaches_the_other_replica() {
    let cluster = RedisCluster::start();
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let block = format!(
        "limiter:\n  backend: redis\n  redis:\n    cluster: [{}]\n    timeout: 500ms\n",
        nodes.join(", ")
    );
    let (token, up) = (token_file(), MockUpstream::start());
    let config = yaml(&token, up.addr(), &block);
    let (a, b) = (TestProxy::start(&config), TestProxy::start(&config));
    for p in [&a, &b] {
        until_header(p, "warm-up").await;
    }
    let ban = json!({"identity": "header:X-API-Key=mallory", "ttl": "10m"});
    let deadline = Instant::now() + Duration::from_secs(10);
    // The cluster client may still be learning the slots: 503 until it has.
    let r = loop {
        let r = api(&a, "POST", "/bans", &ban).await;
        if r.code() != 503 || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(r.code(), 201, "{}", r.text());
    assert_eq!(
        json_of(&r)["identity"].as_str().unwrap().len(),
        "header:x-api-key=blake3:".len() + 12
    );
    let deadline = Instant::now() + Duration::from_secs(2);
    while json_of(&api(&b, "GET", "/bans", &Value::Null).await)["bans"] == json!([]) {
        assert!(Instant::now() < deadline, "replica B never read the ban");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// With Redis gone, a replica keeps enforcing the entries it read, and refuses changes (503)
/// rather than keep one no other replica would see.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_the_last_entries_stay_in_force() {
    let mut redis = RedisServer::start();
    let (token, up) = (token_file(), MockUpstream::start());
    let proxy = TestProxy::start(&yaml(&token, up.addr(), &redis_block(&redis.url())));
    until_header(&proxy, "warm-up").await;
    let ban = json!({"identity": "header:X-API-Key=kept", "ttl": "10m"});
    assert_eq!(api(&proxy, "POST", "/bans", &ban).await.code(), 201);
    redis.kill();
    let other = json!({"identity": "header:X-API-Key=other", "ttl": "10m"});
    let r = api(&proxy, "POST", "/bans", &other).await;
    assert_eq!(r.code(), 503, "{}", r.text());
    assert!(json_of(&r)["detail"]
        .as_str()
        .unwrap()
        .contains("not stored"));
    // Polls fail meanwhile (every 250 ms): the ban read before holds.
    let deadline = Instant::now() + Duration::from_millis(800);
    while Instant::now() < deadline {
        assert_eq!(get_key(&proxy, "/v1/x", "kept").await.code(), 403);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        json_of(&api(&proxy, "GET", "/bans", &Value::Null).await)["bans"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

/// An override raises a window limit's count for one key (`quota: N/W`, the window's own
/// length): as a quota override, it counts from zero in a state of its own (N more now), and
/// the other keys keep the limit's count.
#[tokio::test]
async fn an_override_raises_a_window_for_one_key() {
    let (token, up) = (token_file(), MockUpstream::start());
    let yaml = config(&format!(
        "admin:\n  address: 127.0.0.1:0\n  token_file: {}\n{}routes:\n  - name: api\n    upstream: app\n    limits:\n      - {{ name: hourly, window: 2/1h, algorithm: exact, key: [header:X-API-Key] }}\n",
        token.display(),
        upstream_app(up.addr(), "5s"),
    ));
    let proxy = TestProxy::start(&yaml);
    for key in ["big", "small"] {
        let codes = Http::new()
            .statuses(3, &proxy.url("/v1/x"), &[("x-api-key", key)])
            .await;
        assert_eq!(codes, [200, 200, 429], "{key}");
    }
    let wrong = json!({"limit": "hourly", "identity": "header:X-API-Key=big", "quota": "5/day", "ttl": "5m"});
    assert_eq!(api(&proxy, "POST", "/overrides", &wrong).await.code(), 400);
    // What `check` refuses in the config, the API refuses too: an exact log past 1000.
    let past =
        json!({"limit": "hourly", "identity": "0.0.0.0/0", "quota": "4294967295/1h", "ttl": "5m"});
    let r = api(&proxy, "POST", "/overrides", &past).await;
    assert_eq!(r.code(), 400);
    assert!(
        r.text().contains("at most 1000 per identity"),
        "{}",
        r.text()
    );
    let raise = json!({"limit": "hourly", "identity": "header:X-API-Key=big", "quota": "5/1h", "ttl": "5m"});
    let r = api(&proxy, "POST", "/overrides", &raise).await;
    assert_eq!(r.code(), 201, "{}", r.text());
    let big = Http::new()
        .statuses(6, &proxy.url("/v1/x"), &[("x-api-key", "big")])
        .await;
    assert_eq!(big, [200, 200, 200, 200, 200, 429], "five, from zero");
    assert_eq!(get_key(&proxy, "/v1/x", "small").await.code(), 429);
}

/// A path or host ban is written as screened requests are spelled, so it matches every
/// spelling of them; one that no screened request can carry is refused when it is made.
#[tokio::test]
async fn path_and_host_bans_match_every_spelling_or_are_refused() {
    let (token, up) = (token_file(), MockUpstream::start());
    let proxy = TestProxy::start(&yaml(&token, up.addr(), ""));
    let ban = json!({"identity": "path=/v1/./%78/", "ttl": "10m"});
    let r = api(&proxy, "POST", "/bans", &ban).await;
    assert_eq!(r.code(), 201, "{}", r.text());
    for spelling in ["/v1/x", "/v1//x", "/v1/%78", "/v1/y/../x"] {
        assert_eq!(
            get_key(&proxy, spelling, "k").await.code(),
            403,
            "{spelling}"
        );
    }
    assert_eq!(get_key(&proxy, "/v1/y", "k").await.code(), 200);
    let host = json!({"identity": "host=API.Example.com.", "ttl": "10m"});
    assert_eq!(api(&proxy, "POST", "/bans", &host).await.code(), 201);
    for spelling in ["api.example.com", "API.EXAMPLE.COM."] {
        let r = Http::new()
            .get_with(&proxy.url("/v1/y"), &[("host", spelling)])
            .await;
        assert_eq!(r.code(), 403, "{spelling}");
    }
    let never = json!({"identity": "path=/v1/a%2fb", "ttl": "10m"});
    let r = api(&proxy, "POST", "/bans", &never).await;
    assert_eq!(r.code(), 400, "{}", r.text());
    assert!(r.text().contains("never matches"), "{}", r.text());
}

/// Redis restarted without persistence forgets the bans and overrides; the replica that holds
/// them writes them back, so a replica started after the restart enforces them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_redis_forgot_are_written_back() {
    let mut redis = RedisServer::start();
    let (token, up) = (token_file(), MockUpstream::start());
    let yaml = yaml(&token, up.addr(), &redis_block(&redis.url()));
    let proxy = TestProxy::start(&yaml);
    until_header(&proxy, "warm-up").await;
    let ban = json!({"identity": "header:X-API-Key=kept", "ttl": "10m"});
    assert_eq!(api(&proxy, "POST", "/bans", &ban).await.code(), 201);
    let raise = json!({"limit": "per-key", "identity": "header:X-API-Key=vip", "rate": "9/s", "ttl": "10m"});
    assert_eq!(api(&proxy, "POST", "/overrides", &raise).await.code(), 201);
    redis.restart();
    assert!(redis.keys().is_empty(), "a restart without persistence");
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            redis.keys().iter().any(|k| k.ends_with(":bans"))
                && redis.keys().iter().any(|k| k.ends_with(":overrides"))
        })
        .await,
        "the entries are back in Redis: {:?}",
        redis.keys()
    );
    // A replica that starts now reads them from Redis, and enforces them.
    let fresh = TestProxy::start(&yaml);
    until_status(&fresh, "kept", 403, Duration::from_secs(5)).await;
    let listed = json_of(&api(&fresh, "GET", "/overrides", &Value::Null).await);
    assert_eq!(listed["overrides"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(get_key(&proxy, "/v1/x", "kept").await.code(), 403);
}

/// Every change is logged at info under `tollgate::admin`, with the ID, the identity redacted,
/// the ttl and the reason; the secret is in no log line.
#[tokio::test]
async fn changes_are_logged_without_the_secret() {
    let (token, up) = (token_file(), MockUpstream::start());
    let proxy = BinaryProxy::start(&yaml(&token, up.addr(), ""));
    let admin = proxy.admin_addr();
    let post = |path: &'static str, body: Value| async move {
        let r = api_at(admin, Some(TOKEN), "POST", path, &body.to_string()).await;
        assert_eq!(r.code(), 201, "{}", r.text());
        json_of(&r)["id"].as_str().unwrap().to_owned()
    };
    let brief = post(
        "/bans",
        json!({"identity": "cookie:sid=topsecret-1", "ttl": "1s", "reason": "INC-7"}),
    )
    .await;
    let long = post(
        "/bans",
        json!({"identity": "bearer=topsecret-2", "ttl": "1h"}),
    )
    .await;
    let raised = post("/overrides", json!({"limit": "per-key", "identity": "header:X-API-Key=topsecret-3", "rate": "9/s", "ttl": "1h", "reason": "launch"})).await;
    let banned = Http::new()
        .get_with(
            &proxy.url("/v1/x"),
            &[("authorization", "Bearer topsecret-2")],
        )
        .await;
    assert_eq!(banned.code(), 403);
    let r = api_at(admin, Some(TOKEN), "DELETE", &format!("/bans/{long}"), "").await;
    assert_eq!(r.code(), 204);
    let wait = Duration::from_secs(5);
    assert!(
        proxy.wait_for_log("status=403", wait),
        "{:#?}",
        proxy.logs()
    );
    let access = proxy
        .logs()
        .into_iter()
        .find(|l| l.contains("status=403"))
        .unwrap();
    assert!(
        access.contains("route=api") && access.contains("outcome=operator-ban"),
        "{access}"
    );
    assert!(
        proxy.wait_for_log("ban expired", wait),
        "{:#?}",
        proxy.logs()
    );
    let logs = proxy.logs();
    let line = |what: &str, id: &str| {
        logs.iter()
            .find(|l| l.contains(what) && l.contains(id))
            .unwrap_or_else(|| panic!("no `{what}` line for {id}: {logs:#?}"))
            .clone()
    };
    let created = line("ban created", &brief);
    for part in [
        "tollgate::admin",
        "identity=cookie:sid=blake3:",
        "ttl_s=1",
        "reason=\"INC-7\"",
    ] {
        assert!(created.contains(part), "{part} in {created}");
    }
    assert!(line("ban deleted", &long).contains("identity=bearer=blake3:"));
    assert!(line("ban expired", &brief).contains("INFO"));
    let o = line("override created", &raised);
    assert!(
        o.contains("limit=per-key") && o.contains("rate=\"9/s\"") && o.contains("burst=9"),
        "{o}"
    );
    assert!(
        !logs.iter().any(|l| l.contains("topsecret")),
        "a secret was logged: {logs:#?}"
    );
}

/// Until Redis decides `proxy`'s checks (its connection comes up in the background).
async fn until_header(proxy: &TestProxy, key: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while get_key(proxy, "/v1/x", key)
        .await
        .opt_header("ratelimit")
        .is_none()
    {
        assert!(Instant::now() < deadline, "Redis never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `GET /api/v1/explain` for API key `key` on `/v1/x`.
async fn explain(proxy: &TestProxy, key: &str) -> Value {
    let r = api(
        proxy,
        "GET",
        &format!("/explain?path=/v1/x&header=X-API-Key:{key}"),
        &Value::Null,
    )
    .await;
    assert_eq!(r.code(), 200, "{}", r.text());
    json_of(&r)
}

#[tokio::test]
async fn explain_shows_the_override_and_the_ban_in_force() {
    let (token, up) = (token_file(), MockUpstream::start());
    let proxy = TestProxy::start(&yaml(&token, up.addr(), ""));
    assert_eq!(
        Http::new()
            .statuses(3, &proxy.url("/v1/x"), &[("x-api-key", "big")])
            .await,
        [200, 200, 429]
    );
    let before = explain(&proxy, "big").await;
    assert_eq!(before["decision"]["outcome"], "limited", "{before}");
    assert!(before["limits"][0].get("override").is_none(), "{before}");
    let raise = json!({"limit": "per-key", "identity": "header:X-API-Key=big", "rate": "100/s", "burst": 100, "ttl": "5m", "reason": "launch"});
    let made = json_of(&api(&proxy, "POST", "/overrides", &raise).await);
    // The override's numbers judge the same bucket: emptied at 1/min, it is an empty bucket
    // of 100 at 100/s, a token away from admitting.
    let after = explain(&proxy, "big").await;
    let per_key = &after["limits"][0];
    assert_eq!(per_key["override"]["id"], made["id"], "{after}");
    assert_eq!(per_key["override"]["rate"], "100/s");
    assert_eq!(per_key["now"]["limit"], 100, "{after}");
    assert!(
        per_key["retry_after_s"].as_f64().unwrap() <= 0.011,
        "{after}"
    );
    assert!(!after.to_string().contains("=big"), "no secret: {after}");
    // Another key is judged by the limit's own numbers.
    let other = explain(&proxy, "small").await;
    assert!(other["limits"][0].get("override").is_none(), "{other}");
    assert_eq!(other["limits"][0]["now"]["limit"], 2, "{other}");
    // An operator's ban answers first: 403, with the ban and its time left.
    let ban = json!({"identity": "header:X-API-Key=big", "ttl": "10m", "reason": "abuse"});
    let banned = json_of(&api(&proxy, "POST", "/bans", &ban).await);
    let e = explain(&proxy, "big").await;
    assert_eq!(e["decision"]["outcome"], "operator_ban", "{e}");
    assert_eq!(e["decision"]["status"], 403);
    assert_eq!(e["operator_ban"]["id"], banned["id"]);
    let left = e["decision"]["retry_after_s"].as_f64().unwrap();
    assert!((590.0..=600.0).contains(&left), "{e}");
    assert_eq!(
        explain(&proxy, "small").await["decision"]["outcome"],
        "admitted"
    );
}
