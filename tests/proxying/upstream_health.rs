//! Upstream health and retries, with real sockets: a dead target's requests go to another,
//! a target that fails requests is ejected and one that fails its health check gets no traffic
//! until it passes again, every target dead is a quick 502 and never "ejected forever",
//! idempotent requests (only those) are retried after a failure status, and least_request
//! keeps requests off a slow target; ejection, checks and retries over HTTP/2 (h2c) upstreams
//! as over HTTP/1.1, and a target that does not speak HTTP/2 a clear 502.

use crate::common;

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::client::{request, upload};
use common::{config, refused_addr, Http, MockUpstream, TestProxy};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::oneshot;

const WAIT: Duration = Duration::from_secs(10);

/// A backend the test steers: whether `/healthz` passes, the status and delay of every other
/// answer, and how many requests of each kind reached it.
struct Backend {
    addr: SocketAddr,
    state: Arc<BackendState>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct BackendState {
    healthy: AtomicBool,
    status: AtomicU16,
    delay_ms: AtomicU64,
    /// Requests other than health checks, by method.
    gets: AtomicUsize,
    posts: AtomicUsize,
    checks: AtomicUsize,
}

impl Backend {
    /// Healthy, answering `200` at once, on a free port.
    fn start() -> Self {
        Self::at("127.0.0.1:0".parse().expect("an address"))
    }

