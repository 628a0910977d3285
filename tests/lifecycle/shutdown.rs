//! Graceful shutdown end to end: on SIGTERM (or SIGINT) the proxy stops accepting at once, lets
//! slow in-flight requests (HTTP/1.1 and HTTP/2) finish, closes idle keep-alive connections, and
//! exits 0 as soon as nothing is left in flight.
//!
//! Signals and exit statuses belong to a process: every proxy here is the binary (`BinaryProxy`).

use crate::common;

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{config, upstream_app, BinaryProxy, Http, MockUpstream, Raw};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// No test here may take longer than this, whatever the proxy does.
const TEST_TIMEOUT: Duration = Duration::from_secs(20);

/// How long the upstream takes to answer the in-flight requests.
const SLOW_MS: u64 = 1500;

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test did not finish in time")
}

/// Everything forwarded to `up` (5 s timeout), except `/fast`, answered by the proxy.
fn proxy_for(up: &MockUpstream) -> BinaryProxy {
    BinaryProxy::start(&config(&format!(
        "{}routes:\n  - name: fast\n    match: {{ path: /fast }}\n    respond: {{ status: 200 }}\n  \
         - name: r\n    upstream: app\n",
        upstream_app(up.addr(), "5s")
    )))
}

/// Poll until a TCP connect to `addr` is refused; the time that took from `since`.
async fn refused(addr: SocketAddr, since: Instant, within: Duration) -> Duration {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    loop {
        match TcpStream::connect(addr).await {
            Err(e) if e.kind() == ConnectionRefused => return since.elapsed(),
            // The kernel completed a handshake into a listener's backlog just as the listener
            // closed, and reset it: the listener is going away, not yet gone. Try again.
            Err(e) if matches!(e.kind(), ConnectionReset | ConnectionAborted) => {}
            Err(e) => panic!("connect to {addr}: {e}"),
            Ok(accepted) => drop(accepted),
        }
        assert!(
            since.elapsed() < within,
            "{addr} still accepts connections {within:?} after the signal"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_slow_in_flight_requests_and_refuses_new_connections() {
    bounded(async {
        let up = MockUpstream::start();
        let mut proxy = proxy_for(&up);
        let addr = proxy.addr();
        let url = proxy.url(&format!("/slow/{SLOW_MS}"));
        let (h1, h2) = (Http::new(), Http::h2c());
        let (u1, u2) = (url.clone(), url);
        let started = Instant::now();
        let in_flight = [
            tokio::spawn(async move { (h1.get(&u1).await, Instant::now()) }),
            tokio::spawn(async move { (h2.get(&u2).await, Instant::now()) }),
        ];
        assert!(
            up.wait_for(2, Duration::from_secs(5)),
            "the requests never reached the upstream"
        );

        proxy.terminate();
        let signalled = Instant::now();
        let refused_after = refused(addr, signalled, Duration::from_secs(1)).await;
        assert!(
            in_flight.iter().all(|t| !t.is_finished()),
            "new connections must be refused while the slow requests are still in flight"
        );

        let mut finished = Vec::new();
        for (task, version) in in_flight.into_iter().zip(["HTTP/1.1", "HTTP/2"]) {
            let (r, at) = task.await.expect("the request task");
            assert_eq!(r.code(), 200, "{version} in-flight request");
            assert_eq!(r.text(), "slow\n", "{version}");
            assert!(
                at.duration_since(started) >= Duration::from_millis(SLOW_MS),
                "{version}: answered before the upstream did"
            );
            finished.push(at);
        }
        let last_answer = finished.into_iter().max().expect("two answers");

        let status = proxy
            .wait_exit(Duration::from_secs(5))
            .expect("tollgate exits once the drain is over");
        let exited = signalled.elapsed();
        assert!(status.success(), "exit status {status:?}");
        assert!(
            exited < Duration::from_millis(SLOW_MS + 2000),
            "exit took {exited:?} after SIGTERM"
        );
        let logs = proxy.logs();
        assert!(logs.iter().any(|l| l.contains("shutting down")));
        assert!(logs.iter().any(|l| l.contains("stopped")));
        assert!(!logs.iter().any(|l| l.contains("drain timed out")));
        println!(
            "shutdown: connections refused {} ms after SIGTERM; in-flight requests answered {} ms \
             after SIGTERM; process exited {} ms after SIGTERM ({} ms after the last answer)",
            refused_after.as_millis(),
            last_answer.duration_since(signalled).as_millis(),
            exited.as_millis(),
            exited
                .saturating_sub(last_answer.duration_since(signalled))
                .as_millis(),
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_are_closed_and_the_exit_is_prompt() {
    bounded(async {
        let up = MockUpstream::start();
        let mut proxy = proxy_for(&up);
        // A connection that never sends a byte. The accept loop takes connections in order, so
        // once the next one is served, this one is accepted and waiting for its first request.
        let silent = TcpStream::connect(proxy.addr()).await.expect("connect");
        let mut idle = Raw::open(proxy.addr()).await;
        let r = idle.roundtrip(&["GET /fast HTTP/1.1", "Host: t"]).await;
        assert_eq!(r.status, 200);

        proxy.terminate();
        let signalled = Instant::now();
        let closed = tokio::time::timeout(Duration::from_secs(2), idle.is_closed())
            .await
            .expect("the idle keep-alive connection is closed promptly");
        assert!(closed);
        let status = proxy
            .wait_exit(Duration::from_secs(2))
            .expect("with nothing in flight, the exit is prompt");
        assert!(status.success(), "exit status {status:?}");
        println!(
            "shutdown with only idle connections: exited {} ms after SIGTERM",
            signalled.elapsed().as_millis()
        );
        drop(silent);
        assert_eq!(up.count(), 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_shutdown_timeout_cuts_a_request_that_outlasts_it() {
    bounded(async {
        let up = MockUpstream::start();
        let mut proxy = proxy_for(&up);
        // Started with the default (30 s); the reloaded value is the one shutdown uses.
        let yaml = std::fs::read_to_string(proxy.config_path()).expect("read the config");
        std::fs::write(
            proxy.config_path(),
            format!("shutdown_timeout: 300ms\n{yaml}"),
        )
        .expect("edit the config");
        assert!(
            proxy.wait_for_log("config reloaded generation=2", Duration::from_secs(5)),
            "{:#?}",
            proxy.logs()
        );
        let mut conn = TcpStream::connect(proxy.addr()).await.expect("connect");
        conn.write_all(b"GET /slow/5000 HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .expect("send the request");
        assert!(
            up.wait_for(1, Duration::from_secs(5)),
            "the request never reached the upstream"
        );

        proxy.terminate();
        let signalled = Instant::now();
        let status = proxy
            .wait_exit(Duration::from_secs(3))
            .expect("the drain stops at shutdown_timeout");
        let exited = signalled.elapsed();
        assert!(status.success(), "exit status {status:?}");
        assert!(
            exited >= Duration::from_millis(300),
            "exited {exited:?} after SIGTERM, before shutdown_timeout"
        );
        assert!(proxy.logs().iter().any(|l| l.contains("drain timed out")));
        // The cut request got no response, just the end of its connection.
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(2), conn.read_to_end(&mut answer))
            .await
            .expect("the connection is closed")
            .ok();
        assert!(answer.is_empty(), "{:?}", String::from_utf8_lossy(&answer));
        println!(
            "shutdown with a request outlasting shutdown_timeout=300ms: exited {} ms after SIGTERM",
            exited.as_millis()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_also_shuts_down_cleanly() {
    bounded(async {
        let up = MockUpstream::start();
        let mut proxy = proxy_for(&up);
        assert_eq!(Http::new().get(&proxy.url("/fast")).await.code(), 200);
        proxy.signal("INT");
        let status = proxy
            .wait_exit(Duration::from_secs(2))
            .expect("tollgate exits on SIGINT");
        assert!(status.success(), "exit status {status:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_tls_handshake_does_not_hold_up_the_exit() {
    bounded(async {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let rcgen::CertifiedKey { cert, signing_key } =
            rcgen::generate_simple_self_signed(vec!["a.test".to_owned()]).expect("a certificate");
        let (crt, key) = (dir.path().join("a.crt"), dir.path().join("a.key"));
        std::fs::write(&crt, cert.pem()).expect("write the certificate");
        std::fs::write(&key, signing_key.serialize_pem()).expect("write the key");
        let mut proxy = BinaryProxy::start(&format!(
            "listeners:\n  - address: 127.0.0.1:0\n    tls: {{ cert: {}, key: {} }}\n\
             routes:\n  - name: r\n    respond: {{ status: 200 }}\n",
            crt.display(),
            key.display()
        ));
        // A client that connects and never sends its ClientHello.
        let stalled = TcpStream::connect(proxy.addr()).await.expect("connect");
        // The accept loop takes connections in order: once a later one is served, the stalled
        // one has been accepted and its handshake is pending.
        let served = TcpStream::connect(proxy.addr()).await.expect("connect");
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.der().clone()).expect("a trust anchor");
        let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from("a.test").expect("a name");
        let served = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
            .connect(name, served)
            .await
            .expect("a TLS handshake");
        drop(served);

        proxy.terminate();
        let signalled = Instant::now();
        let exited = proxy.wait_exit(Duration::from_secs(3));
        let took = signalled.elapsed();
        drop(stalled);
        let status = exited.unwrap_or_else(|| {
            panic!(
                "still running {took:?} after SIGTERM: a connection that never sent a \
                 ClientHello, with no request in flight, holds up the shutdown"
            )
        });
        assert!(status.success(), "exit status {status:?}");
    })
    .await;
}
