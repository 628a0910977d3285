//! Framing re-emitted canonically: the backend receives the length tollgate parsed,
//! an upstream response framed both ways or switching protocols unasked is a `502` whose
//! connection is discarded, and a request line too long is `414` however long it is. A raw
//! backend records the exact bytes and answers with canned ones.

use crate::shared as edge;

use std::time::Duration;

use common::TestProxy;
use edge::{find, lossy, ok_answer, yaml, Raw, RawBackend, BUFFERED_AND_STREAMED, CATCH_ALL, WAIT};
use tokio::time::Instant;

use crate::common;

#[tokio::test]
async fn the_backend_receives_the_length_the_proxy_parsed() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", BUFFERED_AND_STREAMED));
    for (path, lengths) in [
        ("/streamed", "Content-Length: 010\r\n"),
        ("/buffered", "Content-Length: 010\r\n"),
        ("/streamed", "Content-Length: 10\r\nContent-Length: 10\r\n"),
        (
            "/buffered",
            "Content-Length: 0010\r\nContent-Length: 10\r\n",
        ),
    ] {
        let mut c = Raw::open(proxy.addr()).await;
        c.send(format!("POST {path} HTTP/1.1\r\nHost: a\r\n{lengths}\r\n0123456789").as_bytes())
            .await;
        let r = c.response().await;
        assert_eq!(r.status, 200, "{path} {lengths:?}: {r:?}");
        let request = backend.requests().pop().unwrap();
        let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
        assert_eq!(
            text.matches("content-length").count(),
            1,
            "{lengths:?}: {text:?}"
        );
        assert!(
            text.contains("\r\ncontent-length: 10\r\n"),
            "{lengths:?}: {text:?}"
        );
        assert!(request.ends_with(b"\r\n\r\n0123456789"), "{text:?}");
        assert!(!text.contains("transfer-encoding"), "{text:?}");
    }
}

/// `/both` is framed by Content-Length and chunked coding at once, `/switch` switches
/// protocols unasked; anything else is `200 ok`.
fn odd_answers(head: &[u8]) -> Vec<u8> {
    if find(head, b" /both ").is_some() {
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n\
          5\r\nhello\r\n0\r\n\r\n"
            .to_vec()
    } else if find(head, b" /switch ").is_some() {
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"
            .to_vec()
    } else {
        ok_answer(head)
    }
}

