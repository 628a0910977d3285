//! Shutdown faults, on the binary (signals belong to a process): `/readyz` answering 503 for
//! the whole shutdown instead of vanishing, `shutdown_delay` (listeners keep accepting while
//! readiness fails), a second SIGTERM or SIGINT stopping at once, and keep-alive connections
//! that race the signal: a request whose head had started is answered (`Connection: close`),
//! an idle connection is closed cleanly.

use crate::common;

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{config, upstream_app, BinaryProxy, Http, MockUpstream, Raw};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// No test here may take longer than this, whatever the proxy does.
const TEST_TIMEOUT: Duration = Duration::from_secs(30);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test did not finish in time")
}

/// An admin listener, `/fast` answered by the proxy, everything else forwarded to `up`;
/// `extra` top-level keys first.
fn proxy_for(up: &MockUpstream, extra: &str) -> BinaryProxy {
    BinaryProxy::start(&config(&format!(
        "{extra}admin:\n  address: 127.0.0.1:0\n{}routes:\n  - name: fast\n    \
         match: {{ path: /fast }}\n    respond: {{ status: 200 }}\n  - name: r\n    upstream: app\n",
        upstream_app(up.addr(), "10s")
    )))
}

/// `GET /readyz` on a fresh connection: the status and body, or `None` if refused.
async fn readyz(admin: SocketAddr) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(admin).await.ok()?;
    s.write_all(b"GET /readyz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.ok()?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    Some((code, body))
}

