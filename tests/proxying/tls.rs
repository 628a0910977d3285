//! TLS listeners end to end, with certificates generated here: ALPN h2 and http/1.1, the
//! certificate chosen by SNI, limits and X-Forwarded-Proto over TLS, a certificate replaced by a
//! SIGHUP reload without a restart, and `tollgate check` naming a missing certificate file.
//!
//! The proxies are served in-process (`TestProxy`), and reload tests wait for its config
//! generation; the SIGHUP test and the test that checks what a reload logged run the binary
//! (`BinaryProxy`).

use crate::common;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, Version};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use common::{upstream_app, BinaryProxy, MockUpstream, TestProxy};

/// No test here may take longer than this, whatever the proxy does.
const TEST_TIMEOUT: Duration = Duration::from_secs(20);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test did not finish in time")
}

/// A certificate written to `NAME.crt` / `NAME.key`, and the DER the server should present.
struct Pem {
    der: CertificateDer<'static>,
    cert: PathBuf,
    key: PathBuf,
}

impl Pem {
    /// A fresh self-signed certificate for `names` (a new key, so a new serial and DER).
    fn generate(dir: &Path, file: &str, names: &[&str]) -> Self {
        let mut cert = Self {
            der: CertificateDer::from(Vec::new()),
            cert: dir.join(format!("{file}.crt")),
            key: dir.join(format!("{file}.key")),
        };
        cert.replace(names);
        cert
    }

    /// Overwrite the files with a new key and certificate for `names`.
    fn replace(&mut self, names: &[&str]) {
        let names: Vec<String> = names.iter().map(ToString::to_string).collect();
        let rcgen::CertifiedKey { cert, signing_key } =
            rcgen::generate_simple_self_signed(names).expect("generate a certificate");
        std::fs::write(&self.key, signing_key.serialize_pem()).expect("write the key");
        std::fs::write(&self.cert, cert.pem()).expect("write the certificate");
        self.der = cert.der().clone();
    }
}

/// Two certificates in a temporary directory: `a` for `a.test` (the default), `b` for `*.b.test`.
struct Certs {
    dir: tempfile::TempDir,
    a: Pem,
    b: Pem,
}

impl Certs {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let a = Pem::generate(dir.path(), "a", &["a.test"]);
        let b = Pem::generate(dir.path(), "b", &["*.b.test"]);
        Self { dir, a, b }
    }

    /// A config with one TLS listener serving `a` by default and `b` by SNI, then `rest`.
    fn config(&self, rest: &str) -> String {
        format!(
            "listeners:\n  - address: 127.0.0.1:0\n    tls:\n      cert: {}\n      key: {}\n      \
             certificates:\n        - {{ cert: {}, key: {} }}\n{rest}",
            self.a.cert.display(),
            self.a.key.display(),
            self.b.cert.display(),
            self.b.key.display(),
        )
    }
}

/// A route answered by the proxy itself, limited per client IP to `burst` requests a minute.
fn respond_route(burst: u32) -> String {
    format!(
        "routes:\n  - name: hello\n    respond: {{ status: 200, body: \"hello\\n\" }}\n    \
         limits:\n      - {{ name: per-ip, rate: 1/min, burst: {burst}, key: [ip] }}\n"
    )
}

/// A TLS handshake with `addr` for `sni`, offering `alpn`, trusting exactly `trusted`.
async fn try_handshake(
    addr: SocketAddr,
    trusted: &[&CertificateDer<'static>],
    sni: &str,
    alpn: &[&[u8]],
) -> std::io::Result<TlsStream<TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    for der in trusted {
        roots.add((*der).clone()).expect("a usable trust anchor");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from(sni.to_owned()).expect("a server name");
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, tcp)
        .await
}

async fn handshake(
    addr: SocketAddr,
    trusted: &[&CertificateDer<'static>],
    sni: &str,
    alpn: &[&[u8]],
) -> TlsStream<TcpStream> {
    try_handshake(addr, trusted, sni, alpn)
        .await
        .unwrap_or_else(|e| panic!("TLS handshake for {sni}: {e}"))
}

/// The leaf certificate the server presented.
fn presented(tls: &TlsStream<TcpStream>) -> CertificateDer<'static> {
    tls.get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.first())
        .expect("the server presented a certificate")
        .clone()
        .into_owned()
}

fn alpn(tls: &TlsStream<TcpStream>) -> Option<&[u8]> {
    tls.get_ref().1.alpn_protocol()
}

/// A response with its body read.
struct Reply {
    res: Response<()>,
    body: Bytes,
}

impl Reply {
    async fn read(res: Response<hyper::body::Incoming>) -> Self {
        let (parts, body) = res.into_parts();
        let body = body.collect().await.expect("read the body").to_bytes();
        Self {
            res: Response::from_parts(parts, ()),
            body,
        }
    }

