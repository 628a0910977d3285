//! The admin API end to end on real sockets: off without `admin.token_file`, the bearer token
//! checked and rotated by a reload, the plain admin endpoints still open, and
//! `/api/v1/explain` (and `tollgate explain`, against a running proxy and from the config
//! alone) showing buckets, exemptions, bans and decisions without counting anything, in
//! process and in a real redis-server.

use crate::common;

use crate::common::redis as redis_helpers;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{config, Http, Reply, TestProxy};
use redis_helpers::RedisServer;
use serde_json::Value;

/// No test here may take longer than this, whatever the proxy does.
const TEST_TIMEOUT: Duration = Duration::from_secs(20);

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test did not finish in time")
}

/// A token file in a directory of its own (kept alive by the returned handle).
fn token_file(token: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("admin-token");
    std::fs::write(&path, format!("{token}\n")).expect("write the token");
    (dir, path)
}

/// One route `api` on `/v1/` answering 200 itself, limited per API key (else per address) to
/// a burst of 5 refilling at 1/min (nothing refills within a test), `203.0.113.0/24` exempt;
/// `before` goes above `routes:`.
fn api_config(admin: &str, before: &str) -> String {
    config(&format!(
        "admin:\n  address: 127.0.0.1:0\n{admin}{before}routes:\n  - name: api\n    \
         match: {{ path_prefix: /v1/ }}\n    respond: {{ status: 200, body: \"ok\\n\" }}\n    \
         limits:\n      - name: per-key\n        rate: 1/min\n        burst: 5\n        \
         key: [\"header:X-API-Key\", ip]\n        exempt: [203.0.113.0/24]\n"
    ))
}

fn token_line(path: &Path) -> String {
    format!("  token_file: {}\n", path.display())
}

/// `GET path` on the admin listener, with `Authorization: Bearer token` when given.
async fn api(proxy: &TestProxy, path: &str, token: Option<&str>) -> Reply {
    let url = format!("http://{}{path}", proxy.admin_addr());
    let bearer = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = bearer
        .as_deref()
        .map(|b| ("authorization", b))
        .into_iter()
        .collect();
    Http::new().get_with(&url, &headers).await
}

/// The JSON of `/api/v1/explain?query`, which must answer 200.
async fn explain(proxy: &TestProxy, token: &str, query: &str) -> Value {
    let r = api(proxy, &format!("/api/v1/explain?{query}"), Some(token)).await;
    assert_eq!(r.code(), 200, "{}", r.text());
    assert_eq!(r.header("content-type"), "application/json");
    serde_json::from_str(r.text()).expect("the answer is JSON")
}

