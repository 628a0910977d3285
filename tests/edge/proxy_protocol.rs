//! PROXY protocol listeners: the balancer's header names the client, only trusted peers may
//! send one, and anything else is closed before a byte of HTTP is read. The proxy is served
//! in-process (`TestProxy`).

use crate::common;

use std::time::Duration;

use common::TestProxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

fn proxy() -> TestProxy {
    TestProxy::start(&format!(
        "listeners:\n  - address: 127.0.0.1:0\n    proxy_protocol: true\ntrusted_proxies: [127.0.0.1/32]\n{}",
        "routes:\n  - name: r\n    respond: { status: 200 }\n    limits:\n      - { name: per-ip, rate: 1/min, burst: 1, key: [ip] }\n"
    ))
}

/// Send `bytes` from `from` and return the status line, or "" if the connection was closed.
async fn send(proxy: &TestProxy, from: &str, bytes: &[u8]) -> String {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut s: TcpStream = socket.connect(proxy.addr()).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

const GET: &str = "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

#[tokio::test]
async fn the_header_names_the_client_that_limits_count() {
    let proxy = proxy();
    let as_client = |ip: &str| format!("PROXY TCP4 {ip} 127.0.0.1 40000 80\r\n{GET}");
    assert_eq!(
        send(&proxy, "127.0.0.1", as_client("192.0.2.7").as_bytes()).await,
        "HTTP/1.1 200 OK"
    );
    assert_eq!(
        send(&proxy, "127.0.0.1", as_client("192.0.2.7").as_bytes()).await,
        "HTTP/1.1 429 Too Many Requests",
        "same client behind the balancer: its bucket is empty"
    );
    assert_eq!(
        send(&proxy, "127.0.0.1", as_client("192.0.2.8").as_bytes()).await,
        "HTTP/1.1 200 OK",
        "another client has its own bucket, though the TCP peer is the same"
    );
}

#[tokio::test]
async fn untrusted_peers_and_missing_headers_are_closed() {
    let proxy = proxy();
    let header = format!("PROXY TCP4 192.0.2.9 127.0.0.1 40000 80\r\n{GET}");
    assert_eq!(
        send(&proxy, "127.0.0.2", header.as_bytes()).await,
        "",
        "untrusted peer"
    );
    assert_eq!(
        send(&proxy, "127.0.0.1", GET.as_bytes()).await,
        "",
        "no header"
    );
}
