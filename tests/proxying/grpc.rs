//! gRPC through the proxy to an HTTP/2 (h2c) upstream, with a real gRPC server and client
//! (grpcio, `tests/fixtures/grpc/peer.py`): unary calls with trailers both ways, messages of
//! several MiB, server, client and ping-pong bidirectional streams, deadlines; a call refused
//! by a limit answered in gRPC's form (`RESOURCE_EXHAUSTED` with pushback), and a gRPC call
//! over HTTP/1.1 refused with `505`; streams past a connection's bound, GOAWAY, deadlines,
//! cancellation, gRPC health checks and the calls counted by status.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use common::{config, Http, TestProxy};
use serde_json::Value;

fn peer_script() -> std::path::PathBuf {
    common::proxy::repo_root().join("tests/fixtures/grpc/peer.py")
}

/// The grpcio server, stopped when dropped (its stdin closes).
struct GrpcServer {
    child: Child,
    port: u16,
}

impl GrpcServer {
    fn start() -> Self {
        Self::allowing(0)
    }

    /// A server that allows `max_streams` streams per connection (0: grpcio's default).
    fn allowing(max_streams: u32) -> Self {
        Self::spawn(max_streams, 0)
    }

    /// A server that sends each connection a GOAWAY once it is `max_age_ms` old (grpcio's
    /// `max_connection_age_ms`, as servers behind load balancers are often set up).
    fn aging(max_age_ms: u32) -> Self {
        Self::spawn(0, max_age_ms)
    }