/// `n` requests of API key `key` to `/v1/items`, their statuses.
async fn send(proxy: &TestProxy, key: &str, n: usize) -> Vec<u16> {
    Http::new()
        .statuses(n, &proxy.url("/v1/items"), &[("x-api-key", key)])
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_file_the_api_is_off() {
    bounded(async {
        let proxy = TestProxy::start(&api_config("", ""));
        for path in ["/api/v1/", "/api/v1/explain?path=/v1/items"] {
            let r = api(&proxy, path, Some("anything")).await;
            assert_eq!(r.code(), 404, "{path}");
            assert_eq!(r.header("content-type"), "application/problem+json");
            assert!(r.text().contains("The admin API is off"), "{}", r.text());
            assert!(r.text().contains("admin.token_file"), "{}", r.text());
        }
        // Nothing was counted by asking.
        assert_eq!(send(&proxy, "abc", 5).await, [200; 5]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_is_required_and_a_rotated_one_replaces_it_at_once() {
    bounded(async {
        let (_dir, file) = token_file("first-token");
        let proxy = TestProxy::start(&api_config(&token_line(&file), ""));
        for token in [None, Some("wrong"), Some("first-token-and-more"), Some("")] {
            let r = api(&proxy, "/api/v1/", token).await;
            assert_eq!(r.code(), 401, "{token:?}: {}", r.text());
            assert_eq!(
                r.header("www-authenticate"),
                "Bearer realm=\"tollgate-admin\""
            );
        }
        // Another scheme carrying the token is no bearer token.
        let url = format!("http://{}/api/v1/", proxy.admin_addr());
        let basic = Http::new()
            .get_with(&url, &[("authorization", "Basic first-token")])
            .await;
        assert_eq!(basic.code(), 401);
        let index = api(&proxy, "/api/v1/", Some("first-token")).await;
        assert_eq!(index.code(), 200, "{}", index.text());
        let index: Value = serde_json::from_str(index.text()).unwrap();
        let paths: Vec<&str> = index["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["path"].as_str().unwrap())
            .collect();
        assert!(paths.contains(&"/api/v1/explain"), "{index}");
        // The plain endpoints need no token.
        for path in ["/healthz", "/readyz", "/metrics"] {
            assert_eq!(api(&proxy, path, None).await.code(), 200, "{path}");
        }
        // Rotation: rewrite the file, reload; the old token stops working at once.
        std::fs::write(&file, "second-token\n").unwrap();
        let generation = proxy.generation();
        proxy.reload();
        assert!(
            proxy
                .wait_for_generation(generation + 1, Duration::from_secs(5))
                .await,
            "the reload did not happen"
        );
        assert_eq!(
            api(&proxy, "/api/v1/", Some("first-token")).await.code(),
            401
        );
        assert_eq!(
            api(&proxy, "/api/v1/", Some("second-token")).await.code(),
            200
        );
        // An unknown endpoint says where the list is; a bad explain query says what is wrong.
        let r = api(&proxy, "/api/v1/nope", Some("second-token")).await;
        assert_eq!(r.code(), 404);
        assert!(r.text().contains("GET /api/v1/ lists them"), "{}", r.text());
        let r = api(&proxy, "/api/v1/explain?pth=/v1/", Some("second-token")).await;
        assert_eq!(r.code(), 400);
        assert!(r.text().contains("unknown parameter `pth`"), "{}", r.text());
    })
    .await;
}

/// The one limit of an explanation.
fn only_limit(e: &Value) -> &Value {
    let limits = e["limits"].as_array().expect("limits");
    assert_eq!(limits.len(), 1, "{e:#}");
    &limits[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_each_bucket_and_the_decision_without_taking_tokens() {
    bounded(async {
        let (_dir, file) = token_file("t0k3n");
        let proxy = TestProxy::start(&api_config(&token_line(&file), ""));
        let t = "t0k3n";
        assert_eq!(send(&proxy, "abc", 3).await, [200; 3]);
        let e = explain(&proxy, t, "path=/v1/items&header=X-API-Key:abc").await;
        assert_eq!(e["route"], "api");
        assert_eq!(e["decision"]["outcome"], "admitted", "{e:#}");
        let l = only_limit(&e);
        assert_eq!(l["name"], "per-key");
        assert_eq!(l["kind"]["type"], "token_bucket");
        assert_eq!(l["kind"]["burst"], 5);
        assert_eq!(l["now"]["remaining"], 2, "{l:#}");
        assert_eq!(l["now"]["limit"], 5);
        assert_eq!(l["now"]["store"], "local");
        assert_eq!(l["outcome"], "admitted");
        assert_eq!(l["identity"]["alternative"], 0);
        assert_eq!(l["identity"]["source"], "header:x-api-key");
        let client = l["identity"]["client"].as_str().unwrap();
        assert_eq!(client.len(), 16);
        assert!(
            !e.to_string().contains("abc\""),
            "the raw key is not repeated: {e}"
        );
        // Explaining takes nothing: ten explanations later a request is still admitted, with
        // the remaining count it would have had.
        for _ in 0..10 {
            explain(&proxy, t, "path=/v1/items&header=X-API-Key:abc").await;
        }
        let r = Http::new()
            .get_with(&proxy.url("/v1/items"), &[("x-api-key", "abc")])
            .await;
        assert_eq!(r.code(), 200);
        assert_eq!(r.header("x-ratelimit-remaining"), "1");
        // Exhausted: limited by per-key, with the wait for one token (1/min: about 60 s).
        assert_eq!(send(&proxy, "abc", 2).await, [200, 429]);
        let e = explain(&proxy, t, "path=/v1/items&header=X-API-Key:abc").await;
        assert_eq!(e["decision"]["outcome"], "limited", "{e:#}");
        assert_eq!(e["decision"]["limit"], "per-key");
        assert_eq!(e["decision"]["status"], 429);
        let retry = e["decision"]["retry_after_s"].as_f64().unwrap();
        assert!(retry > 50.0 && retry <= 60.0, "{retry}");
        assert!(e["decision"].get("grpc_status").is_none(), "{e:#}");
        // A gRPC call would get its status in gRPC's form: RESOURCE_EXHAUSTED.
        let grpc =
            "method=POST&path=/v1/items&header=X-API-Key:abc&header=Content-Type:application/grpc";
        let e = explain(&proxy, t, grpc).await;
        assert_eq!(e["decision"]["grpc_status"], 8, "{e:#}");
        let l = only_limit(&e);
        assert_eq!(
            (l["outcome"].as_str(), l["now"]["remaining"].as_u64()),
            (Some("limited"), Some(0))
        );
        // Another key: a full bucket of its own, not yet made.
        let e = explain(&proxy, t, "path=/v1/items&header=X-API-Key:other").await;
        let l = only_limit(&e);
        assert_eq!(l["now"]["remaining"], 5);
        assert_eq!(l["now"]["counted_in"], "new");
        assert_ne!(l["identity"]["client"], client);
        // No key: the address is the identity (the key's second alternative).
        let e = explain(&proxy, t, "path=/v1/items&ip=198.51.100.7").await;
        assert_eq!(only_limit(&e)["identity"]["source"], "ip");
        assert_eq!(only_limit(&e)["identity"]["alternative"], 1);
        // An exempt address: exempt, by which entry.
        let e = explain(
            &proxy,
            t,
            "path=/v1/items&header=X-API-Key:abc&ip=203.0.113.9",
        )
        .await;
        assert_eq!(e["decision"]["outcome"], "exempt", "{e:#}");
        let l = only_limit(&e);
        assert_eq!(l["outcome"], "exempt");
        assert_eq!(l["exempt"]["entry"], "203.0.113.0/24");
        assert!(l.get("identity").is_none(), "{l:#}");
        // No route: said, and nothing listed.
        let e = explain(&proxy, t, "path=/elsewhere&header=X-API-Key:abc").await;
        assert_eq!(e["route"], Value::Null);
        assert_eq!(e["decision"]["outcome"], "no_route");
        assert_eq!(e["decision"]["status"], 404);
        assert_eq!(e["limits"], Value::Array(vec![]));
        // Screening applies first: the path is normalised, and an encoded `/` (here `%2F`,
        // escaped once more for the query) is refused.
        let e = explain(&proxy, t, "path=/v1//./items&header=X-API-Key:other").await;
        assert_eq!(e["request"]["path"], "/v1/items", "{e:#}");
        assert_eq!(e["route"], "api");
        let e = explain(&proxy, t, "path=/v1/a%252Fb").await;
        assert_eq!(e["decision"]["outcome"], "refused", "{e:#}");
        assert_eq!(e["decision"]["status"], 400);
        // The clients' buckets are where the requests left them.
        assert_eq!(send(&proxy, "abc", 1).await, [429]);
        assert_eq!(send(&proxy, "other", 1).await, [200]);
    })
    .await;
}

/// `tollgate explain ARGS` run to completion: its exit success and stdout (stderr on failure;
/// a success writes nothing there).
fn run_explain(args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN)
        .arg("explain")
        .args(args)
        .env_remove("TOLLGATE_CONFIG")
        .stdin(Stdio::null())
        .output()
        .expect("run the tollgate binary");
    // Its report is all it prints: no proxy log lines around it.
    assert!(
        !out.status.success() || out.stderr.is_empty(),
        "explain wrote to stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = if out.status.success() {
        &out.stdout
    } else {
        &out.stderr
    };
    (
        out.status.success(),
        String::from_utf8_lossy(text).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_explain_command_asks_a_running_proxy_or_reads_the_config() {
    bounded(async {
        let (dir, file) = token_file("cli-token");
        let proxy = TestProxy::start(&api_config(&token_line(&file), ""));
        assert_eq!(send(&proxy, "abc", 3).await, [200; 3]);
        let admin = format!("http://{}", proxy.admin_addr());
        let file_arg = file.to_str().unwrap();
        let asked = [
            "--admin",
            &admin,
            "--token-file",
            file_arg,
            "--path",
            "/v1/items",
            "--header",
            "X-API-Key:abc",
        ];
        let (ok, text) = tokio::task::block_in_place(|| run_explain(&asked));
        assert!(ok, "{text}");
        assert!(text.starts_with("the running proxy"), "{text}");
        assert!(text.contains("route:    api"), "{text}");
        assert!(text.contains("decision: ADMITTED"), "{text}");
        assert!(
            text.contains("2 of 5 tokens left (local, own bucket)"),
            "{text}"
        );
        let mut json = asked.to_vec();
        json.push("--json");
        let (ok, raw) = tokio::task::block_in_place(|| run_explain(&json));
        assert!(ok, "{raw}");
        let e: Value = serde_json::from_str(&raw).expect("--json prints the answer");
        assert_eq!(only_limit(&e)["now"]["remaining"], 2);
        // A wrong token: the command fails and says why.
        let wrong = dir.path().join("wrong");
        std::fs::write(&wrong, "nope").unwrap();
        let mut bad = asked.to_vec();
        bad[3] = wrong.to_str().unwrap();
        let (ok, err) = tokio::task::block_in_place(|| run_explain(&bad));
        assert!(!ok);
        assert!(err.contains("401"), "{err}");
        // From the config alone: fresh buckets, and it says so.
        let config = proxy.config_path().to_str().unwrap().to_owned();
        let alone = [
            "--config",
            &config,
            "--path",
            "/v1/items",
            "--header",
            "X-API-Key:abc",
        ];
        let (ok, text) = tokio::task::block_in_place(|| run_explain(&alone));
        assert!(ok, "{text}");
        assert!(text.starts_with("from the config alone"), "{text}");
        assert!(text.contains("buckets are full"), "{text}");
        assert!(
            text.contains("5 of 5 tokens left (local, new bucket)"),
            "{text}"
        );
        let (ok, text) = tokio::task::block_in_place(|| {
            run_explain(&["--config", &config, "--path", "/x", "--ip", "203.0.113.9"])
        });
        assert!(ok && text.contains("decision: NO ROUTE"), "{text}");
        // The proxy's bucket was not touched by any of it.
        assert_eq!(send(&proxy, "abc", 3).await, [200, 200, 429]);
    })
    .await;
}

/// Send `key`'s requests until Redis answers (its connections open in the background).
async fn until_redis_answers(proxy: &TestProxy) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while send(proxy, "warm-up", 1).await == [503] {
        assert!(Instant::now() < deadline, "Redis never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_reads_the_redis_bucket_and_ban_without_writing() {
    bounded(async {
        let redis = RedisServer::start();
        let (_dir, file) = token_file("redis-token");
        let limiter = format!(
            "limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    url: \"{}\"\n",
            redis.url()
        );
        let yaml = api_config(&token_line(&file), &limiter).replace(
            "exempt: [203.0.113.0/24]\n",
            "exempt: [203.0.113.0/24]\n        ban: { after: 2, within: 10s, for: 30s, max: 60s }\n",
        );
        let proxy = TestProxy::start(&yaml);
        until_redis_answers(&proxy).await;
        let t = "redis-token";
        let q = "path=/v1/items&header=X-API-Key:abc";
        assert_eq!(send(&proxy, "abc", 3).await, [200; 3]);
        let e = explain(&proxy, t, q).await;
        assert_eq!(e["backend"], "redis");
        let l = only_limit(&e);
        assert_eq!(l["now"]["store"], "redis", "{l:#}");
        assert_eq!(l["now"]["remaining"], 2, "{l:#}");
        assert_eq!(l["now"]["counted_in"], "own");
        assert_eq!(l["outcome"], "admitted");
        // The bucket's key holds the digest the explanation shows; asking writes nothing.
        let client = l["identity"]["client"].as_str().unwrap();
        let keys = redis.keys();
        let bucket = keys
            .iter()
            .find(|k| k.contains(client) && !k.ends_with(":ban"))
            .unwrap_or_else(|| panic!("no key of {client} in {keys:?}"));
        let tat = redis.cli(&["GET", bucket]);
        let ttl: i64 = redis.cli(&["PTTL", bucket]).trim().parse().unwrap();
        for _ in 0..5 {
            explain(&proxy, t, q).await;
        }
        assert_eq!(redis.cli(&["GET", bucket]), tat);
        let later: i64 = redis.cli(&["PTTL", bucket]).trim().parse().unwrap();
        assert!(later <= ttl, "the expiry was not pushed out: {ttl} -> {later}");
        assert_eq!(redis.keys().len(), keys.len(), "{:?}", redis.keys());
        // Two rejections ban the key for 30 s: explain says banned, limited, and for how long.
        assert_eq!(send(&proxy, "abc", 4).await, [200, 200, 429, 429]);
        let e = explain(&proxy, t, q).await;
        assert_eq!(e["decision"]["outcome"], "limited", "{e:#}");
        assert!(e["decision"]["reason"].as_str().unwrap().contains("banned"), "{e:#}");
        let l = only_limit(&e);
        assert_eq!(l["outcome"], "banned");
        let banned = l["ban_state"]["banned_s"].as_f64().unwrap();
        assert!(banned > 25.0 && banned <= 30.0, "{l:#}");
        assert_eq!(l["ban_state"]["level"], 1);
        // Another key: no bucket in Redis yet, a full one.
        let e = explain(&proxy, t, "path=/v1/items&header=X-API-Key:fresh").await;
        let l = only_limit(&e);
        assert_eq!((l["now"]["remaining"].as_u64(), l["now"]["counted_in"].as_str()), (Some(5), Some("new")));
        assert!(l.get("ban_state").is_none(), "{l:#}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_reads_cookies_bearer_tokens_and_quotas() {
    bounded(async {
        let (_dir, file) = token_file("q");
        let yaml = api_config(&token_line(&file), "").replace(
            "rate: 1/min\n        burst: 5\n        key: [\"header:X-API-Key\", ip]\n",
            "quota: 3/day\n        key: [\"cookie:sid\", bearer, ip]\n",
        );
        let proxy = TestProxy::start(&yaml);
        let r = Http::new()
            .get_with(&proxy.url("/v1/items"), &[("cookie", "theme=dark; sid=s1")])
            .await;
        assert_eq!(r.code(), 200);
        let e = explain(&proxy, "q", "path=/v1/items&header=Cookie:sid=s1").await;
        let l = only_limit(&e);
        assert_eq!(l["kind"]["type"], "quota", "{l:#}");
        assert_eq!(l["kind"]["count"], 3);
        assert_eq!(l["kind"]["period"], "day");
        assert_eq!(l["identity"]["source"], "cookie:sid");
        assert_eq!(
            (l["now"]["remaining"].as_u64(), l["now"]["limit"].as_u64()),
            (Some(2), Some(3))
        );
        let reset = l["now"]["reset_s"].as_f64().unwrap();
        assert!(
            reset > 0.0 && reset <= 86_400.0,
            "the window's end: {reset}"
        );
        let e = explain(
            &proxy,
            "q",
            "path=/v1/items&header=Authorization:Bearer%20tok",
        )
        .await;
        assert_eq!(only_limit(&e)["identity"]["source"], "bearer");
        assert_eq!(only_limit(&e)["identity"]["alternative"], 1);
        assert_eq!(only_limit(&e)["now"]["remaining"], 3);
        let e = explain(&proxy, "q", "path=/v1/items").await;
        assert_eq!(only_limit(&e)["identity"]["alternative"], 2);
    })
    .await;
}

/// A backend that reads each request's head and answers once `release` has a permit for it.
async fn holding_backend() -> (std::net::SocketAddr, std::sync::Arc<tokio::sync::Semaphore>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let release = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let gate = release.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let gate = gate.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                if let Ok(permit) = gate.acquire().await {
                    permit.forget();
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
            });
        }
    });
    (addr, release)
}

/// Poll explain until its one limit shows `in_flight` requests in flight.
async fn until_in_flight(proxy: &TestProxy, token: &str, in_flight: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let e = explain(proxy, token, "path=/v1/hold").await;
        if only_limit(&e)["now"]["in_flight"].as_u64() == Some(in_flight) {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "never {in_flight} in flight: {e:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Two requests held in flight against `concurrency: 2`: explain shows the slots taken and
/// the decision, in process and (with `limiter`) in Redis, and holds no slot itself.
async fn slots_explained(limiter: &str, store: &str) {
    let (backend, release) = holding_backend().await;
    let (_dir, file) = token_file("c");
    let yaml = config(&format!(
        "admin:\n  address: 127.0.0.1:0\n{}{limiter}{}routes:\n  - name: held\n    \
         match: {{ path_prefix: /v1/ }}\n    upstream: app\n    limits:\n      \
         - {{ name: slots, concurrency: 2, key: [ip] }}\n",
        token_line(&file),
        common::upstream_app(backend, "30s"),
    ));
    let proxy = TestProxy::start(&yaml);
    let e = until_in_flight(&proxy, "c", 0).await;
    let l = only_limit(&e);
    assert_eq!(l["kind"]["type"], "concurrency", "{l:#}");
    assert_eq!(l["now"]["store"], store, "{l:#}");
    assert_eq!(l["now"]["remaining"], 2);
    let url = proxy.url("/v1/hold");
    let held: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { Http::new().get(&url).await.code() })
        })
        .collect();
    let e = until_in_flight(&proxy, "c", 2).await;
    assert_eq!(e["decision"]["outcome"], "limited", "{e:#}");
    assert_eq!(e["decision"]["retry_after_s"], 1.0);
    assert!(
        e["decision"]["reason"].as_str().unwrap().contains("slot"),
        "{e:#}"
    );
    assert_eq!(only_limit(&e)["now"]["remaining"], 0);
    release.add_permits(2);
    for h in held {
        assert_eq!(h.await.unwrap(), 200);
    }
    let e = until_in_flight(&proxy, "c", 0).await;
    assert_eq!(e["decision"]["outcome"], "admitted", "{e:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_requests_in_flight_in_process() {
    bounded(slots_explained("", "local")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_requests_in_flight_in_redis() {
    let redis = RedisServer::start();
    let limiter = format!(
        "limiter:\n  backend: redis\n  redis:\n    url: \"{}\"\n",
        redis.url()
    );
    bounded(slots_explained(&limiter, "redis")).await;
}

/// `explain` states a leased limit's lease size, hold and the fleet's bound, from the config
/// alone (Redis is not asked); a `hold` without `tokens` sizes leases as `auto`.
#[test]
fn explain_states_a_leased_limits_bound() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("lease.yaml");
    std::fs::write(
        &path,
        "listeners: [{ address: 127.0.0.1:0 }]\nlimiter: { backend: redis, redis: { url: \"redis://127.0.0.1:1\" } }\nroutes:\n  - name: r\n    respond: { status: 200 }\n    limits:\n      - { name: hot, rate: 100/s, burst: 400, key: [ip], leasing: { tokens: 30, hold: 2s } }\n      - { name: thin, rate: 100/s, burst: 400, key: [ip], leasing: { hold: 3s } }\n",
    )
    .expect("write the config");
    let (ok, text) = run_explain(&["-c", path.to_str().expect("a UTF-8 path")]);
    assert!(ok, "{text}");
    assert!(
        text.contains(
            "  leasing:  leases of at most 30 tokens, held 2 s: R replicas admit at most 400 + 100/s x t + R x 30 in any interval t"
        ),
        "{text}"
    );
    // Without `tokens`, leases are sized as `auto`'s: min(1024, 400 / 4, 100/s x 3 s).
    assert!(
        text.contains(
            "  leasing:  auto, leases of at most 100 tokens, held 3 s: R replicas admit at most 400 + 100/s x t + R x 100 in any interval t"
        ),
        "{text}"
    );
}