/// Whether a TCP connect to `addr` is refused now.
async fn refuses(addr: SocketAddr) -> bool {
    matches!(TcpStream::connect(addr).await, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_answers_503_through_the_drain() {
    bounded(async {
        let up = MockUpstream::start();
        let mut proxy = proxy_for(&up, "");
        let admin = proxy.admin_addr();
        assert_eq!(readyz(admin).await.map(|r| r.0), Some(200));
        let url = proxy.url("/slow/2000");
        let slow = tokio::spawn(async move { Http::new().get(&url).await.code() });
        assert!(up.wait_for(1, Duration::from_secs(5)));

        proxy.terminate();
        let signalled = Instant::now();
        assert!(proxy.wait_for_log("draining in-flight requests", Duration::from_secs(5)));
        // While the slow request drains, the admin listener is still there and says why.
        let mut seen = Vec::new();
        while !slow.is_finished() {
            let r = readyz(admin).await;
            assert!(
                r.is_some(),
                "the admin listener vanished {:?} after SIGTERM, while the drain goes on",
                signalled.elapsed()
            );
            seen.push(r.unwrap_or_default());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(slow.await.expect("the slow request"), 200);
        assert!(seen.len() >= 3, "{seen:?}");
        assert!(
            seen.iter()
                .all(|(code, body)| *code == 503 && body == "not ready: shutting down\n"),
            "{seen:?}"
        );
        let status = proxy.wait_exit(Duration::from_secs(5)).expect("exits");
        assert!(status.success(), "{status:?}");
        assert!(
            readyz(admin).await.is_none(),
            "admin still up after the exit"
        );
        println!(
            "readyz during a 2 s drain: {} probes, all 503 `shutting down`",
            seen.len()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_delay_keeps_accepting_while_readiness_fails() {
    bounded(async {
        let up = MockUpstream::start();
        let mut proxy = proxy_for(&up, "shutdown_delay: 1500ms\n");
        let (addr, admin) = (proxy.addr(), proxy.admin_addr());
        proxy.terminate();
        let signalled = Instant::now();
        assert!(proxy.wait_for_log("still accepting for shutdown_delay", Duration::from_secs(5)));
        // Readiness fails at once...
        let r = readyz(admin).await.expect("the admin listener answers");
        assert_eq!(r, (503, "not ready: shutting down\n".to_owned()));
        // ...while new connections are still served, for the whole delay.
        let mut served = 0;
        while signalled.elapsed() < Duration::from_millis(1200) {
            let mut c = Raw::open(addr).await;
            let r = c.roundtrip(&["GET /fast HTTP/1.1", "Host: t"]).await;
            assert_eq!(r.status, 200);
            served += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Then the listeners close and the process exits.
        let refused_at = loop {
            if refuses(addr).await {
                break signalled.elapsed();
            }
            assert!(
                signalled.elapsed() < Duration::from_secs(4),
                "never refused"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(
            refused_at >= Duration::from_millis(1500),
            "refused {refused_at:?} after SIGTERM, within shutdown_delay"
        );
        let status = proxy.wait_exit(Duration::from_secs(3)).expect("exits");
        assert!(status.success(), "{status:?}");
        println!(
            "shutdown_delay 1500 ms: {served} new connections served after SIGTERM, readiness \
             503 at once, listeners refused {} ms after SIGTERM",
            refused_at.as_millis()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_stops_at_once() {
    bounded(async {
        for (signal, code) in [("TERM", 143), ("INT", 130)] {
            let up = MockUpstream::start();
            let mut proxy = proxy_for(&up, "");
            let mut slow = TcpStream::connect(proxy.addr()).await.expect("connect");
            slow.write_all(b"GET /slow/8000 HTTP/1.1\r\nHost: t\r\n\r\n")
                .await
                .expect("send the request");
            assert!(up.wait_for(1, Duration::from_secs(5)));
            proxy.signal(signal);
            assert!(proxy.wait_for_log("draining in-flight requests", Duration::from_secs(5)));
            // Draining the 8 s request; the operator insists.
            proxy.signal(signal);
            let second = Instant::now();
            let status = proxy
                .wait_exit(Duration::from_secs(2))
                .unwrap_or_else(|| panic!("still draining after a second SIG{signal}"));
            let took = second.elapsed();
            assert_eq!(status.code(), Some(code), "SIG{signal} twice: {status:?}");
            assert!(proxy.logs().iter().any(|l| l.contains("second signal")));
            println!(
                "second SIG{signal} during the drain: exited {} ms later, status {code}",
                took.as_millis()
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_under_way_at_sigterm_is_answered() {
    bounded(async {
        let up = MockUpstream::start();
        let mut proxy = proxy_for(&up, "");
        let mut conn = Raw::open(proxy.addr()).await;
        let r = conn.roundtrip(&["GET /fast HTTP/1.1", "Host: t"]).await;
        assert_eq!(r.status, 200);
        // The next request on the kept-alive connection is under way when the signal lands.
        conn.send(b"GET /fast HTTP/1.1\r\nHost: t\r\n").await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        proxy.terminate();
        tokio::time::sleep(Duration::from_millis(300)).await;
        conn.send(b"\r\n").await;
        let r = conn.response().await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("connection"), Some("close"), "{:?}", r.headers);
        assert!(conn.is_closed().await);
        let status = proxy.wait_exit(Duration::from_secs(3)).expect("exits");
        assert!(status.success(), "{status:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_cleanly() {
    bounded(async {
        let up = MockUpstream::start();
        let mut proxy = proxy_for(&up, "");
        let mut conn = TcpStream::connect(proxy.addr()).await.expect("connect");
        conn.write_all(b"GET /fast HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .expect("write");
        let mut buf = vec![0u8; 4096];
        let n = conn.read(&mut buf).await.expect("a response");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        proxy.terminate();
        assert!(proxy.wait_for_log("draining in-flight requests", Duration::from_secs(5)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        // A client that sends its next request before it has read the close: the request
        // crosses the proxy's FIN. It must see that close (end of file), not a reset.
        conn.write_all(b"GET /fast HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let read = conn.read(&mut buf).await;
        assert!(matches!(read, Ok(0)), "{read:?}");
        // And a second write still finds the proxy's side open, draining: no reset yet.
        let again = conn.write_all(b"x").await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        let again_read = conn.read(&mut buf).await;
        assert!(
            again.is_ok() && matches!(again_read, Ok(0)),
            "{again:?} {again_read:?}"
        );
        drop(conn);
        let status = proxy.wait_exit(Duration::from_secs(3)).expect("exits");
        assert!(status.success(), "{status:?}");
    })
    .await;
}
