//! Request IDs and the access log: `X-Request-Id` made, or kept from a trusted proxy, sent
//! upstream and returned on every answer (tollgate's own 404 and 429 included); `traceparent`
//! and `tracestate` passed on unchanged; the access log's text and JSON lines with their
//! fields, written to stderr or a file, reopened on SIGUSR1 and flushed at shutdown; every
//! stderr line JSON with `--log-format json`, a startup failure included.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::client::{request, upload};
use common::proxy::run_cli;
use common::{config, upstream_app, BinaryProxy, Http, MockUpstream, TestProxy};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACESTATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";

fn is_request_id(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

/// One route forwarding to `upstream` with a limit of `burst` requests per address, and the
/// admin listener; `extra` is more top-level YAML.
fn forwarding(upstream: &MockUpstream, burst: u32, extra: &str) -> String {
    config(&format!(
        "admin: {{ address: 127.0.0.1:0 }}\n{extra}{}routes:\n  - name: api\n    match: {{ path_prefix: /api/ }}\n    upstream: app\n    limits:\n      - name: per-ip\n        rate: 1/min\n        burst: {burst}\n        key: [ip]\n",
        upstream_app(upstream.addr(), "5s")
    ))
}

#[tokio::test]
async fn request_ids_are_made_for_untrusted_peers_sent_upstream_and_returned_on_every_answer() {
    let upstream = MockUpstream::start();
    let proxy = TestProxy::start(&forwarding(&upstream, 1, ""));
    let http = Http::new();
    let sent = [
        ("x-request-id", "chosen-by-the-client"),
        ("traceparent", TRACEPARENT),
        ("tracestate", TRACESTATE),
    ];
    let ok = http.get_with(&proxy.url("/api/a"), &sent).await;
    assert_eq!(ok.code(), 200);
    let id = ok.header("x-request-id").to_owned();
    assert!(is_request_id(&id), "{id}");
    let seen = upstream.last();
    assert_eq!(seen.header("x-request-id"), id, "the same ID upstream");
    assert_eq!(seen.headers.get_all("x-request-id").iter().count(), 1);
    assert_eq!(seen.header("traceparent"), TRACEPARENT);
    assert_eq!(seen.header("tracestate"), TRACESTATE);

    // Tollgate's own answers carry one too: 429, 404.
    let limited = http.get_with(&proxy.url("/api/a"), &sent).await;
    assert_eq!(limited.code(), 429);
    let not_found = http.get(&proxy.url("/elsewhere")).await;
    assert_eq!(not_found.code(), 404);
    let ids = [
        id,
        limited.header("x-request-id").to_owned(),
        not_found.header("x-request-id").to_owned(),
    ];
    assert!(ids.iter().all(|i| is_request_id(i)), "{ids:?}");
    assert!(
        ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2],
        "{ids:?}"
    );
    // A second 429 with the same numbers (its head remembered from the first): an ID of
    // its own, once.
    let again = http.get_with(&proxy.url("/api/a"), &sent).await;
    assert_eq!(again.code(), 429);
    for reply in [&limited, &again] {
        assert_eq!(reply.headers.get_all("x-request-id").iter().count(), 1);
    }
    let second = again.header("x-request-id");
    assert!(is_request_id(second) && second != ids[1], "{second}");
    assert_eq!(upstream.count(), 1);
}

#[tokio::test]
async fn a_trusted_proxys_request_id_is_kept() {
    let upstream = MockUpstream::start();
    let yaml = forwarding(&upstream, 5, "trusted_proxies: [127.0.0.1/32]\n");
    let proxy = TestProxy::start(&yaml);
    let http = Http::new();
    let reply = http
        .get_with(&proxy.url("/api/a"), &[("x-request-id", "lb-7f3a-0001")])
        .await;
    assert_eq!(reply.code(), 200);
    assert_eq!(reply.header("x-request-id"), "lb-7f3a-0001");
    assert_eq!(upstream.last().header("x-request-id"), "lb-7f3a-0001");
    // Not an ID worth keeping (a space): replaced, even from a trusted proxy.
    let reply = http
        .get_with(&proxy.url("/api/a"), &[("x-request-id", "two words")])
        .await;
    assert!(is_request_id(reply.header("x-request-id")));
    // No ID at all: one is made.
    let reply = http.get(&proxy.url("/api/a")).await;
    assert!(is_request_id(reply.header("x-request-id")));
    assert_eq!(
        upstream.last().header("x-request-id"),
        reply.header("x-request-id")
    );
}

