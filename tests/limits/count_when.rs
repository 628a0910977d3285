//! `count_when`: limits counted by the response's status (failed logins), against a backend
//! that answers `/status/CODE` with that status: successes never limited, failures counted
//! exactly, the limit spent refusing every request of the identity (nothing sent upstream),
//! bans escalating on the refusals, tollgate's own 502s never counted; over Redis two
//! replicas counting one identity's failures together.

use crate::common;
use crate::common::redis as redis_helpers;

use common::{config, upstream_app, Http, MockUpstream, TestProxy};
use redis_helpers::RedisServer;

/// A route to `app` whose limit counts only 401 and 403 answers, per user.
fn login(app: std::net::SocketAddr, extra: &str, limit_extra: &str) -> String {
    config(&format!(
        "{extra}{}routes:\n  - name: login\n    match: {{ path_prefix: / }}\n    upstream: app\n    limits:\n      - {{ name: failed-logins, window: 5/15m, algorithm: exact, key: [\"header:x-user\"], count_when: {{ status: [401, 403] }}{limit_extra} }}\n",
        upstream_app(app, "5s")
    ))
}

#[tokio::test]
async fn only_failures_count_and_a_spent_limit_refuses_everything() {
    let app = MockUpstream::start();
    let proxy = TestProxy::start(&login(app.addr(), "", ""));
    let http = Http::new();
    let (ok, fail) = (proxy.url("/status/200"), proxy.url("/status/401"));
    let ann = [("x-user", "ann")];
    // Fifty successful logins: never limited.
    assert!(http.statuses(50, &ok, &ann).await.iter().all(|&s| s == 200));
    // Five failures reach the backend; the sixth guess does not.
    assert_eq!(
        http.statuses(6, &fail, &ann).await,
        [401, 401, 401, 401, 401, 429]
    );
    let seen = app.count();
    // Spent: even the right password is refused now, and nothing reaches the backend.
    let right = http.get_with(&ok, &ann).await;
    assert_eq!(right.code(), 429);
    assert!(
        right.header("retry-after").parse::<u64>().unwrap() > 800,
        "until the window frees"
    );
    assert_eq!(app.count(), seen, "nothing sent upstream once spent");
    // Another user is not affected; a 403 counts too, a 500 does not.
    let bob = [("x-user", "bob")];
    assert_eq!(
        http.statuses(3, &proxy.url("/status/500"), &bob).await,
        [500; 3]
    );
    assert_eq!(
        http.statuses(6, &proxy.url("/status/403"), &bob).await,
        [403, 403, 403, 403, 403, 429]
    );
}

#[tokio::test]
async fn a_ban_escalates_on_repeated_failures_and_tollgates_own_errors_never_count() {
    let app = MockUpstream::start();
    let ban = ", ban: { after: 2, within: 15m, for: 1h, max: 1d }";
    let proxy = TestProxy::start(&login(app.addr(), "", ban));
    let http = Http::new();
    let fail = proxy.url("/status/401");
    let eve = [("x-user", "eve")];
    // 5 failures, then refusals: the second refusal bans for an hour.
    let codes = http.statuses(7, &fail, &eve).await;
    assert_eq!(codes, [401, 401, 401, 401, 401, 429, 429]);
    let banned = http.get_with(&proxy.url("/status/200"), &eve).await;
    assert_eq!(banned.code(), 429);
    let retry: u64 = banned.header("retry-after").parse().unwrap();
    assert!((3500..=3600).contains(&retry), "the ban's hour: {retry}");
    // Behind an upstream that is down, tollgate's 502s are not the backend's answer.
    let down = config(&format!(
        "{}routes:\n  - name: r\n    match: {{ path_prefix: / }}\n    upstream: app\n    limits:\n      - {{ name: errors, window: 2/15m, key: [ip], count_when: {{ status: [\"5xx\"] }} }}\n",
        upstream_app(common::refused_addr(), "1s")
    ));
    let proxy = TestProxy::start(&down);
    assert_eq!(http.statuses(4, &proxy.url("/"), &[]).await, [502; 4]);
}

