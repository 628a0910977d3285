//! An upstream's capacity with real sockets: at most `max_in_flight` requests reach the
//! backend, the rest wait in the queue (fair across identities, by priority) or get `503`
//! with `Retry-After` when it is full or their wait too long, and a client that leaves its
//! queued request takes it out of the queue.

use crate::common;

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{config, find_sample, sample, Http, TestProxy};
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::sync::{oneshot, Semaphore};

const WAIT: Duration = Duration::from_secs(10);

/// A backend that holds every request until the test lets one go (`release`), and counts
/// the requests inside it at once.
struct Held {
    addr: SocketAddr,
    state: Arc<HeldState>,
    stop: Option<oneshot::Sender<()>>,
}

struct HeldState {
    active: AtomicUsize,
    max_active: AtomicUsize,
    /// `X-Client` of each request, in arrival order.
    arrived: Mutex<Vec<String>>,
    permits: Semaphore,
}

impl Held {
    fn start() -> Self {
        let listener = StdListener::bind("127.0.0.1:0").expect("bind the backend");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(HeldState {
            active: AtomicUsize::new(0),
            max_active: AtomicUsize::new(0),
            arrived: Mutex::new(Vec::new()),
            permits: Semaphore::new(0),
        });
        let (stop, mut stopped) = oneshot::channel::<()>();
        let shared = state.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("backend runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                loop {
                    let stream = tokio::select! {
                        _ = &mut stopped => return,
                        accepted = listener.accept() => match accepted {
                            Ok((stream, _)) => stream,
                            Err(_) => continue,
                        },
                    };
                    let state = shared.clone();
                    let service = service_fn(move |req| hold(req, state.clone()));
                    tokio::spawn(async move {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            });
        });
        Self {
            addr,
            state,
            stop: Some(stop),
        }
    }

    /// Let `n` held requests (or future ones) be answered.
    fn release(&self, n: usize) {
        self.state.permits.add_permits(n);
    }

    fn arrived(&self) -> Vec<String> {
        self.state.arrived.lock().expect("arrivals").clone()
    }

    fn max_active(&self) -> usize {
        self.state.max_active.load(Ordering::SeqCst)
    }

    async fn wait_arrived(&self, n: usize) -> bool {
        common::eventually(WAIT, || async { self.arrived().len() >= n }).await
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.release(10_000);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn hold(
    req: Request<Incoming>,
    state: Arc<HeldState>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let now = state.active.fetch_add(1, Ordering::SeqCst) + 1;
    state.max_active.fetch_max(now, Ordering::SeqCst);
    let client = req
        .headers()
        .get("x-client")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    state.arrived.lock().expect("arrivals").push(client);
    if let Ok(permit) = state.permits.acquire().await {
        permit.forget();
    }
    state.active.fetch_sub(1, Ordering::SeqCst);
    Ok(Response::new(Full::new(Bytes::from_static(b"ok\n"))))
}

fn capped(backend: &Held, upstream: &str, routes: &str) -> String {
    config(&format!(
        "admin: {{ address: 127.0.0.1:0 }}
upstreams:
  app:
    targets: [{}]
    timeout: 30s
{upstream}
routes:
{routes}",
        backend.addr
    ))
}

const ONE_ROUTE: &str = "  - name: all
    upstream: app
    limits:
      - name: per-client
        rate: 100000/s
        burst: 100000
        key: [header:X-Client]
";

fn get(
    proxy: &TestProxy,
    path: &str,
    client: &str,
) -> tokio::task::JoinHandle<common::client::Reply> {
    let (url, client) = (proxy.url(path), client.to_owned());
    tokio::spawn(async move { Http::new().get_with(&url, &[("x-client", &client)]).await })
}

#[tokio::test]
async fn the_backend_never_sees_more_than_the_cap_and_the_rest_wait() {
    let backend = Held::start();
    let proxy = TestProxy::start(&capped(
        &backend,
        "    max_in_flight: 2\n    queue: { size: 100, timeout: 20s }",
        ONE_ROUTE,
    ));
    let replies: Vec<_> = (0..10)
        .map(|i| get(&proxy, "/", &format!("c{i}")))
        .collect();
    assert!(backend.wait_arrived(2).await);
    let scrape = proxy.scrape().await;
    assert!(
        common::eventually(WAIT, || async {
            find_sample::<u64>(
                &proxy.scrape().await,
                "tollgate_upstream_queue_depth{upstream=\"app\"}",
            ) == Some(8)
        })
        .await,
        "{scrape}"
    );
    let scrape = proxy.scrape().await;
    let target = format!("{{upstream=\"app\",target=\"{}\"}}", backend.addr);
    assert_eq!(
        sample::<u64>(
            &scrape,
            &format!("tollgate_upstream_target_max_in_flight{target}")
        ),
        2
    );
    assert_eq!(
        sample::<u64>(
            &scrape,
            &format!("tollgate_upstream_target_requests_in_flight{target}")
        ),
        2
    );
    backend.release(10);
    for r in replies {
        assert_eq!(r.await.expect("request task").code(), 200);
    }
    assert_eq!(backend.max_active(), 2, "the cap holds at the backend");
    assert_eq!(
        backend.arrived().len(),
        10,
        "every queued request was served"
    );
    let scrape = proxy.scrape().await;
    assert_eq!(
        sample::<u64>(
            &scrape,
            "tollgate_upstream_queue_wait_seconds_count{upstream=\"app\"}"
        ),
        10
    );
}

#[tokio::test]
async fn a_full_queue_and_a_long_wait_get_503_and_nothing_reaches_the_backend() {
    let backend = Held::start();
    let proxy = TestProxy::start(&capped(
        &backend,
        "    max_in_flight: 1\n    queue: { size: 1, timeout: 300ms }",
        ONE_ROUTE,
    ));
    let first = get(&proxy, "/", "a");
    assert!(backend.wait_arrived(1).await);
    let queued = get(&proxy, "/", "b");
    assert!(
        common::eventually(WAIT, || async {
            find_sample::<u64>(
                &proxy.scrape().await,
                "tollgate_upstream_queue_depth{upstream=\"app\"}",
            ) == Some(1)
        })
        .await
    );
    let full = Http::new()
        .get_with(&proxy.url("/"), &[("x-client", "c")])
        .await;
    assert_eq!(full.code(), 503);
    assert_eq!(full.header("content-type"), "application/problem+json");
    assert!(full.header("retry-after").parse::<u64>().expect("seconds") >= 1);
    assert!(
        full.text().contains("\"reason\":\"queue_full\""),
        "{}",
        full.text()
    );
    let late = queued.await.expect("request task");
    assert_eq!(late.code(), 503);
    assert!(
        late.text().contains("\"reason\":\"queue_timeout\""),
        "{}",
        late.text()
    );
    assert!(late.opt_header("retry-after").is_some());
    backend.release(1);
    assert_eq!(first.await.expect("request task").code(), 200);
    assert_eq!(
        backend.arrived(),
        ["a"],
        "refused requests never reached the backend"
    );
    let scrape = proxy.scrape().await;
    for reason in ["queue_full", "queue_timeout"] {
        let series = format!(
            "tollgate_upstream_capacity_rejections_total{{upstream=\"app\",reason=\"{reason}\"}}"
        );
        assert_eq!(sample::<u64>(&scrape, &series), 1, "{series}");
    }
}

#[tokio::test]
async fn a_client_that_leaves_takes_its_request_out_of_the_queue() {
    let backend = Held::start();
    let proxy = TestProxy::start(&capped(&backend, "    max_in_flight: 1", ONE_ROUTE));
    let first = get(&proxy, "/", "a");
    assert!(backend.wait_arrived(1).await);
    let mut raw = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");
    raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Client: gone\r\n\r\n")
        .await
        .expect("send");
    let depth = || async {
        find_sample::<u64>(
            &proxy.scrape().await,
            "tollgate_upstream_queue_depth{upstream=\"app\"}",
        )
    };
    assert!(common::eventually(WAIT, || async { depth().await == Some(1) }).await);
    drop(raw);
    assert!(common::eventually(WAIT, || async { depth().await == Some(0) }).await);
    backend.release(5);
    assert_eq!(first.await.expect("request task").code(), 200);
    let after = Http::new()
        .get_with(&proxy.url("/"), &[("x-client", "b")])
        .await;
    assert_eq!(after.code(), 200);
    assert_eq!(
        backend.arrived(),
        ["a", "b"],
        "the request whose client left never went"
    );
}

#[tokio::test]
async fn a_heavy_identity_does_not_hold_up_a_light_one() {
    let backend = Held::start();
    let proxy = TestProxy::start(&capped(&backend, "    max_in_flight: 1", ONE_ROUTE));
    let first = get(&proxy, "/", "heavy");
    assert!(backend.wait_arrived(1).await);
    let depth = |n| {
        let proxy = &proxy;
        async move {
            common::eventually(WAIT, || async {
                find_sample::<u64>(
                    &proxy.scrape().await,
                    "tollgate_upstream_queue_depth{upstream=\"app\"}",
                ) == Some(n)
            })
            .await
        }
    };
    let mut replies = vec![first];
    for i in 0..20 {
        replies.push(get(&proxy, "/", "heavy"));
        assert!(depth(i + 1).await);
    }
    replies.push(get(&proxy, "/", "light"));
    assert!(depth(21).await);
    backend.release(100);
    for r in replies {
        assert_eq!(r.await.expect("request task").code(), 200);
    }
    let arrived = backend.arrived();
    let light = arrived
        .iter()
        .position(|c| c == "light")
        .expect("light served");
    // The one in service, then at most one heavy turn before the light identity's.
    assert!(light <= 2, "light served at {light}: {arrived:?}");
}

/// One address with eight minted identities fills a queue of six: a client from another
/// address still gets in line (the address's newest request is pushed out), not a `503`.
#[tokio::test]
async fn one_address_minting_identities_cannot_fill_the_queue() {
    let backend = Held::start();
    let proxy = TestProxy::start(&capped(
        &backend,
        "    max_in_flight: 1\n    queue: { size: 6, timeout: 20s }",
        ONE_ROUTE,
    ));
    let first = get(&proxy, "/", "minted-0");
    assert!(backend.wait_arrived(1).await);
    let mut minted = Vec::new();
    for i in 1..=8 {
        minted.push(get(&proxy, "/", &format!("minted-{i}")));
    }
    let depth_six = || async {
        find_sample::<u64>(
            &proxy.scrape().await,
            "tollgate_upstream_queue_depth{upstream=\"app\"}",
        ) == Some(6)
    };
    assert!(common::eventually(WAIT, depth_six).await);
    let (url, other) = (proxy.url("/"), Http::from_ip("127.0.0.2"));
    let light =
        tokio::spawn(async move { other.get_with(&url, &[("x-client", "elsewhere")]).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !light.is_finished(),
        "the other address was refused at once"
    );
    backend.release(100);
    assert_eq!(light.await.unwrap().code(), 200);
    assert_eq!(first.await.unwrap().code(), 200);
    let mut codes = Vec::new();
    for m in minted {
        codes.push(m.await.unwrap().code());
    }
    // Six fit the queue, two were refused; the newcomer pushed out one more.
    assert_eq!(codes.iter().filter(|c| **c == 503).count(), 3, "{codes:?}");
}

#[tokio::test]
async fn a_high_priority_route_goes_first_and_a_low_one_still_moves() {
    let backend = Held::start();
    let routes = "  - name: health
    match: { path: /health }
    upstream: app
    priority: high
  - name: export
    match: { path: /export }
    upstream: app
    priority: low
";
    let proxy = TestProxy::start(&capped(&backend, "    max_in_flight: 1", routes));
    let first = get(&proxy, "/export", "x0");
    assert!(backend.wait_arrived(1).await);
    let depth = |n| {
        let proxy = &proxy;
        async move {
            common::eventually(WAIT, || async {
                find_sample::<u64>(
                    &proxy.scrape().await,
                    "tollgate_upstream_queue_depth{upstream=\"app\"}",
                ) == Some(n)
            })
            .await
        }
    };
    let mut replies = vec![first];
    for i in 0..3 {
        replies.push(get(&proxy, "/export", &format!("x{}", i + 1)));
        assert!(depth(i + 1).await);
    }
    for i in 0..10 {
        replies.push(get(&proxy, "/health", &format!("h{i}")));
        assert!(depth(i + 4).await);
    }
    backend.release(100);
    for r in replies {
        assert_eq!(r.await.expect("request task").code(), 200);
    }
    let arrived: String = backend.arrived().iter().map(|c| &c[..1]).collect();
    // Eight high turns, then the low class gets one, then the rest.
    assert_eq!(arrived, "xhhhhhhhhxhhxx", "{arrived}");
}

#[tokio::test]
async fn a_reload_changes_the_cap_and_keeps_the_queue() {
    let backend = Held::start();
    let yaml = capped(&backend, "    max_in_flight: 1", ONE_ROUTE);
    let proxy = TestProxy::start(&yaml);
    let replies: Vec<_> = (0..4).map(|i| get(&proxy, "/", &format!("c{i}"))).collect();
    assert!(backend.wait_arrived(1).await);
    assert!(
        common::eventually(WAIT, || async {
            find_sample::<u64>(
                &proxy.scrape().await,
                "tollgate_upstream_queue_depth{upstream=\"app\"}",
            ) == Some(3)
        })
        .await
    );
    std::fs::write(
        proxy.config_path(),
        capped(&backend, "    max_in_flight: 3", ONE_ROUTE),
    )
    .expect("rewrite the config");
    proxy.reload();
    assert!(proxy.wait_for_generation(2, WAIT).await);
    assert!(
        backend.wait_arrived(3).await,
        "the larger cap let queued requests go"
    );
    backend.release(10);
    for r in replies {
        assert_eq!(r.await.expect("request task").code(), 200);
    }
    assert_eq!(backend.max_active(), 3);
    // Nothing of the queue was lost in the reload.
    assert_eq!(backend.arrived().len(), 4);
}

#[tokio::test]
async fn a_shutdown_answers_the_queued_requests_before_the_drain_ends() {
    let backend = Held::start();
    let yaml = capped(
        &backend,
        "    max_in_flight: 1\n    queue: { timeout: 60s }",
        ONE_ROUTE,
    )
    .replace("admin:", "shutdown_timeout: 2s\nadmin:");
    let proxy = TestProxy::start(&yaml);
    let first = get(&proxy, "/", "a");
    assert!(backend.wait_arrived(1).await);
    let queued = get(&proxy, "/", "b");
    assert!(
        common::eventually(WAIT, || async {
            find_sample::<u64>(
                &proxy.scrape().await,
                "tollgate_upstream_queue_depth{upstream=\"app\"}",
            ) == Some(1)
        })
        .await
    );
    let started = std::time::Instant::now();
    let stopping = tokio::spawn(proxy.shutdown());
    let refused = queued.await.expect("request task");
    assert_eq!(refused.code(), 503);
    assert!(
        refused.text().contains("\"reason\":\"shutting_down\""),
        "{}",
        refused.text()
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered before the drain ended"
    );
    backend.release(1);
    assert_eq!(
        first.await.expect("request task").code(),
        200,
        "in flight: drained"
    );
    stopping.await.expect("shutdown");
    assert_eq!(backend.arrived(), ["a"]);
}

#[tokio::test]
async fn explain_and_the_dashboard_show_the_cap_and_the_queue() {
    let backend = Held::start();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let token = dir.path().join("token");
    std::fs::write(&token, "t0ken\n").expect("write the token");
    let yaml = capped(
        &backend,
        "    max_in_flight: 1\n    queue: { size: 1 }",
        ONE_ROUTE,
    )
    .replace(
        "admin: { address: 127.0.0.1:0 }",
        &format!(
            "admin:\n  address: 127.0.0.1:0\n  token_file: {}",
            token.display()
        ),
    );
    let proxy = TestProxy::start(&yaml);
    let api = |path: &str| {
        let url = format!("http://{}{path}", proxy.admin_addr());
        async move {
            let reply = Http::new()
                .get_with(&url, &[("authorization", "Bearer t0ken")])
                .await;
            assert_eq!(reply.code(), 200, "{}", reply.text());
            serde_json::from_slice::<serde_json::Value>(&reply.body).expect("JSON")
        }
    };
    let would = |e: serde_json::Value| e["capacity"]["would"].as_str().unwrap_or("").to_owned();
    assert_eq!(
        would(api("/api/v1/explain?header=X-Client:a").await),
        "forward"
    );
    let first = get(&proxy, "/", "a");
    assert!(backend.wait_arrived(1).await);
    assert_eq!(
        would(api("/api/v1/explain?header=X-Client:b").await),
        "wait"
    );
    let queued = get(&proxy, "/", "b");
    assert!(
        common::eventually(WAIT, || async {
            find_sample::<u64>(
                &proxy.scrape().await,
                "tollgate_upstream_queue_depth{upstream=\"app\"}",
            ) == Some(1)
        })
        .await
    );
    let e = api("/api/v1/explain?header=X-Client:c").await;
    assert_eq!(would(e.clone()), "refuse", "{e:#}");
    assert_eq!(
        (
            e["capacity"]["in_flight"].as_u64(),
            e["capacity"]["cap"].as_u64()
        ),
        (Some(1), Some(1))
    );
    let board = api("/api/v1/dashboard").await;
    let target = &board["upstreams"][0];
    assert_eq!(
        (target["cap"].as_u64(), target["queued"].as_u64()),
        (Some(1), Some(1)),
        "{target:#}"
    );
    backend.release(2);
    assert_eq!(first.await.expect("request task").code(), 200);
    assert_eq!(queued.await.expect("request task").code(), 200);
}

#[tokio::test]
async fn each_target_has_its_own_cap_and_http2_requests_queue_too() {
    let (one, two) = (Held::start(), Held::start());
    let yaml = config(&format!(
        "admin: {{ address: 127.0.0.1:0 }}
upstreams:
  app:
    targets: [{}, {}]
    timeout: 30s
    max_in_flight: 1
routes:
{ONE_ROUTE}",
        one.addr, two.addr
    ));
    let proxy = TestProxy::start(&yaml);
    let h2 = Http::h2c();
    let replies: Vec<_> = (0..6)
        .map(|i| {
            let (h2, url) = (h2.clone(), proxy.url("/"));
            tokio::spawn(async move { h2.get_with(&url, &[("x-client", &format!("c{i}"))]).await })
        })
        .collect();
    assert!(
        one.wait_arrived(1).await && two.wait_arrived(1).await,
        "one on each target"
    );
    assert!(
        common::eventually(WAIT, || async {
            find_sample::<u64>(
                &proxy.scrape().await,
                "tollgate_upstream_queue_depth{upstream=\"app\"}",
            ) == Some(4)
        })
        .await
    );
    one.release(10);
    two.release(10);
    for r in replies {
        let r = r.await.expect("request task");
        assert_eq!((r.code(), r.version), (200, http::Version::HTTP_2));
    }
    assert_eq!((one.max_active(), two.max_active()), (1, 1));
    assert_eq!(one.arrived().len() + two.arrived().len(), 6);
}

#[tokio::test]
async fn a_slow_upload_holds_no_slot_until_its_body_is_buffered() {
    let backend = Held::start();
    backend.release(100);
    let proxy = TestProxy::start(&capped(&backend, "    max_in_flight: 1", ONE_ROUTE));
    let mut slow = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");
    slow.write_all(
        b"POST / HTTP/1.1\r\nHost: x\r\nX-Client: slow\r\nContent-Length: 10\r\n\r\nhello",
    )
    .await
    .expect("send half");
    // The upload is half there: another client's request goes to the backend meanwhile.
    let quick = Http::new()
        .get_with(&proxy.url("/"), &[("x-client", "quick")])
        .await;
    assert_eq!(quick.code(), 200);
    assert_eq!(backend.arrived(), ["quick"]);
    slow.write_all(b"world").await.expect("send the rest");
    assert!(backend.wait_arrived(2).await);
    assert_eq!(backend.arrived(), ["quick", "slow"]);
}

#[tokio::test]
async fn a_retry_takes_a_slot_on_the_target_it_goes_to() {
    let backend = Held::start();
    backend.release(100);
    let yaml = config(&format!(
        "admin: {{ address: 127.0.0.1:0 }}
upstreams:
  app:
    targets: [{}, {}]
    timeout: 30s
    retries: 1
    max_in_flight: 1
routes:
{ONE_ROUTE}",
        common::refused_addr(),
        backend.addr
    ));
    let proxy = TestProxy::start(&yaml);
    let replies: Vec<_> = (0..8).map(|i| get(&proxy, "/", &format!("c{i}"))).collect();
    for r in replies {
        assert_eq!(r.await.expect("request task").code(), 200);
    }
    assert_eq!(backend.arrived().len(), 8);
    assert_eq!(
        backend.max_active(),
        1,
        "the live target's cap held through the retries"
    );
    let scrape = proxy.scrape().await;
    let target = format!("{{upstream=\"app\",target=\"{}\"}}", backend.addr);
    let series = format!("tollgate_upstream_target_requests_in_flight{target}");
    assert_eq!(sample::<u64>(&scrape, &series), 0, "every slot given back");
}