#[tokio::test]
async fn request_id_header_names_another_header() {
    let upstream = MockUpstream::start();
    let yaml = forwarding(&upstream, 5, "request_id_header: X-Correlation-Id\n");
    let proxy = TestProxy::start(&yaml);
    let reply = Http::new()
        .get_with(&proxy.url("/api/a"), &[("x-request-id", "left-alone")])
        .await;
    let id = reply.header("x-correlation-id");
    assert!(is_request_id(id), "{id}");
    assert!(reply.opt_header("x-request-id").is_none());
    let seen = upstream.last();
    assert_eq!(seen.header("x-correlation-id"), id);
    // Any other header of that name is the client's, passed on as any header is.
    assert_eq!(seen.header("x-request-id"), "left-alone");
}

/// Poll `f` until it returns `Some`, for up to `timeout`.
fn eventually<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The first stderr line of `proxy` containing `needle`, within 5 s.
fn log_line(proxy: &BinaryProxy, needle: &str) -> String {
    eventually(Duration::from_secs(5), || {
        proxy.logs().into_iter().find(|l| l.contains(needle))
    })
    .unwrap_or_else(|| panic!("no line with {needle}: {:#?}", proxy.logs()))
}

fn file_line(path: &Path, needle: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find(|l| l.contains(needle)).map(str::to_owned)
}

#[tokio::test]
async fn the_text_line_has_the_request_the_answer_and_the_upstream() {
    let upstream = MockUpstream::start();
    let proxy = BinaryProxy::start(&forwarding(&upstream, 2, ""));
    let http = Http::new();
    let mut req = upload(&proxy.url("/api/upload"), 1000);
    req.headers_mut()
        .insert("user-agent", "probe/1.0 (tests)".parse().unwrap());
    req.headers_mut()
        .insert("traceparent", TRACEPARENT.parse().unwrap());
    let reply = http.send(req).await;
    assert_eq!(reply.code(), 200);
    let id = reply.header("x-request-id").to_owned();
    let line = log_line(&proxy, &id);
    assert!(
        line.contains("  INFO tollgate::access: method=POST path=/api/upload host=127.0.0.1:"),
        "{line}"
    );
    for field in [
        " proto=HTTP/1.1 status=200 bytes_in=1000 bytes_out=4 route=api limit=- outcome=admitted client=",
        &format!(" client_ip=127.0.0.1 upstream={} upstream_ms=", upstream.addr()),
        &format!(" request_id={id} trace_id=4bf92f3577b34da6a3ce929d0e0e4736 span_id=00f067aa0ba902b7 "),
        " user_agent=\"probe/1.0 (tests)\"",
    ] {
        assert!(line.contains(field), "{field} in {line}");
    }
    assert!(line.contains(" ms="), "{line}");

    // A download's bytes are counted when its body ends; a 429's answer is tollgate's own.
    let big = http.get(&proxy.url("/api/download/300000")).await;
    assert_eq!(big.code(), 200);
    let line = log_line(&proxy, big.header("x-request-id"));
    assert!(
        line.contains(" status=200 bytes_in=0 bytes_out=300000 "),
        "{line}"
    );
    let limited = http.get(&proxy.url("/api/x")).await;
    assert_eq!(limited.code(), 429);
    let line = log_line(&proxy, limited.header("x-request-id"));
    assert!(
        line.contains(" status=429 ")
            && line.contains(" limit=per-ip outcome=limited ")
            && line.contains(" upstream=- upstream_ms=- "),
        "{line}"
    );
}