    fn code(&self) -> u16 {
        self.res.status().as_u16()
    }

    fn header(&self, name: &str) -> &str {
        self.res
            .headers()
            .get(name)
            .unwrap_or_else(|| panic!("no `{name}` in {:?}", self.res.headers()))
            .to_str()
            .expect("a text header")
    }
}

/// HTTP/1.1 on an established TLS connection: send each request in turn on it.
struct H1 {
    send: hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    host: String,
}

impl H1 {
    async fn over(tls: TlsStream<TcpStream>, host: &str) -> Self {
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .expect("HTTP/1.1 handshake");
        tokio::spawn(conn);
        Self {
            send,
            host: host.to_owned(),
        }
    }

    async fn get(&mut self, path: &str) -> Reply {
        self.send.ready().await.expect("the connection is usable");
        let req = Request::get(path)
            .header("host", &self.host)
            .body(Empty::new())
            .expect("a request");
        let res = self
            .send
            .send_request(req)
            .await
            .expect("an HTTP/1.1 reply");
        assert_eq!(res.version(), Version::HTTP_11);
        Reply::read(res).await
    }
}

fn start_with_certs(certs: &Certs, rest: &str) -> TestProxy {
    TestProxy::start(&certs.config(rest))
}

/// `start_with_certs` as the binary: for signals and log lines.
fn binary_with_certs(certs: &Certs, rest: &str) -> BinaryProxy {
    BinaryProxy::start(&certs.config(rest))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alpn_h2_serves_http2_with_rate_limit_headers() {
    bounded(async {
        let certs = Certs::new();
        let proxy = start_with_certs(&certs, &respond_route(5));
        let tls = handshake(
            proxy.addr(),
            &[&certs.a.der],
            "a.test",
            &[b"h2", b"http/1.1"],
        )
        .await;
        assert_eq!(alpn(&tls), Some(&b"h2"[..]), "h2 is preferred");
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .expect("HTTP/2 handshake");
        tokio::spawn(conn);
        for left in [4, 3] {
            let req = Request::get("https://a.test/hi")
                .body(Empty::<Bytes>::new())
                .expect("a request");
            let res = send.send_request(req).await.expect("an HTTP/2 reply");
            assert_eq!(res.version(), Version::HTTP_2);
            let r = Reply::read(res).await;
            assert_eq!(r.code(), 200);
            assert_eq!(&r.body[..], b"hello\n");
            assert_eq!(r.header("ratelimit-policy"), r#""per-ip";q=5;w=300"#);
            assert!(
                r.header("ratelimit")
                    .starts_with(&format!(r#""per-ip";r={left};"#)),
                "{}",
                r.header("ratelimit")
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alpn_http1_only_serves_http1() {
    bounded(async {
        let certs = Certs::new();
        let proxy = start_with_certs(&certs, &respond_route(5));
        let tls = handshake(proxy.addr(), &[&certs.a.der], "a.test", &[b"http/1.1"]).await;
        assert_eq!(alpn(&tls), Some(&b"http/1.1"[..]));
        let mut h1 = H1::over(tls, "a.test").await;
        let r = h1.get("/hi").await;
        assert_eq!(r.code(), 200);
        assert_eq!(&r.body[..], b"hello\n");
        assert_eq!(r.header("ratelimit-policy"), r#""per-ip";q=5;w=300"#);
        // Keep-alive over TLS: the second request on the same connection.
        assert_eq!(h1.get("/hi").await.code(), 200);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sni_chooses_the_certificate() {
    bounded(async {
        let certs = Certs::new();
        let proxy = start_with_certs(&certs, &respond_route(50));
        let both = [&certs.a.der, &certs.b.der];
        for (sni, want, which) in [
            ("a.test", &certs.a.der, "a"),
            ("x.b.test", &certs.b.der, "b"),
            ("X.B.TEST", &certs.b.der, "b"),
        ] {
            let tls = handshake(proxy.addr(), &both, sni, &[b"http/1.1"]).await;
            assert!(
                presented(&tls) == *want,
                "SNI {sni} must get certificate {which}"
            );
            // And the connection serves requests.
            assert_eq!(H1::over(tls, sni).await.get("/").await.code(), 200);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_applies_over_tls_as_over_plain_text() {
    bounded(async {
        let certs = Certs::new();
        let proxy = start_with_certs(&certs, &respond_route(3));
        // Two connections, one per protocol: the bucket is the client's, not the connection's.
        let tls = handshake(proxy.addr(), &[&certs.a.der], "a.test", &[b"http/1.1"]).await;
        let mut h1 = H1::over(tls, "a.test").await;
        let mut codes = Vec::new();
        for _ in 0..2 {
            codes.push(h1.get("/").await.code());
        }
        let tls = handshake(proxy.addr(), &[&certs.a.der], "a.test", &[b"http/1.1"]).await;
        let mut h1 = H1::over(tls, "a.test").await;
        let mut last = None;
        for _ in 0..3 {
            let r = h1.get("/").await;
            codes.push(r.code());
            last = Some(r);
        }
        assert_eq!(codes, [200, 200, 200, 429, 429]);
        let r = last.expect("a reply");
        assert_eq!(r.header("retry-after"), "60");
        assert_eq!(r.header("ratelimit"), r#""per-ip";r=0;t=180"#);
        assert_eq!(r.header("content-type"), "application/problem+json");
        let body: serde_json::Value = serde_json::from_slice(&r.body).expect("a JSON body");
        assert_eq!(body["limit"], "per-ip");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_sees_x_forwarded_proto_https() {
    bounded(async {
        let certs = Certs::new();
        let up = MockUpstream::start();
        let proxy = start_with_certs(
            &certs,
            &format!(
                "{}routes:\n  - name: r\n    upstream: app\n",
                upstream_app(up.addr(), "5s")
            ),
        );
        let tls = handshake(proxy.addr(), &[&certs.a.der], "a.test", &[b"h2"]).await;
        assert_eq!(alpn(&tls), Some(&b"h2"[..]));
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .expect("HTTP/2 handshake");
        tokio::spawn(conn);
        let req = Request::get("https://a.test/via-tls")
            .body(Empty::<Bytes>::new())
            .expect("a request");
        let r = Reply::read(send.send_request(req).await.expect("a reply")).await;
        assert_eq!(r.code(), 200);
        assert_eq!(r.header("x-upstream"), "mock");
        let seen = up.last();
        assert_eq!(seen.uri.path(), "/via-tls");
        assert_eq!(seen.header("x-forwarded-proto"), "https");
        assert_eq!(seen.header("x-forwarded-host"), "a.test");
        assert_eq!(seen.header("x-forwarded-for"), "127.0.0.1");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_a_replaced_certificate_without_a_restart() {
    bounded(async {
        let mut certs = Certs::new();
        let proxy = binary_with_certs(&certs, &respond_route(50));
        let addr = proxy.addr();
        let old = certs.a.der.clone();
        let tls = handshake(addr, &[&old], "a.test", &[b"http/1.1"]).await;
        assert!(presented(&tls) == old);
        // A connection opened before the swap keeps working afterwards.
        let mut before = H1::over(tls, "a.test").await;

        certs.a.replace(&["a.test"]);
        let new = certs.a.der.clone();
        assert!(new != old, "the replacement is a different certificate");
        proxy.signal("HUP");
        assert!(
            proxy.wait_for_log("config reloaded generation=2", Duration::from_secs(5)),
            "no reload after SIGHUP: {:#?}",
            proxy.logs()
        );
        let signalled = Instant::now();
        let deadline = signalled + Duration::from_secs(5);
        loop {
            let tls = handshake(addr, &[&old, &new], "a.test", &[b"http/1.1"]).await;
            if presented(&tls) == new {
                assert_eq!(H1::over(tls, "a.test").await.get("/").await.code(), 200);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the old certificate is still served after the reload"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The other certificate is untouched, and the same process serves on the same port.
        let tls = handshake(addr, &[&certs.b.der], "x.b.test", &[b"http/1.1"]).await;
        assert!(presented(&tls) == certs.b.der);
        assert_eq!(before.get("/").await.code(), 200);
        let logs = proxy.logs();
        let starts = logs
            .iter()
            .filter(|l| l.contains("tollgate started"))
            .count();
        assert_eq!(starts, 1, "no restart: {logs:#?}");
        assert!(certs.dir.path().exists());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_picked_up_without_a_signal() {
    bounded(async {
        let mut certs = Certs::new();
        let proxy = start_with_certs(&certs, &respond_route(50));
        // Each round: a reload of an unrelated change (which also shows the watch is running),
        // then a renewal as cert-manager or certbot does it: new files at the same paths, the
        // config untouched. A renewal that lands just after a reload is lost only some of the
        // time, so do it a few times.
        for round in 1..=5u32 {
            let generation = 2 * u64::from(round);
            std::fs::write(
                proxy.config_path(),
                certs.config(&respond_route(50 + round)),
            )
            .expect("edit the config");
            assert!(
                proxy
                    .wait_for_generation(generation, Duration::from_secs(5))
                    .await,
                "round {round}: still at generation {}",
                proxy.generation()
            );
            let old = certs.a.der.clone();
            certs.a.replace(&["a.test"]);
            let new = certs.a.der.clone();
            let renewed = Instant::now();
            let deadline = renewed + Duration::from_secs(3);
            loop {
                let tls = handshake(proxy.addr(), &[&old, &new], "a.test", &[b"http/1.1"]).await;
                if presented(&tls) == new {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "round {round}: the certificate renewed right after a reload is not served \
                     (generation {})",
                    proxy.generation()
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if round == 1 {
                println!(
                    "certificate renewal picked up {} ms after the files were written",
                    renewed.elapsed().as_millis()
                );
            }
            assert!(
                proxy
                    .wait_for_generation(generation + 1, Duration::from_secs(1))
                    .await
            );
        }
        // No signal did it: an in-process proxy has no SIGHUP handler (the binary's test of
        // this asserted that no SIGHUP was logged), and nothing here calls `reload`.
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_renewed_during_startup_is_not_lost() {
    bounded(async {
        // Renewed as soon as each proxy is listening. The race this guards against is
        // lost only some of the time, so try it on several proxies at once.
        let mut started = Vec::new();
        for _ in 0..12 {
            let mut certs = Certs::new();
            let proxy = start_with_certs(&certs, &respond_route(50));
            let old = certs.a.der.clone();
            certs.a.replace(&["a.test"]);
            started.push((certs, old, proxy));
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut stale = 0;
        for (certs, old, proxy) in &started {
            let left = deadline.saturating_duration_since(Instant::now());
            proxy.wait_for_generation(2, left).await;
            let trusted = [old, &certs.a.der];
            let tls = handshake(proxy.addr(), &trusted, "a.test", &[b"http/1.1"]).await;
            if presented(&tls) != certs.a.der {
                stale += 1;
            }
        }
        assert_eq!(
            stale,
            0,
            "{stale} of {} proxies still serve the certificate replaced right after they started",
            started.len()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_moves_the_tls_listener_keeps_tls_on_the_bound_port() {
    bounded(async {
        let certs = Certs::new();
        // The binary: the test checks the warning the reload logs.
        let proxy = binary_with_certs(&certs, &respond_route(50));
        let addr = proxy.addr();
        let tls = handshake(addr, &[&certs.a.der], "a.test", &[b"http/1.1"]).await;
        assert_eq!(H1::over(tls, "a.test").await.get("/").await.code(), 200);

        // Listener addresses apply after a restart: until then the bound port is the TLS
        // listener it was, whatever the new file says about its address.
        let moved = certs
            .config(&respond_route(50))
            .replacen("127.0.0.1:0", "127.0.0.2:0", 1);
        std::fs::write(proxy.config_path(), moved).expect("edit the config");
        assert!(
            proxy.wait_for_log("config reloaded generation=2", Duration::from_secs(5)),
            "{:#?}",
            proxy.logs()
        );
        assert!(proxy.wait_for_log("apply after a restart", Duration::from_secs(1)));
        match try_handshake(addr, &[&certs.a.der], "a.test", &[b"http/1.1"]).await {
            Ok(tls) => assert!(presented(&tls) == certs.a.der),
            Err(e) => {
                // Show what the port answers instead of a handshake.
                let mut plain = TcpStream::connect(addr).await.expect("connect");
                plain
                    .write_all(b"GET / HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n")
                    .await
                    .expect("write");
                let mut answer = Vec::new();
                let _ =
                    tokio::time::timeout(Duration::from_secs(2), plain.read_to_end(&mut answer))
                        .await;
                panic!(
                    "the TLS port no longer speaks TLS after the reload ({e}); a cleartext \
                     request there gets: {:?}",
                    String::from_utf8_lossy(&answer)
                );
            }
        }
    })
    .await;
}

#[test]
fn check_names_a_missing_certificate_file() {
    let certs = Certs::new();
    let missing = certs.dir.path().join("gone.crt");
    let yaml = certs.config(&respond_route(5)).replace(
        &format!("cert: {}\n", certs.a.cert.display()),
        &format!("cert: {}\n", missing.display()),
    );
    assert!(yaml.contains("gone.crt"));
    let file = certs.dir.path().join("tollgate.yaml");
    std::fs::write(&file, &yaml).expect("write the config");
    let out = common::proxy::run_cli(&["check", "--config", &file.display().to_string()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "check must fail: {stderr}");
    assert!(
        stderr.contains(&format!("cannot read certificate {}", missing.display())),
        "the message names the missing file: {stderr}"
    );
    assert!(stderr.contains("listeners[0].tls"), "{stderr}");

    // `run` refuses the same file, just as fast.
    let mut run = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["run", "--config", &file.display().to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run tollgate");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = run.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = run.kill();
            let _ = run.wait();
            panic!("`tollgate run` started with a missing certificate");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(!status.success());
}
