//! Buffered responses that cannot spill to a file are never cut short: with `temp_dir` gone,
//! or `buffering.max_spill` bytes already in files, a download a client reads slowly arrives
//! whole, streamed with backpressure, counted in the metrics; a request body that needs a file
//! past the cap gets `503` with nothing sent upstream.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{config, find_sample, Http, MockUpstream, TestProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn yaml(up: &MockUpstream, buffering: &str) -> String {
    config(&format!(
        "admin: {{ address: 127.0.0.1:0 }}\nbuffering: {{ memory_per_body: 16KiB, {buffering} }}\n\
         upstreams:\n  app:\n    targets: [{}]\n    timeout: 30s\n\
         routes:\n  - name: all\n    upstream: app\n",
        up.addr()
    ))
}

/// Ask for `len` bytes and read nothing for a while (the proxy reads the upstream ahead
/// meanwhile), then read it all: the body's length as received.
async fn slow_download(proxy: SocketAddr, len: usize) -> usize {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(proxy).await.unwrap();
    let head = format!("GET /download/{len} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut all))
        .await
        .expect("the download ends")
        .expect("read");
    let at = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head")
        + 4;
    let head = String::from_utf8_lossy(&all[..at]).to_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains(&format!("content-length: {len}")), "{head}");
    all.len() - at
}

#[tokio::test]
async fn a_response_that_cannot_spill_streams_whole_with_backpressure() {
    let up = MockUpstream::start();
    let dir = tempfile::tempdir().unwrap();
    let proxy = TestProxy::start(&yaml(&up, &format!("temp_dir: {}", dir.path().display())));
    // The directory goes away under the running proxy: no file can be made there now.
    let path = dir.path().to_owned();
    drop(dir);
    assert!(!path.exists());
    for _ in 0..3 {
        assert_eq!(slow_download(proxy.addr(), 2 << 20).await, 2 << 20);
    }
    let scrape = proxy.scrape().await;
    let fell_back: u64 = find_sample(&scrape, "tollgate_buffer_spill_unwritable_total").unwrap();
    assert!(fell_back >= 3, "{fell_back}");
}

#[tokio::test]
async fn past_max_spill_responses_stream_and_uploads_get_503() {
    let up = MockUpstream::start();
    let proxy = TestProxy::start(&yaml(&up, "max_spill: 256KiB"));
    // Clients that never read fill the files up to the cap.
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut s = socket.connect(proxy.addr()).await.unwrap();
        s.write_all(b"GET /download/4194304 HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        stalled.push(s);
    }
    assert!(
        common::eventually(Duration::from_secs(10), || async {
            let scrape = proxy.scrape().await;
            find_sample::<u64>(&scrape, "tollgate_buffer_spill_capped_total").unwrap_or(0) > 0
        })
        .await,
        "the cap was reached"
    );
    let scrape = proxy.scrape().await;
    let spilled: u64 = find_sample(&scrape, "tollgate_buffer_spilled_bytes").unwrap();
    // Responses take at most three quarters of the cap: the rest is kept for uploads.
    assert!(spilled <= 192 << 10, "{spilled} bytes in files");
    // Another download arrives whole, streamed with backpressure.
    assert_eq!(slow_download(proxy.addr(), 1 << 20).await, 1 << 20);
    // An upload that fits the quarter kept for request bodies goes through.
    let upload = common::client::upload(&proxy.url("/up"), 48 << 10);
    assert_eq!(Http::new().send(upload).await.code(), 200);
    // One past it is refused before the upstream sees anything: 503, or, if the proxy
    // closed while the body was still coming, a connection the client sees end.
    let seen = up.count();
    let answer = upload_past_the_cap(proxy.addr(), 1 << 20).await;
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 503"),
        "{answer}"
    );
    assert_eq!(up.count(), seen);
    // The stalled clients leave: their files go, and an upload fits again.
    drop(stalled);
    assert!(
        common::eventually(Duration::from_secs(10), || async {
            find_sample::<u64>(&proxy.scrape().await, "tollgate_buffer_spilled_bytes") == Some(0)
        })
        .await
    );
    let upload = common::client::upload(&proxy.url("/up"), 200 << 10);
    assert_eq!(Http::new().send(upload).await.code(), 200);
}

/// POST `len` bytes to `/up` on a socket of its own, ignoring a refused write, and return what
/// came back (empty if nothing did).
async fn upload_past_the_cap(proxy: SocketAddr, len: usize) -> String {
    let mut stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let head = format!("POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: {len}\r\n\r\n");
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(&vec![b'u'; len]).await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut got)).await;
    String::from_utf8_lossy(&got).into_owned()
}