/// A request the limits admitted and the capped upstream's queue refused is logged as
/// `at-capacity`, with the time it waited.
#[tokio::test]
async fn a_queue_timeout_is_logged_at_capacity_with_its_wait() {
    let upstream = MockUpstream::start();
    let yaml = forwarding(&upstream, 5, "").replace(
        "    timeout: 5s\n",
        "    timeout: 5s\n    max_in_flight: 1\n    queue: { size: 4, timeout: 300ms }\n",
    );
    let proxy = BinaryProxy::start(&yaml);
    let slow = tokio::spawn({
        let url = proxy.url("/api/slow/2000");
        async move { Http::new().get(&url).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused = Http::new().get(&proxy.url("/api/x")).await;
    assert_eq!(refused.code(), 503);
    let line = log_line(&proxy, refused.header("x-request-id"));
    assert!(line.contains(" status=503 "), "{line}");
    assert!(line.contains(" outcome=at-capacity "), "{line}");
    let waited: u64 = line
        .split(" queue_ms=")
        .nth(1)
        .and_then(|v| v.split([' ', '.']).next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no queue_ms in {line}"));
    assert!((290..2000).contains(&waited), "{line}");
    assert_eq!(slow.await.unwrap().code(), 200);
}

#[tokio::test]
async fn with_json_every_line_is_a_flat_object_the_access_line_with_otel_names() {
    let upstream = MockUpstream::start();
    let proxy = BinaryProxy::start_with(
        &forwarding(&upstream, 2, ""),
        &["--log-format", "json"],
        &[],
    );
    let http = Http::new();
    let reply = http
        .get_with(
            &proxy.url("/api/a?secret=1"),
            &[
                ("user-agent", "probe \"quoted\""),
                ("traceparent", TRACEPARENT),
            ],
        )
        .await;
    let id = reply.header("x-request-id").to_owned();
    let line = log_line(&proxy, &id);
    let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON access line");
    let expect = serde_json::json!({
        "level": "INFO",
        "target": "tollgate::access",
        "http.request.id": id,
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736",
        "span_id": "00f067aa0ba902b7",
        "http.request.method": "GET",
        "url.scheme": "http",
        "server.address": "127.0.0.1",
        "server.port": proxy.addr().port(),
        "url.path": "/api/a",
        "network.protocol.version": "1.1",
        "http.response.status_code": 200,
        "http.request.body.size": 0,
        "http.response.body.size": 3,
        "client.address": "127.0.0.1",
        "network.peer.address": "127.0.0.1",
        "user_agent.original": "probe \"quoted\"",
        "tollgate.route": "api",
        "tollgate.outcome": "admitted",
        "upstream.address": upstream.addr().to_string(),
    });
    for (k, want) in expect.as_object().unwrap() {
        assert_eq!(&v[k], want, "{k} in {line}");
    }
    assert_eq!(
        v["tollgate.client"].as_str().map(str::len),
        Some(16),
        "{line}"
    );
    assert!(!line.contains("secret"), "no query string: {line}");
    for k in ["duration_ms", "upstream.duration_ms"] {
        let ms = v[k].as_f64().unwrap_or_else(|| panic!("{k} in {line}"));
        let text = v[k].to_string();
        assert!(
            ms >= 0.0 && text.split('.').nth(1).is_none_or(|d| d.len() <= 3),
            "{text}"
        );
    }
    assert!(
        v["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{line}"
    );

    // Every other line is a flat object too: message and fields at the top level.
    proxy.terminate();
    assert!(proxy.wait_for_log(r#""message":"stopped""#, Duration::from_secs(10)));
    for l in proxy.logs() {
        let v: serde_json::Value =
            serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}: not JSON: {l}"));
        assert!(v.get("fields").is_none(), "flattened: {l}");
        assert!(v["timestamp"].is_string() && v["level"].is_string(), "{l}");
    }
    let listening = proxy
        .logs()
        .into_iter()
        .find(|l| l.contains(r#""message":"listening""#))
        .expect("a listening line");
    let v: serde_json::Value = serde_json::from_str(&listening).unwrap();
    assert_eq!(v["address"], proxy.addr().to_string());
}

#[test]
fn a_startup_failure_is_one_json_line_with_json_logs() {
    let out = run_cli(&[
        "run",
        "--config",
        "tests/fixtures/does-not-exist.yaml",
        "--log-format",
        "json",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(lines[0]).expect("a JSON line");
    assert_eq!(v["level"], "ERROR");
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains("does-not-exist.yaml")),
        "{stderr}"
    );
    // An access log that cannot be opened is a startup failure too.
    let out = run_cli(&[
        "run",
        "--config",
        "config/tollgate.yaml",
        "--log-format",
        "json",
        "--access-log",
        "/nonexistent-dir/access.log",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let v: serde_json::Value = serde_json::from_str(stderr.trim()).expect("a JSON line");
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains("cannot open the access log /nonexistent-dir/access.log")),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_file_log_is_reopened_on_sigusr1_and_flushed_at_shutdown() {
    let upstream = MockUpstream::start();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.log");
    let rotated = dir.path().join("access.log.1");
    let mut proxy = BinaryProxy::start_with(
        &forwarding(&upstream, 10, ""),
        &[
            "--access-log",
            path.to_str().unwrap(),
            "--access-log-format",
            "json",
        ],
        &[],
    );
    let http = Http::new();
    let first = http.get(&proxy.url("/api/1")).await;
    let first = first.header("x-request-id").to_owned();
    // Written within a second with no more traffic (the worker's ticker).
    let line = eventually(Duration::from_secs(5), || file_line(&path, &first))
        .unwrap_or_else(|| panic!("{first} not in {}", path.display()));
    assert!(
        serde_json::from_str::<serde_json::Value>(&line).is_ok(),
        "{line}"
    );
    assert!(
        !proxy.logs().iter().any(|l| l.contains(&first)),
        "not on stderr"
    );

    // logrotate: rename, then SIGUSR1; the next lines go to a new file at the path.
    std::fs::rename(&path, &rotated).unwrap();
    proxy.signal("USR1");
    assert!(
        eventually(Duration::from_secs(5), || path.exists().then_some(())).is_some(),
        "reopened"
    );
    let second = http.get(&proxy.url("/api/2")).await;
    let second = second.header("x-request-id").to_owned();
    assert!(eventually(Duration::from_secs(5), || file_line(&path, &second)).is_some());
    assert!(file_line(&rotated, &first).is_some());
    assert!(file_line(&rotated, &second).is_none());

    // Shutdown right after a request: its line is written before the process exits.
    let last = http.get(&proxy.url("/api/3")).await;
    let last = last.header("x-request-id").to_owned();
    proxy.terminate();
    assert!(proxy.wait_exit(Duration::from_secs(10)).is_some());
    assert!(file_line(&path, &last).is_some(), "flushed at shutdown");
}

#[tokio::test]
async fn access_log_false_writes_no_lines_yet_ids_are_still_made() {
    let upstream = MockUpstream::start();
    let mut proxy = BinaryProxy::start_with(
        &forwarding(&upstream, 2, ""),
        &["--access-log", "false"],
        &[],
    );
    let http = Http::new();
    let reply = http.send(request("GET", &proxy.url("/api/a"), &[])).await;
    assert!(is_request_id(reply.header("x-request-id")));
    let metrics = http
        .get(&format!("http://{}/metrics", proxy.admin_addr()))
        .await;
    assert!(
        metrics
            .text()
            .contains("tollgate_access_log_dropped_lines_total 0"),
        "{}",
        metrics.text()
    );
    // Whatever was logged is out once the proxy says it stopped.
    proxy.terminate();
    assert!(proxy.wait_for_log("stopped", Duration::from_secs(10)));
    assert!(proxy.wait_exit(Duration::from_secs(10)).is_some());
    assert!(
        !proxy.logs().iter().any(|l| l.contains("tollgate::access")),
        "{:#?}",
        proxy.logs()
    );
}