/// Wait until the backend connection that carried the request for `path` has been closed by
/// the proxy, with that request its last.
async fn discarded_after(backend: &RawBackend, path: &str) -> bool {
    let marker = format!("GET {path} ");
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        let conns = backend.connections();
        let carrier = conns
            .iter()
            .find(|c| c.requests.iter().any(|r| r.starts_with(marker.as_bytes())));
        if let Some(c) = carrier {
            let last = c
                .requests
                .last()
                .is_some_and(|r| r.starts_with(marker.as_bytes()));
            if c.closed {
                return last;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test]
async fn responses_framed_both_ways_or_switching_unasked_are_502_and_discarded() {
    let backend = RawBackend::start(odd_answers).await;
    // `/switch` on a WebSocket route too: a request that asked for no upgrade is not one.
    let routes = "  - name: ws\n    match: { path: /switch }\n    upstream: app\n    \
                  websocket: true\n  - name: all\n    upstream: app\n";
    let proxy = TestProxy::start(&yaml(backend.addr, "", routes));
    for path in ["/both", "/switch"] {
        let mut c = Raw::open(proxy.addr()).await;
        c.send(format!("GET {path} HTTP/1.1\r\nHost: a\r\n\r\n").as_bytes())
            .await;
        let r = c.response().await;
        assert_eq!(r.status, 502, "{path}: {r:?}");
        assert!(
            !lossy(&r.body).contains("hello"),
            "nothing of the upstream's body: {r:?}"
        );
        // The client's connection stays usable (the upstream was at fault)...
        c.send(b"GET /fine HTTP/1.1\r\nHost: a\r\n\r\n").await;
        assert_eq!(
            c.response().await.status,
            200,
            "{path}: then a good request"
        );
        // ...and the upstream connection of the bad response was closed, never reused.
        assert!(
            discarded_after(&backend, path).await,
            "{path}: the upstream connection was kept: {:?}",
            backend
                .connections()
                .iter()
                .map(|c| (
                    c.requests
                        .iter()
                        .map(|r| lossy(&r[..16]))
                        .collect::<Vec<_>>(),
                    c.closed
                ))
                .collect::<Vec<_>>()
        );
    }
}

#[tokio::test]
async fn a_long_request_line_is_414_whatever_its_length() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", CATCH_ALL));
    // 9 KiB fits hyper's buffer (screening's 414); 70 KiB and 1 MiB do not (the request line
    // watch's); both over the default max_uri_bytes of 8 KiB.
    for len in [9 << 10, 70 << 10, 1 << 20] {
        let mut c = Raw::open(proxy.addr()).await;
        let head = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "a".repeat(len));
        c.send_some(head.as_bytes()).await;
        let r = c.response().await;
        assert_eq!(r.status, 414, "{len} bytes: {r:?}");
        assert_eq!(r.header("connection"), Some("close"), "{r:?}");
        assert_eq!(r.body, b"URI Too Long\n");
        assert!(c.closed_clean(WAIT).await, "{len} bytes: still open");
    }
    // On a kept-alive connection, after a request with a body.
    let mut c = Raw::open(proxy.addr()).await;
    c.send(b"POST /first HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc")
        .await;
    assert_eq!(c.response().await.status, 200);
    let head = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "b".repeat(70 << 10));
    c.send_some(head.as_bytes()).await;
    assert_eq!(c.response().await.status, 414);
    assert_eq!(backend.requests().len(), 1, "only /first was forwarded");
    // A long header line is not a request line: 431 past the head limit, fine below it.
    let mut c = Raw::open(proxy.addr()).await;
    let big = format!(
        "GET /x HTTP/1.1\r\nHost: a\r\nX-Big: {}\r\n\r\n",
        "c".repeat(60 << 10)
    );
    c.send(big.as_bytes()).await;
    assert_eq!(c.response().await.status, 200);
    let mut c = Raw::open(proxy.addr()).await;
    let bigger = format!(
        "GET /x HTTP/1.1\r\nHost: a\r\nX-Big: {}\r\n\r\n",
        "c".repeat(70 << 10)
    );
    c.send_some(bigger.as_bytes()).await;
    assert_eq!(c.response().await.status, 431);
    // A body that looks like a long request line is a body.
    let mut c = Raw::open(proxy.addr()).await;
    let body = format!("GET /{}", "d".repeat(20 << 10));
    c.send(
        format!(
            "POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(c.response().await.status, 200);
    assert_eq!(backend.requests().len(), 3);
}

/// Answers a WebSocket handshake with `101`; then, as a tunnel's far end, reads whatever
/// comes through as requests and answers them `200 ok`.
fn switching(head: &[u8]) -> Vec<u8> {
    if find(&head.to_ascii_lowercase(), b"upgrade: websocket").is_some() {
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"
            .to_vec()
    } else {
        ok_answer(head)
    }
}

/// Once a connection is a tunnel, its bytes are not request heads: a long line through it is
/// the backend's, not a `414`.
#[tokio::test]
async fn a_tunnels_bytes_are_not_request_lines() {
    let backend = RawBackend::start(switching).await;
    let routes = "  - name: ws\n    upstream: app\n    websocket: true\n";
    let proxy = TestProxy::start(&yaml(backend.addr, "", routes));
    let mut c = Raw::open(proxy.addr()).await;
    c.send(
        b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
          Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
    )
    .await;
    assert_eq!(c.response().await.status, 101);
    let line = format!("GET /{} HTTP/1.1\r\nHost: a\r\n\r\n", "t".repeat(20 << 10));
    c.send(line.as_bytes()).await;
    let r = c.response().await;
    assert_eq!(r.status, 200, "through the tunnel: {r:?}");
    assert!(backend.wait_for(2).await);
    assert!(backend.requests()[1].starts_with(b"GET /ttt"));
}