    /// The same, on `addr` (a port that refused connections until now).
    fn at(addr: SocketAddr) -> Self {
        let listener = StdListener::bind(addr).expect("bind the backend");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(BackendState {
            healthy: AtomicBool::new(true),
            status: AtomicU16::new(200),
            delay_ms: AtomicU64::new(0),
            gets: AtomicUsize::new(0),
            posts: AtomicUsize::new(0),
            checks: AtomicUsize::new(0),
        });
        let (stop, stopped) = oneshot::channel();
        let shared = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("backend runtime");
            rt.block_on(serve(listener, shared, stopped));
        });
        Self {
            addr,
            state,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn set_healthy(&self, healthy: bool) {
        self.state.healthy.store(healthy, Ordering::SeqCst);
    }

    fn answer(&self, status: u16) {
        self.state.status.store(status, Ordering::SeqCst);
    }

    fn delay(&self, ms: u64) {
        self.state.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Requests other than health checks.
    fn served(&self) -> usize {
        self.gets() + self.posts()
    }

    fn gets(&self) -> usize {
        self.state.gets.load(Ordering::SeqCst)
    }

    fn posts(&self) -> usize {
        self.state.posts.load(Ordering::SeqCst)
    }

    fn checks(&self) -> usize {
        self.state.checks.load(Ordering::SeqCst)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(
    listener: StdListener,
    state: Arc<BackendState>,
    mut stopped: oneshot::Receiver<()>,
) {
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        let state = state.clone();
        let service = service_fn(move |req| answer(req, state.clone()));
        // HTTP/1.1, or HTTP/2 by prior knowledge (h2c), as the client speaks.
        tokio::spawn(async move {
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer(
    req: Request<Incoming>,
    state: Arc<BackendState>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let _ = body.collect().await;
    let status = if parts.uri.path() == "/healthz" {
        state.checks.fetch_add(1, Ordering::SeqCst);
        if state.healthy.load(Ordering::SeqCst) {
            200
        } else {
            500
        }
    } else {
        let counter = if parts.method == Method::POST {
            &state.posts
        } else {
            &state.gets
        };
        counter.fetch_add(1, Ordering::SeqCst);
        let delay = state.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        state.status.load(Ordering::SeqCst)
    };
    let mut res = Response::new(Full::new(Bytes::from_static(b"backend\n")));
    *res.status_mut() = StatusCode::from_u16(status).expect("a status");
    Ok(res)
}

/// A proxy with an admin listener and one route to upstream `app`, whose body is `upstream`
/// (indented under `app:`).
fn proxy(upstream: &str, route_extra: &str) -> TestProxy {
    TestProxy::start(&config(&format!(
        "admin:
  address: 127.0.0.1:0
upstreams:
  app:
    connect_timeout: 1s
    timeout: 2s
{upstream}routes:
  - name: app
    upstream: app
{route_extra}"
    )))
}

async fn metrics(proxy: &TestProxy) -> String {
    let url = format!("http://{}/metrics", proxy.admin_addr());
    Http::new().get(&url).await.text().to_owned()
}

/// The value of the series `name{labels}` in `text`, if it is there.
fn value(text: &str, name: &str, labels: &str) -> Option<f64> {
    common::find_sample(text, &format!("{name}{{{labels}}}"))
}

fn target(upstream: &str, target: SocketAddr) -> String {
    format!("upstream=\"{upstream}\",target=\"{target}\"")
}

async fn healthy(proxy: &TestProxy, at: SocketAddr) -> Option<f64> {
    value(
        &metrics(proxy).await,
        "tollgate_upstream_target_healthy",
        &target("app", at),
    )
}

/// Poll `proxy`'s metrics until target `at` shows `healthy`; false after `WAIT`.
async fn wait_healthy(proxy: &TestProxy, at: SocketAddr, want: f64) -> bool {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if healthy(proxy, at).await == Some(want) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test]
async fn requests_to_a_dead_target_go_to_another_one_bodies_and_all() {
    let up = MockUpstream::start();
    let dead = refused_addr();
    // Passive checks off: the dead target keeps its share, and each of those is retried.
    let proxy = proxy(
        &format!(
            "    targets: [{dead}, {}]\n    health: {{ max_fails: 0 }}\n",
            up.addr()
        ),
        "",
    );
    let http = Http::new();
    for _ in 0..5 {
        assert_eq!(http.get(&proxy.url("/x")).await.code(), 200);
        let posted = http.send(upload(&proxy.url("/upload"), 100_000)).await;
        assert_eq!((posted.code(), posted.text()), (200, "100000"));
    }
    assert_eq!(up.count(), 10, "each request reached the live target once");
    let text = metrics(&proxy).await;
    let retries = value(
        &text,
        "tollgate_upstream_retries_total",
        "upstream=\"app\",reason=\"unreached\"",
    );
    assert!(
        retries >= Some(5.0),
        "half the requests met the dead target first: {text}"
    );
}

#[tokio::test]
async fn a_dead_target_is_ejected_after_max_fails() {
    dead_target_ejected("").await;
}

/// The same, and the next tests, with an HTTP/2 upstream (`protocol: h2c`).
#[tokio::test]
async fn over_h2c_a_dead_target_is_ejected_after_max_fails() {
    dead_target_ejected(H2C).await;
}

const H2C: &str = "    protocol: h2c\n";

async fn dead_target_ejected(protocol: &str) {
    let up = if protocol.is_empty() {
        MockUpstream::start()
    } else {
        MockUpstream::h2c()
    };
    let dead = refused_addr();
    let proxy = proxy(
        &format!(
            "    targets: [{dead}, {}]\n    health: {{ max_fails: 2 }}\n{protocol}",
            up.addr()
        ),
        "",
    );
    let http = Http::new();
    let statuses = http.statuses(20, &proxy.url("/x"), &[]).await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    let text = metrics(&proxy).await;
    let of = |name, at| value(&text, name, &target("app", at));
    assert_eq!(
        of("tollgate_upstream_target_healthy", dead),
        Some(0.0),
        "{text}"
    );
    assert_eq!(of("tollgate_upstream_target_healthy", up.addr()), Some(1.0));
    assert!(of("tollgate_upstream_ejections_total", dead) >= Some(1.0));
    assert_eq!(
        of("tollgate_upstream_ejections_total", up.addr()),
        Some(0.0)
    );
    let retries = value(
        &text,
        "tollgate_upstream_retries_total",
        "upstream=\"app\",reason=\"unreached\"",
    )
    .expect("the retries series");
    assert!(
        (1.0..=2.0).contains(&retries),
        "ejected after 2 failures, then left alone: {retries} retries"
    );
    let version = up.last().version;
    let want = if protocol.is_empty() {
        http::Version::HTTP_11
    } else {
        http::Version::HTTP_2
    };
    assert_eq!(version, want);
}

#[tokio::test]
async fn a_target_failing_its_health_check_gets_no_traffic_until_it_passes() {
    health_check_gates_traffic("").await;
}

#[tokio::test]
async fn over_h2c_a_target_failing_its_health_check_gets_no_traffic_until_it_passes() {
    health_check_gates_traffic(H2C).await;
}

async fn health_check_gates_traffic(protocol: &str) {
    let (good, sick) = (Backend::start(), Backend::start());
    sick.set_healthy(false);
    let proxy = proxy(
        &format!(
            "    targets: [{}, {}]
    health:
      max_fails: 0
      check: {{ path: /healthz, interval: 200ms, timeout: 200ms, healthy_threshold: 2, unhealthy_threshold: 2 }}
{protocol}",
            good.addr, sick.addr
        ),
        "",
    );
    assert!(wait_healthy(&proxy, sick.addr, 0.0).await, "checked out");
    let before = sick.served();
    let http = Http::new();
    let statuses = http.statuses(20, &proxy.url("/x"), &[]).await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    assert_eq!(
        sick.served(),
        before,
        "no traffic to a target that fails its check"
    );
    assert_eq!(good.served(), 20);

    sick.set_healthy(true);
    assert!(
        wait_healthy(&proxy, sick.addr, 1.0).await,
        "checked back in"
    );
    let statuses = http.statuses(20, &proxy.url("/x"), &[]).await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    assert!(sick.served() >= 5, "back in rotation: {}", sick.served());
    assert!(
        sick.checks() >= 4 && good.checks() >= 4,
        "both were checked"
    );
}

#[tokio::test]
async fn every_target_dead_is_a_quick_502_and_none_is_ejected_forever() {
    let (a, b) = (refused_addr(), refused_addr());
    let proxy = proxy(
        &format!(
            "    targets: [{a}, {b}]
    health: {{ max_fails: 1, fail_timeout: 200ms, max_ejection: 400ms }}
"
        ),
        "",
    );
    let http = Http::new();
    for _ in 0..10 {
        let started = Instant::now();
        assert_eq!(http.get(&proxy.url("/x")).await.code(), 502);
        assert!(started.elapsed() < Duration::from_secs(2), "no hang");
    }
    let text = metrics(&proxy).await;
    for at in [a, b] {
        let ejections = value(
            &text,
            "tollgate_upstream_ejections_total",
            &target("app", at),
        );
        assert!(ejections >= Some(1.0), "{text}");
    }
    // One target comes back: ejections end by time, so it gets traffic again.
    let back = Backend::at(a);
    let deadline = Instant::now() + WAIT;
    while http.get(&proxy.url("/x")).await.code() != 200 {
        assert!(
            Instant::now() < deadline,
            "the target that came back never got traffic"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        wait_healthy(&proxy, a, 1.0).await,
        "and counts as healthy again"
    );
    assert!(back.served() >= 1);
}

#[tokio::test]
async fn an_idempotent_request_is_retried_after_a_failure_status_and_a_post_never() {
    idempotent_retried("").await;
}

#[tokio::test]
async fn over_h2c_an_idempotent_request_is_retried_after_a_failure_status_and_a_post_never() {
    idempotent_retried(H2C).await;
}

async fn idempotent_retried(protocol: &str) {
    let (failing, good) = (Backend::start(), Backend::start());
    failing.answer(503);
    let proxy = proxy(
        &format!(
            "    targets: [{}, {}]
    health: {{ max_fails: 0, failure_statuses: [503] }}
{protocol}",
            failing.addr, good.addr
        ),
        "    retry_idempotent: true\n",
    );
    let http = Http::new();
    let statuses = http.statuses(10, &proxy.url("/x"), &[]).await;
    assert_eq!(statuses, [200; 10], "every GET that met the 503 went on");
    assert!(failing.gets() >= 5, "half of them met it first");
    assert_eq!(good.gets(), 10);

    let mut posts = Vec::new();
    for _ in 0..10 {
        // Without a body: it could be sent again, but its method says it must not be.
        posts.push(
            http.send(request("POST", &proxy.url("/x"), &[]))
                .await
                .code(),
        );
    }
    let refused = posts.iter().filter(|&&s| s == 503).count();
    assert!(refused >= 5, "the failure status is the answer: {posts:?}");
    assert_eq!(failing.posts(), refused, "{posts:?}");
    assert_eq!(good.posts(), 10 - refused, "no POST was sent twice");
    let text = metrics(&proxy).await;
    let retried = value(
        &text,
        "tollgate_upstream_retries_total",
        "upstream=\"app\",reason=\"idempotent\"",
    );
    assert_eq!(retried, Some(failing.gets() as f64), "{text}");
}

#[tokio::test]
async fn without_retry_idempotent_a_failure_status_is_the_answer() {
    let (failing, good) = (Backend::start(), Backend::start());
    failing.answer(503);
    let proxy = proxy(
        &format!(
            "    targets: [{}, {}]
    health: {{ max_fails: 0, failure_statuses: [503] }}
",
            failing.addr, good.addr
        ),
        "",
    );
    let statuses = Http::new().statuses(10, &proxy.url("/x"), &[]).await;
    assert_eq!(
        statuses.iter().filter(|&&s| s == 503).count(),
        5,
        "{statuses:?}"
    );
    assert_eq!(failing.gets() + good.gets(), 10, "each sent once");
}

#[tokio::test]
async fn least_request_keeps_requests_off_a_slow_target() {
    let (slow, fast) = (Backend::start(), Backend::start());
    slow.delay(300);
    let proxy = proxy(
        &format!(
            "    targets: [{}, {}]\n    load_balancing: least_request\n",
            slow.addr, fast.addr
        ),
        "",
    );
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (http, url) = (Http::new(), proxy.url("/x"));
            tokio::spawn(async move { http.statuses(10, &url, &[]).await })
        })
        .collect();
    for c in clients {
        let statuses = c.await.expect("a client");
        assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    }
    assert_eq!(slow.served() + fast.served(), 80);
    // Round robin would send it 40. Each request on the slow target counts against it for
    // 300 ms, in which the fast one serves many.
    assert!(
        slow.served() <= 20,
        "slow served {}, fast {}",
        slow.served(),
        fast.served()
    );
    let text = metrics(&proxy).await;
    let in_flight = value(
        &text,
        "tollgate_upstream_target_requests_in_flight",
        &target("app", slow.addr),
    );
    assert_eq!(in_flight, Some(0.0), "every request left: {text}");
}

#[test]
fn health_keys_are_validated_with_their_paths() {
    let yaml = config(
        "upstreams:
  app:
    targets: [127.0.0.1:1, 127.0.0.1:2]
    load_balancing: random
    retries: 11
    health:
      fail_timeout: 0s
      max_ejection: 1s
      failure_statuses: [200, 503]
      check: { path: healthz, interval: 1s, timeout: 2s, healthy_threshold: 0 }
routes:
  - name: app
    upstream: app
",
    );
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("health.yaml");
    std::fs::write(&path, yaml).expect("write the config");
    let out = common::check(path.to_str().expect("a UTF-8 path"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for line in [
        ":6:21: upstreams.app.load_balancing: `random` is not a load-balancing policy (round_robin or least_request)",
        ":7:14: upstreams.app.retries: must be at most 10",
        ":9:21: upstreams.app.health.fail_timeout: must be longer than zero",
        ":11:26: upstreams.app.health.failure_statuses[0]: `200` is not an error status (400-599)",
        ":12:22: upstreams.app.health.check.path: `healthz` must start with `/`",
        ":12:54: upstreams.app.health.check.timeout: must not be longer than `interval` (checks would overlap)",
        ":12:77: upstreams.app.health.check.healthy_threshold: must be at least 1",
    ] {
        assert!(stderr.contains(line), "missing `{line}` in:\n{stderr}");
    }
    assert_eq!(stderr.lines().count(), 8, "7 problems:\n{stderr}");
}

#[tokio::test]
async fn an_upstream_replaced_by_a_reload_stops_checking() {
    let (old, new) = (Backend::start(), Backend::start());
    let yaml = |targets: String| {
        config(&format!(
            "upstreams:
  app:
    targets: [{targets}]
    health:
      check: {{ path: /healthz, interval: 20ms, timeout: 20ms }}
routes:
  - name: app
    upstream: app
"
        ))
    };
    let proxy = TestProxy::start(&yaml(format!("{}, {}", old.addr, new.addr)));
    let deadline = Instant::now() + WAIT;
    while old.checks() < 3 {
        assert!(Instant::now() < deadline, "the checker runs");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    std::fs::write(proxy.config_path(), yaml(new.addr.to_string())).expect("rewrite the config");
    proxy.reload();
    assert!(proxy.wait_for_generation(2, WAIT).await, "reloaded");
    // A check in flight at the swap may still land.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let settled = old.checks();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        old.checks(),
        settled,
        "the old upstream's checker stopped with it"
    );
    let checked = new.checks();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(new.checks() > checked, "the new one's runs");
}

/// `protocol: h2c` to a target that speaks only HTTP/1.1: a 502 at once, never a hang.
#[tokio::test]
async fn an_h2c_upstream_that_speaks_only_http1_is_a_502() {
    let up = MockUpstream::start();
    let proxy = proxy(&format!("    targets: [{}]\n{H2C}", up.addr()), "");
    let started = Instant::now();
    assert_eq!(Http::new().get(&proxy.url("/x")).await.code(), 502);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(up.count(), 0, "nothing reached it as a request");
}