/// A brute-force run over Redis: 1,000 guesses from 10 identities spread over two
/// replicas on one Redis let exactly 5 failures per identity through; successful logins of
/// other users are all admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_count_failures_together_exactly() {
    let redis = RedisServer::start();
    let app = MockUpstream::start();
    let block = format!(
        "limiter:\n  backend: redis\n  on_failure: closed\n  redis: {{ url: \"{}\", timeout: 2s }}\n",
        redis.url()
    );
    let yaml = login(app.addr(), &block, "");
    let (a, b) = (TestProxy::start(&yaml), TestProxy::start(&yaml));
    let http = Http::new();
    // Until Redis answers: `closed` refuses with 503 before.
    for p in [&a, &b] {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while http
            .get_with(&p.url("/status/200"), &[("x-user", "warm")])
            .await
            .code()
            != 200
        {
            assert!(std::time::Instant::now() < deadline, "Redis never answered");
        }
    }
    let before = app.count();
    let mut refused = 0;
    for guess in 0..1000 {
        let user = format!("user-{}", guess % 10);
        let proxy = if guess % 2 == 0 { &a } else { &b };
        let code = http
            .get_with(&proxy.url("/status/401"), &[("x-user", &user)])
            .await
            .code();
        refused += usize::from(code == 429);
    }
    assert_eq!(
        app.count() - before,
        50,
        "exactly five failures per identity reached the backend"
    );
    assert_eq!(refused, 950);
    let mut ok = 0;
    for login in 0..200 {
        let user = format!("good-{}", login % 4);
        let proxy = if login % 2 == 0 { &a } else { &b };
        ok += usize::from(
            http.get_with(&proxy.url("/status/200"), &[("x-user", &user)])
                .await
                .code()
                == 200,
        );
    }
    assert_eq!(ok, 200, "successful logins are never limited");
}

/// A shadow `count_when` limit counts failures and refuses nothing; an exempt identity is
/// never counted; `explain` (from the config alone) reads the limit without charging it.
#[tokio::test]
async fn shadow_exempt_and_explain() {
    let app = MockUpstream::start();
    let yaml = config(&format!(
        "{}routes:\n  - name: login\n    match: {{ path_prefix: / }}\n    upstream: app\n    limits:\n      - {{ name: dry, window: 2/15m, key: [\"header:x-user\"], count_when: {{ status: [401] }}, shadow: true }}\n      - {{ name: real, window: 2/15m, key: [\"header:x-user\"], count_when: {{ status: [401] }}, exempt: [\"header:x-user=ops\"] }}\n",
        upstream_app(app.addr(), "5s")
    ));
    let proxy = TestProxy::start(&yaml);
    let http = Http::new();
    let fail = proxy.url("/status/401");
    // `ops` is exempt from `real`; `dry` would refuse after two but only reports.
    assert_eq!(
        http.statuses(5, &fail, &[("x-user", "ops")]).await,
        [401; 5]
    );
    assert_eq!(
        http.statuses(3, &fail, &[("x-user", "ann")]).await,
        [401, 401, 429]
    );
    // `explain` from the config alone: a fresh limit admits, and reading it charges nothing.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.yaml");
    std::fs::write(&file, &yaml).unwrap();
    for _ in 0..3 {
        let out = common::proxy::run_cli(&[
            "explain",
            "--config",
            file.to_str().unwrap(),
            "--header",
            "x-user:zed",
            "--path",
            "/status/401",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("decision: ADMITTED"), "{text}");
        assert!(text.contains("2 of 2 requests left"), "{text}");
    }
}

/// Over a Redis Cluster as over one server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_count_over_a_redis_cluster() {
    let cluster = redis_helpers::RedisCluster::start();
    let app = MockUpstream::start();
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let block = format!(
        "limiter:\n  backend: redis\n  on_failure: closed\n  redis: {{ cluster: [{}], timeout: 2s }}\n",
        nodes.join(", ")
    );
    let yaml = login(app.addr(), &block, "");
    let (a, b) = (TestProxy::start(&yaml), TestProxy::start(&yaml));
    let http = Http::new();
    for p in [&a, &b] {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while http
            .get_with(&p.url("/status/200"), &[("x-user", "warm")])
            .await
            .code()
            != 200
        {
            assert!(std::time::Instant::now() < deadline, "Redis never answered");
        }
    }
    for user in ["ann", "bob", "cyd"] {
        let mut codes = Vec::new();
        for i in 0..7 {
            let proxy = if i % 2 == 0 { &a } else { &b };
            codes.push(
                http.get_with(&proxy.url("/status/401"), &[("x-user", user)])
                    .await
                    .code(),
            );
        }
        assert_eq!(codes, [401, 401, 401, 401, 401, 429, 429], "{user}");
    }
}
