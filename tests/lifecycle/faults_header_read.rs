//! `timeouts.header_read` against a slowloris, on real sockets: a fresh connection's first
//! head must be complete within one `header_read` of the connection's start, however late its
//! first byte; on a kept-alive connection the next head has `header_read` from its first byte
//! (the idle time before it is `timeouts.idle`'s), however long the connection sat idle first.
//! The proxy is served in-process.

use crate::common;

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::TestProxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// No test here may take longer than this, whatever the proxy does.
const TEST_TIMEOUT: Duration = Duration::from_secs(20);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test did not finish in time")
}

/// A listener with `header_read: 1s` answering every request itself.
fn proxy() -> TestProxy {
    TestProxy::start(
        "listeners:\n  - address: 127.0.0.1:0\n    timeouts: { header_read: 1s, idle: 10s }\n\
         routes:\n  - name: r\n    respond: { status: 200 }\n",
    )
}

/// Trickle a request head that never ends into `conn`, a byte every 100 ms, until the proxy
/// drops the connection; the instant it did (its end of file or reset).
async fn trickle_until_dropped(mut conn: TcpStream) -> Instant {
    let head =
        b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut buf = [0u8; 1024];
    for byte in head.iter().cycle() {
        if conn.write_all(&[*byte]).await.is_err() {
            return Instant::now();
        }
        match tokio::time::timeout(Duration::from_millis(100), conn.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return Instant::now(),
            Ok(Ok(n)) => panic!(
                "a response to a head that never ended: {:?}",
                String::from_utf8_lossy(&buf[..n])
            ),
            Err(_) => {}
        }
    }
    unreachable!("the head is endless")
}

async fn connect(addr: SocketAddr) -> (TcpStream, Instant) {
    let conn = TcpStream::connect(addr).await.expect("connect");
    (conn, Instant::now())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_connection_gets_one_header_read_however_late_its_first_byte() {
    bounded(async {
        let proxy = proxy();
        let (conn, opened) = connect(proxy.addr()).await;
        // Silent for most of the timeout, then a byte at a time.
        tokio::time::sleep(Duration::from_millis(900)).await;
        let dropped = trickle_until_dropped(conn).await.duration_since(opened);
        assert!(
            dropped < Duration::from_millis(1500),
            "held {dropped:?} with header_read 1s: the first byte restarted the clock"
        );
        assert!(
            dropped >= Duration::from_millis(950),
            "dropped early: {dropped:?}"
        );
        println!(
            "slowloris, first byte at 900 ms: dropped {} ms after the connection opened \
             (header_read 1000 ms)",
            dropped.as_millis()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_gets_header_read_from_its_next_heads_first_byte() {
    bounded(async {
        let proxy = proxy();
        let (mut conn, _) = connect(proxy.addr()).await;
        conn.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 1024];
        let n = conn.read(&mut buf).await.expect("a response");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        // Idle for longer than header_read (within `idle`), then a slow head: it has its own
        // header_read from its first byte, not until the idle deadline.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let first_byte = Instant::now();
        let dropped = trickle_until_dropped(conn).await.duration_since(first_byte);
        assert!(
            dropped >= Duration::from_millis(950) && dropped < Duration::from_millis(1500),
            "dropped {dropped:?} after the next head's first byte (header_read 1s)"
        );
        println!(
            "slowloris on a kept-alive connection idle 1500 ms: dropped {} ms after its first byte",
            dropped.as_millis()
        );
    })
    .await;
}
