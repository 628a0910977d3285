//! WebSocket upgrades: proxied on routes with `websocket: true`, limited at the handshake, and
//! refused (Upgrade stripped) elsewhere. The backend is a raw socket that answers 101 and
//! echoes, so the test sees exactly what crosses the proxy.
//!
//! The proxies are served in-process (`TestProxy`); the drain test, which signals and waits for
//! the exit, runs the binary (`BinaryProxy`).

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{config, BinaryProxy, TestProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A backend that switches protocols on an Upgrade request, then echoes every byte; without
/// Upgrade it answers a plain 200 saying so.
async fn echo_backend() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let head = read_head(&mut s).await.to_ascii_lowercase();
                if head.contains("upgrade: websocket") {
                    let _ = s
                        .write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
                        .await;
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                } else {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\nno upgrade")
                        .await;
                }
            });
        }
    });
    addr
}

async fn read_head(s: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

fn proxy(backend: SocketAddr) -> TestProxy {
    TestProxy::start(&config(&format!(
        "upstreams:\n  app:\n    targets: [{backend}]\n    timeout: 2s\nroutes:\n  - name: ws\n    match: {{ path_prefix: /ws }}\n    upstream: app\n    websocket: true\n    limits:\n      - {{ name: ws-per-ip, rate: 1/min, burst: 2, key: [ip] }}\n  - name: plain\n    match: {{ path_prefix: / }}\n    upstream: app\n"
    )))
}

const HANDSHAKE: &str = "HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";

async fn handshake(proxy: SocketAddr, path: &str) -> (TcpStream, String) {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(format!("GET {path} {HANDSHAKE}").as_bytes())
        .await
        .unwrap();
    let head = tokio::time::timeout(Duration::from_secs(5), read_head(&mut s))
        .await
        .expect("a response head");
    (s, head)
}

/// Send `bytes` through a tunnel and read them back from the echo backend within `within`.
async fn echo(s: &mut TcpStream, bytes: &[u8], within: Duration, what: &str) {
    s.write_all(bytes)
        .await
        .unwrap_or_else(|e| panic!("{what}: write: {e}"));
    let mut back = vec![0u8; bytes.len()];
    tokio::time::timeout(within, s.read_exact(&mut back))
        .await
        .unwrap_or_else(|_| panic!("{what}: no echo within {within:?}"))
        .unwrap_or_else(|e| panic!("{what}: read: {e}"));
    assert_eq!(back, bytes, "{what}");
}

#[tokio::test]
async fn websocket_is_tunnelled_and_limited_at_the_handshake() {
    let proxy = proxy(echo_backend().await);
    let (mut s, head) = handshake(proxy.addr(), "/ws").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("upgrade: websocket"),
        "{head}"
    );
    echo(&mut s, b"frame bytes", Duration::from_secs(5), "the echo").await;

    let (_second, head) = handshake(proxy.addr(), "/ws").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let (_third, head) = handshake(proxy.addr(), "/ws").await;
    assert!(
        head.starts_with("HTTP/1.1 429"),
        "burst 2: the third handshake is limited: {head}"
    );
    // The open tunnel is not affected by the limit.
    echo(&mut s, b"again", Duration::from_secs(5), "the open tunnel").await;
}

#[tokio::test]
async fn routes_without_websocket_strip_the_upgrade() {
    let proxy = proxy(echo_backend().await);
    let (_s, head) = handshake(proxy.addr(), "/other").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

/// An open tunnel is a connection like any other: it keeps its slot under `max_connections`
/// (a second client is closed at once), and on SIGTERM the drain waits for it, up to
/// `shutdown_timeout`, before the process exits.
#[tokio::test]
async fn an_open_tunnel_keeps_its_connection_slot_and_is_drained() {
    let backend = echo_backend().await;
    let mut proxy = BinaryProxy::start(&format!(
        "listeners:\n  - address: 127.0.0.1:0\n    max_connections: 1\nshutdown_timeout: 1500ms\n\
         upstreams:\n  app:\n    targets: [{backend}]\n    timeout: 2s\nroutes:\n  - name: ws\n    \
         match: {{ path_prefix: /ws }}\n    upstream: app\n    websocket: true\n"
    ));
    let (mut tunnel, head) = handshake(proxy.addr(), "/ws").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    echo(&mut tunnel, b"ping", Duration::from_secs(5), "the tunnel").await;

    // The slot is taken: another connection is accepted by the kernel and closed at once.
    let mut other = TcpStream::connect(proxy.addr()).await.unwrap();
    let _ = other
        .write_all(b"GET /ws HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(5), other.read(&mut buf))
        .await
        .expect("the extra connection is closed in time");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "a second connection was served: {read:?}"
    );

    // SIGTERM: the tunnel still works while the drain waits for it, and is cut at the timeout.
    let sent = std::time::Instant::now();
    proxy.signal("TERM");
    assert!(
        proxy.wait_for_log("shutting down", Duration::from_secs(5)),
        "the drain began"
    );
    let during_drain = "the tunnel answers during the drain";
    echo(&mut tunnel, b"still", Duration::from_secs(2), during_drain).await;
    let status = proxy
        .wait_exit(Duration::from_secs(10))
        .expect("the proxy exits after the drain timeout");
    let took = sent.elapsed();
    assert!(
        took >= Duration::from_millis(1400),
        "exited {took:?} after SIGTERM: the open tunnel was not waited for"
    );
    assert!(status.success(), "{status:?}");
}

/// `timeouts.websocket_idle`: a tunnel with traffic stays open past it; one without is closed.
#[tokio::test]
async fn an_idle_tunnel_is_closed_after_its_timeout() {
    let backend = echo_backend().await;
    let proxy = TestProxy::start(&config(&format!(
        "upstreams:\n  app:\n    targets: [{backend}]\n    timeout: 2s\nroutes:\n  - name: ws\n    \
         match: {{ path_prefix: /ws }}\n    upstream: app\n    websocket: true\n    \
         timeouts: {{ websocket_idle: 400ms }}\n"
    )));
    let (mut tunnel, head) = handshake(proxy.addr(), "/ws").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    // Traffic every 150 ms for 900 ms: more than twice the timeout, never idle for it.
    for _ in 0..6 {
        let in_use = "the tunnel is open while in use";
        echo(&mut tunnel, b"tick", Duration::from_secs(2), in_use).await;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // Then silence: closed after the timeout.
    let started = std::time::Instant::now();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(5), tunnel.read(&mut buf))
        .await
        .expect("the idle tunnel is closed in time");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200),
        "closed after {waited:?}, before its idle timeout"
    );
}

#[tokio::test]
async fn an_open_tunnel_holds_no_slot_of_a_capped_upstream() {
    let backend = echo_backend().await;
    let proxy = TestProxy::start(&config(&format!(
        "upstreams:\n  app:\n    targets: [{backend}]\n    timeout: 2s\n    max_in_flight: 1\n    queue: {{ size: 0 }}\nroutes:\n  - name: ws\n    match: {{ path_prefix: /ws }}\n    upstream: app\n    websocket: true\n"
    )));
    // Two tunnels open at once behind a cap of one, with no queue: the slot goes back at 101.
    let (mut first, head) = handshake(proxy.addr(), "/ws").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let (mut second, head) = handshake(proxy.addr(), "/ws").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    echo(&mut first, b"one", Duration::from_secs(5), "first tunnel").await;
    echo(&mut second, b"two", Duration::from_secs(5), "second tunnel").await;
}