    fn spawn(max_streams: u32, max_age_ms: u32) -> Self {
        let ok = Command::new("python3")
            .args(["-c", "import grpc"])
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "python3 with grpcio is needed (scripts/test.sh installs it; or `pip install grpcio`)"
        );
        let mut child = Command::new("python3")
            .arg(peer_script())
            .arg("server")
            .arg(max_streams.to_string())
            .arg(max_age_ms.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the gRPC server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line.trim().parse().expect("the gRPC server's port");
        Self { child, port }
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run one client case against `addr`: what it printed.
async fn call(addr: std::net::SocketAddr, case: &str) -> Value {
    let (addr, case) = (addr.to_string(), case.to_owned());
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(peer_script())
            .args(["client", &addr, &case])
            .output()
            .expect("run the gRPC client")
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim()).unwrap_or_else(|_| {
        panic!(
            "client printed {text:?}, stderr {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn grpc_config(server: &GrpcServer, limits: &str) -> String {
    config(&format!(
        "upstreams:
  grpc:
    targets: [127.0.0.1:{}]
    protocol: h2c
routes:
  - name: echo
    match: {{ path_prefix: /test.Echo/ }}
    upstream: grpc
{limits}",
        server.port
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_pass_through_an_h2c_upstream() {
    let server = GrpcServer::start();
    let proxy = TestProxy::start(&grpc_config(&server, ""));
    let unary = call(proxy.addr(), "unary").await;
    assert_eq!(unary["ok"], "hello", "{unary}");
    // Metadata in, trailers out.
    assert_eq!(unary["trailers"]["x-trailer"], "done", "{unary}");
    assert_eq!(unary["trailers"]["x-note-seen"], "n1", "{unary}");
    let big = call(proxy.addr(), "big").await;
    assert_eq!(big["ok"], 5 << 20, "a 5 MiB message each way: {big}");
    assert_eq!(call(proxy.addr(), "server_stream").await["ok"], 5);
    assert_eq!(call(proxy.addr(), "client_stream").await["ok"], "60");
    // Ping-pong: each message waits for the previous answer, so nothing may be held.
    let bidi = call(proxy.addr(), "bidi").await;
    assert_eq!(
        bidi["ok"],
        serde_json::json!(["ping0", "ping1", "ping2", "ping3", "ping4"]),
        "{bidi}"
    );
    let deadline = call(proxy.addr(), "deadline").await;
    assert_eq!(deadline["code"], "DEADLINE_EXCEEDED", "{deadline}");
    assert!(deadline["took"].as_f64().unwrap() < 2.0, "{deadline}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_call_is_resource_exhausted_with_pushback() {
    let server = GrpcServer::start();
    let limits = "    limits:\n      - { name: calls, rate: 1/min, burst: 2, key: [ip] }\n";
    let proxy = TestProxy::start(&grpc_config(&server, limits));
    for _ in 0..2 {
        assert_eq!(call(proxy.addr(), "unary_status").await["ok"], "answered");
    }
    let refused = call(proxy.addr(), "unary_status").await;
    assert_eq!(refused["code"], "RESOURCE_EXHAUSTED", "{refused}");
    let pushback: u64 = refused["pushback"].as_str().unwrap().parse().unwrap();
    assert!((1_000..=60_000).contains(&pushback), "{refused}");
    // Over HTTP/1.1 a gRPC call cannot work: refused, never forwarded.
    let req = common::client::request(
        "POST",
        &proxy.url("/test.Echo/Unary"),
        &[("content-type", "application/grpc")],
    );
    assert_eq!(Http::new().send(req).await.code(), 505);
    // As Envoy answers by default, when asked.
    let unavailable = grpc_config(&server, limits).replace(
        "upstreams:",
        "grpc: { limited_status: unavailable }\nupstreams:",
    );
    let proxy = TestProxy::start(&unavailable);
    for _ in 0..2 {
        assert_eq!(call(proxy.addr(), "unary_status").await["ok"], "answered");
    }
    let refused = call(proxy.addr(), "unary_status").await;
    assert_eq!(refused["code"], "UNAVAILABLE", "{refused}");
}

/// The access log and the metrics record each call's gRPC status: an upstream's from its
/// trailers, tollgate's own from its trailers-only answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_records_each_calls_grpc_status() {
    let server = GrpcServer::start();
    let limits = "    limits:\n      - { name: calls, rate: 1/min, burst: 1, key: [ip] }\n";
    let with_admin = grpc_config(&server, limits)
        .replace("upstreams:", "admin: { address: 127.0.0.1:0 }\nupstreams:");
    let proxy = common::BinaryProxy::start(&with_admin);
    assert_eq!(call(proxy.addr(), "unary_status").await["ok"], "answered");
    let refused = call(proxy.addr(), "unary_status").await;
    assert_eq!(refused["code"], "RESOURCE_EXHAUSTED");
    let wait = std::time::Duration::from_secs(5);
    assert!(
        proxy.wait_for_log("status=200 grpc_status=0 ", wait),
        "{:#?}",
        proxy.logs()
    );
    assert!(
        proxy.wait_for_log("status=200 grpc_status=8 ", wait),
        "{:#?}",
        proxy.logs()
    );
    let metrics = format!("http://{}/metrics", proxy.admin_addr());
    let scraped = Http::new().get(&metrics).await;
    let text = scraped.text();
    for code in ["OK", "ResourceExhausted"] {
        let sample = format!("tollgate_grpc_calls_total{{route=\"echo\",grpc_code=\"{code}\"}}");
        assert_eq!(common::find_sample::<u64>(text, &sample), Some(1), "{text}");
    }
}

/// A capped HTTP/2 upstream: calls take their slots in turn on the one multiplexed connection,
/// and every one is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_h2c_upstream_serves_calls_in_turn() {
    let server = GrpcServer::start();
    let capped = grpc_config(&server, "").replace(
        "    protocol: h2c\n",
        "    protocol: h2c\n    max_in_flight: 1\n    queue: { size: 16, timeout: 10s }\n",
    );
    let proxy = TestProxy::start(&capped);
    let calls: Vec<_> = (0..4)
        .map(|_| {
            let addr = proxy.addr();
            tokio::spawn(async move { call(addr, "unary").await })
        })
        .collect();
    for c in calls {
        let answer = c.await.unwrap();
        assert_eq!(answer["ok"], "hello", "{answer}");
        assert_eq!(answer["trailers"]["x-trailer"], "done", "{answer}");
    }
    assert_eq!(call(proxy.addr(), "bidi").await["ok"][4], "ping4");
}

/// A backend allowing 2 streams per connection, and `http2.max_concurrent_streams: 2`: four
/// calls at once run on two connections, side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_a_connections_bound_open_another_connection() {
    let server = GrpcServer::allowing(2);
    let two = grpc_config(&server, "").replace(
        "    protocol: h2c\n",
        "    protocol: h2c\n    http2: { max_concurrent_streams: 2 }\n",
    );
    let proxy = TestProxy::start(&two);
    let run = call(proxy.addr(), "parallel").await;
    assert_eq!(run["peers"], 2, "{run}");
    assert!(run["took"].as_f64().unwrap() < 1.8, "side by side: {run}");
}

/// `grpc-timeout` goes upstream as what is left of it, or of the upstream's `timeout` if that
/// is shorter; a call its client cancels on a capped upstream is cancelled there at once and
/// frees its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_are_propagated_and_cancel_the_upstream_call() {
    let server = GrpcServer::start();
    let capped = grpc_config(&server, "").replace(
        "    protocol: h2c\n",
        "    protocol: h2c\n    timeout: 2s\n    max_in_flight: 1\n    queue: { size: 8, timeout: 10s }\n",
    );
    let proxy = TestProxy::start(&capped);
    // The client allows 10 s, the upstream's timeout 2 s: the server is told 2 s.
    let left = call(proxy.addr(), "remaining").await["ok"]
        .as_f64()
        .unwrap();
    assert!((1.0..=2.0).contains(&left), "{left}");
    assert_eq!(call(proxy.addr(), "cancel").await["ok"], true);
    // The only slot is free at once: the next call does not wait for the slow one's 5 s.
    let started = std::time::Instant::now();
    let cancelled = call(proxy.addr(), "cancelled").await;
    assert_eq!(
        cancelled["ok"], 1.0,
        "the server saw the cancellation: {cancelled}"
    );
    assert!(
        started.elapsed().as_secs_f64() < 2.5,
        "{:?}",
        started.elapsed()
    );
}

/// gRPC's standard health check (`grpc.health.v1.Health/Check`) takes a target that answers
/// `NOT_SERVING` out of rotation, and back once it serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_checks_follow_the_servers_status() {
    let (a, b) = (GrpcServer::start(), GrpcServer::start());
    let checked = grpc_config(&a, "").replace(
        &format!("    targets: [127.0.0.1:{}]\n    protocol: h2c\n", a.port),
        &format!(
            "    targets: [127.0.0.1:{}, 127.0.0.1:{}]\n    protocol: h2c\n    health:\n      check: {{ grpc: {{}}, interval: 100ms, healthy_threshold: 1, unhealthy_threshold: 1 }}\n",
            a.port, b.port
        ),
    );
    let proxy = TestProxy::start(&checked);
    let b_direct: std::net::SocketAddr = ([127, 0, 0, 1], b.port).into();
    let served_by_b = || async { call(b_direct, "count").await["ok"].as_f64().unwrap() as u64 };
    assert_eq!(call(b_direct, "unhealthy").await["ok"], "0");
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    for _ in 0..4 {
        assert_eq!(call(proxy.addr(), "unary").await["ok"], "hello");
    }
    assert_eq!(served_by_b().await, 0, "NOT_SERVING: out of rotation");
    assert_eq!(call(b_direct, "healthy").await["ok"], "1");
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    for _ in 0..4 {
        assert_eq!(call(proxy.addr(), "unary").await["ok"], "hello");
    }
    assert!(served_by_b().await >= 1, "SERVING again: back in rotation");
}

/// A backend that closes its connections with a GOAWAY after 300 ms: the calls that come after
/// go on a new connection, and none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_goaway_moves_the_next_calls_to_a_new_connection() {
    let server = GrpcServer::aging(300);
    let proxy = TestProxy::start(&grpc_config(&server, ""));
    let run = call(proxy.addr(), "spaced").await;
    assert_eq!(run["ok"], 8, "every call answered: {run}");
    assert!(
        run["peers"].as_u64().unwrap() >= 2,
        "a new connection: {run}"
    );
}

/// A call's cost reported in its trailers settles its reserve: 42 charged of the 100 reserved,
/// counted once the trailers come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_in_the_trailers_settles_the_reserve() {
    let server = GrpcServer::start();
    let limits = "    limits:\n      - { name: units, rate: 1000/h, burst: 1000, key: [ip], cost: { reserve: 100, from_response: x-cost } }\n";
    let yaml = grpc_config(&server, limits)
        .replace("upstreams:", "admin: { address: 127.0.0.1:0 }\nupstreams:");
    let proxy = TestProxy::start(&yaml);
    for _ in 0..3 {
        assert_eq!(call(proxy.addr(), "unary").await["ok"], "hello");
    }
    let series = "tollgate_limit_units_total{route=\"echo\",limit=\"units\"}";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let scrape = proxy.scrape().await;
        if common::find_sample::<u64>(&scrape, series) == Some(126) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "three calls of 42 settled:\n{scrape}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A traced gRPC call is a SERVER span with `rpc.*` (its status from the trailers) and a
/// CLIENT span for its attempt, exported to a real OTLP receiver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traced_call_has_its_rpc_attributes() {
    let receiver = common::otlp::Receiver::start("ok");
    let server = GrpcServer::start();
    let traces = format!(
        "telemetry:\n  traces: {{ endpoint: \"{}\" }}\n",
        receiver.http_url()
    );
    let proxy = TestProxy::start(
        &grpc_config(&server, "").replace("upstreams:", &format!("{traces}upstreams:")),
    );
    assert_eq!(call(proxy.addr(), "unary").await["ok"], "hello");
    let spans = receiver.wait(std::time::Duration::from_secs(10), |spans| spans.len() >= 2);
    let server_span = spans
        .iter()
        .find(|s| s["kind"] == 2)
        .expect("a SERVER span");
    let a = &server_span["attributes"];
    assert_eq!(a["rpc.system"], "grpc", "{a}");
    assert_eq!(a["rpc.service"], "test.Echo");
    assert!(
        a["rpc.method"].as_str().is_some_and(|m| !m.is_empty()),
        "{a}"
    );
    assert_eq!(a["rpc.grpc.status_code"], 0);
    assert_eq!(a["network.protocol.version"], "2");
    assert_eq!(server_span["name"], "POST /test.Echo/*");
    let client = spans
        .iter()
        .find(|s| s["kind"] == 3)
        .expect("a CLIENT span");
    assert_eq!(client["parent_span_id"], server_span["span_id"]);
}
