//! Legacy backends behind the proxy (in-process, real sockets): a thread-per-request backend
//! with a small pool stays responsive under slow uploaders and clients that never read, because
//! request and response bodies are buffered; an HTTP/1.0 backend keeps the client's HTTP/1.1
//! keep-alive and receives uploads with a Content-Length; a client that takes no bytes is cut
//! off by the send timeout. Each buffering test has its control: the same load with buffering
//! off pins the backend.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{config, TestProxy};
use common::{Http, Raw};
use tokio::io::AsyncWriteExt;

/// A backend of `threads` threads, each serving one connection at a time to its end, as a
/// thread-per-request server does: a slow client of such a server holds one of its threads.
struct LegacyBackend {
    addr: SocketAddr,
    /// Requests answered completely.
    answered: Arc<AtomicUsize>,
    /// The head of every request received, as text.
    heads: Arc<Mutex<Vec<String>>>,
}

/// How the backend speaks.
#[derive(Clone, Copy, PartialEq)]
enum Speaks {
    /// HTTP/1.1 with Content-Length, one request per connection.
    Http11,
    /// HTTP/1.0: a body delimited by closing the connection; `411` for a chunked upload.
    Http10,
}

impl LegacyBackend {
    fn start(threads: usize, speaks: Speaks) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the backend");
        let addr = listener.local_addr().expect("backend address");
        let listener = Arc::new(listener);
        let answered = Arc::new(AtomicUsize::new(0));
        let heads = Arc::new(Mutex::new(Vec::new()));
        for _ in 0..threads {
            let (listener, answered, heads) = (listener.clone(), answered.clone(), heads.clone());
            std::thread::spawn(move || {
                while let Ok((stream, _)) = listener.accept() {
                    if serve_one(stream, speaks, &heads).is_ok() {
                        answered.fetch_add(1, Ordering::SeqCst);
                    }
                }
            });
        }
        Self {
            addr,
            answered,
            heads,
        }
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

/// Serve one request: `/big` is 4 MiB, `/huge` 64 MiB, anything else `ok`. Blocking reads and
/// writes.
fn serve_one(stream: TcpStream, speaks: Speaks, heads: &Mutex<Vec<String>>) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    heads.lock().unwrap().push(head.clone());
    let lower = head.to_ascii_lowercase();
    let mut out = stream;
    if speaks == Speaks::Http10 && lower.contains("transfer-encoding: chunked") {
        out.write_all(b"HTTP/1.0 411 Length Required\r\n\r\n")?;
        return Ok(());
    }
    let length = lower
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let (chunk, times): (Vec<u8>, usize) = if head.starts_with("GET /big ") {
        (vec![b'x'; 64 << 10], 64)
    } else if head.starts_with("GET /huge ") {
        (vec![b'x'; 64 << 10], 1024)
    } else {
        (format!("ok {length}\n").into_bytes(), 1)
    };
    match speaks {
        Speaks::Http11 => write!(
            out,
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            chunk.len() * times
        )?,
        Speaks::Http10 => out.write_all(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")?,
    }
    for _ in 0..times {
        out.write_all(&chunk)?;
    }
    out.flush()
}

fn yaml(backend: SocketAddr, buffering: &str) -> String {
    config(&format!(
        "upstreams:
  legacy:
    targets: [{backend}]
    connect_timeout: 1s
    timeout: 2s
routes:
  - name: all
    upstream: legacy
    buffering: {buffering}
"
    ))
}

/// Open `n` connections that start an upload of 10 bytes and send one byte each second.
async fn slow_uploaders(proxy: SocketAddr, n: usize) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let mut conn = Raw::open(proxy).await;
        conn.send(b"POST /upload HTTP/1.1\r\nHost: legacy\r\nContent-Length: 10\r\n\r\n")
            .await;
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                conn.send(b"x").await;
            }
            let _ = conn.response().await;
        }));
    }
    tasks
}

#[tokio::test]
async fn slow_uploaders_do_not_pin_the_backend_threads() {
    let backend = LegacyBackend::start(2, Speaks::Http11);
    let admin = "admin: { address: 127.0.0.1:0 }\n";
    let proxy = TestProxy::start(&format!(
        "{}{admin}",
        yaml(backend.addr, "{ request: true }")
    ));
    let uploads = slow_uploaders(proxy.addr(), 4).await;
    // The four uploads are under way at the proxy before the GETs go.
    let open = || async {
        common::find_sample::<u64>(&proxy.scrape().await, "tollgate_open_connections") == Some(4)
    };
    assert!(
        common::eventually(Duration::from_secs(5), open).await,
        "4 uploads connected"
    );
    let http = Http::new();
    for _ in 0..4 {
        let r = http.get(&proxy.url("/")).await;
        assert_eq!(r.code(), 200, "a GET behind slow uploaders: {}", r.text());
    }
    for t in uploads {
        t.await.unwrap();
    }
    // Each upload reached the backend whole, in one piece, with its length.
    let posts: Vec<String> = backend
        .heads()
        .into_iter()
        .filter(|h| h.starts_with("POST"))
        .collect();
    assert_eq!(posts.len(), 4);
    assert!(posts
        .iter()
        .all(|h| h.to_ascii_lowercase().contains("content-length: 10")));
}

#[tokio::test]
async fn without_request_buffering_slow_uploaders_pin_the_backend() {
    let backend = LegacyBackend::start(2, Speaks::Http11);
    let proxy = TestProxy::start(&yaml(backend.addr, "{ request: false }"));
    let _uploads = slow_uploaders(proxy.addr(), 4).await;
    let pinned = || async { backend.heads().len() >= 2 };
    assert!(
        common::eventually(Duration::from_secs(5), pinned).await,
        "uploads reached the backend"
    );
    let r = Http::new().get(&proxy.url("/")).await;
    assert_eq!(r.code(), 504, "both backend threads wait on uploads");
}

/// Open `n` connections that ask for `path` and never read.
async fn non_readers(proxy: SocketAddr, n: usize, path: &str) -> Vec<tokio::net::TcpStream> {
    let mut held = Vec::new();
    for _ in 0..n {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        // A small receive buffer, so the proxy's writes to this client stall at once.
        socket.set_recv_buffer_size(4096).unwrap();
        let mut stream = socket.connect(proxy).await.unwrap();
        let request_head = format!("GET {path} HTTP/1.1\r\nHost: legacy\r\n\r\n");
        stream.write_all(request_head.as_bytes()).await.unwrap();
        held.push(stream);
    }
    held
}

#[tokio::test]
async fn clients_that_never_read_do_not_hold_the_backend() {
    let backend = LegacyBackend::start(2, Speaks::Http11);
    let proxy = TestProxy::start(&yaml(backend.addr, "{ response: true }"));
    let _held = non_readers(proxy.addr(), 4, "/big").await;
    // The backend finishes all four 4 MiB answers: the proxy read them ahead.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while backend.answered.load(Ordering::SeqCst) < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the backend is still writing to clients that do not read"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = Http::new().get(&proxy.url("/")).await;
    assert_eq!(r.code(), 200);
}

#[tokio::test]
async fn without_response_buffering_non_readers_hold_the_backend() {
    let backend = LegacyBackend::start(2, Speaks::Http11);
    let proxy = TestProxy::start(&yaml(backend.addr, "{ response: false }"));
    let _held = non_readers(proxy.addr(), 2, "/huge").await;
    let stuck = || async { backend.heads().len() >= 2 };
    assert!(
        common::eventually(Duration::from_secs(5), stuck).await,
        "both downloads started"
    );
    let r = Http::new().get(&proxy.url("/")).await;
    assert_eq!(r.code(), 504, "both backend threads are stuck writing");
}

#[tokio::test]
async fn an_http10_backend_keeps_the_clients_keep_alive() {
    let backend = LegacyBackend::start(2, Speaks::Http10);
    let proxy = TestProxy::start(&yaml(backend.addr, "{ request: true, response: true }"));
    // Three answers on one client connection: each backend answer ended with its connection.
    let mut conn = Raw::open(proxy.addr()).await;
    for _ in 0..3 {
        let r = conn
            .roundtrip(&["GET /small HTTP/1.1", "Host: legacy"])
            .await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, b"ok 0\n");
        assert_eq!(r.header("content-length"), Some("5"));
        assert_ne!(r.header("connection"), Some("close"));
    }
    let r = Http::new().get(&proxy.url("/small")).await;
    assert_eq!(
        r.version,
        http::Version::HTTP_11,
        "the status line the client sees"
    );
}

#[tokio::test]
async fn an_http10_backend_gets_chunked_uploads_with_a_length() {
    let backend = LegacyBackend::start(2, Speaks::Http10);
    let proxy = TestProxy::start(&yaml(backend.addr, "{ request: true }"));
    let mut conn = Raw::open(proxy.addr()).await;
    conn.send(
        b"POST /form HTTP/1.1\r\nHost: legacy\r\nTransfer-Encoding: chunked\r\n\r\n\
          4\r\nabcd\r\n3\r\nefg\r\n0\r\n\r\n",
    )
    .await;
    let r = conn.response().await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.body, b"ok 7\n");
    let head = backend.heads().pop().unwrap().to_ascii_lowercase();
    assert!(head.contains("content-length: 7"), "{head}");
    assert!(!head.contains("transfer-encoding"), "{head}");
}

/// Streamed routes never send `Transfer-Encoding` to a server that may speak only HTTP/1.0
/// (RFC 9112 6.1): a chunked upload is received whole and sent with its length until the
/// upstream has answered in HTTP/1.1, on a fresh connection and on a kept-alive one alike.
#[tokio::test]
async fn an_http10_backend_without_buffering_gets_chunked_uploads_with_a_length() {
    let backend = LegacyBackend::start(2, Speaks::Http10);
    let proxy = TestProxy::start(&yaml(backend.addr, "{ request: false }"));
    let mut conn = Raw::open(proxy.addr()).await;
    for _ in 0..2 {
        conn.send(
            b"POST /form HTTP/1.1\r\nHost: legacy\r\nTransfer-Encoding: chunked\r\n\r\n\
              4\r\nabcd\r\n0\r\n\r\n",
        )
        .await;
        let r = conn.response().await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.body, b"ok 4\n", "the backend read the whole upload");
    }
    for head in backend.heads().iter().filter(|h| h.starts_with("POST")) {
        let head = head.to_ascii_lowercase();
        assert!(head.contains("content-length: 4"), "{head}");
        assert!(!head.contains("transfer-encoding"), "{head}");
    }
}

/// Once the upstream has answered in HTTP/1.1, a streamed route's chunked upload goes as it
/// arrives, chunked.
#[tokio::test]
async fn an_http11_backend_gets_streamed_uploads_chunked() {
    let upstream = common::MockUpstream::start();
    let proxy = TestProxy::start(&config(&format!(
        "{}routes:\n  - name: all\n    upstream: app\n    buffering: {{ request: false }}\n",
        common::upstream_app(upstream.addr(), "5s")
    )));
    assert_eq!(Http::new().get(&proxy.url("/")).await.code(), 200);
    let mut conn = Raw::open(proxy.addr()).await;
    conn.send(
        b"POST /echo HTTP/1.1\r\nHost: legacy\r\nTransfer-Encoding: chunked\r\n\r\n\
          4\r\nabcd\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(conn.response().await.status, 200);
    let seen = upstream.last();
    assert_eq!(seen.header("transfer-encoding"), "chunked");
}

#[tokio::test]
async fn a_client_that_takes_no_bytes_is_cut_off_by_the_send_timeout() {
    let backend = LegacyBackend::start(2, Speaks::Http11);
    let yaml = yaml(backend.addr, "{ response: true }").replace(
        "  - address: 127.0.0.1:0\n",
        "  - address: 127.0.0.1:0\n    timeouts: { send: 1s }\nadmin: { address: 127.0.0.1:0 }\n",
    );
    let proxy = TestProxy::start(&yaml);
    // 64 MiB: more than the kernel's socket buffers can take in for a client that reads
    // nothing.
    let mut held = non_readers(proxy.addr(), 1, "/huge").await;
    let mut stream = held.pop().unwrap();
    // Read nothing until the proxy has dropped the connection (its open-connection gauge back
    // at 0) or 30 s have passed; then everything: the proxy closed the connection before the
    // answer was all written. Waiting on the proxy, not a fixed time, keeps this true on a
    // machine busy with the whole suite, where reading 64 MiB ahead into a file can take
    // longer than the stall itself.
    let http = Http::new();
    let metrics = format!("http://{}/metrics", proxy.admin_addr());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut open = 1;
    while open > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        open = common::find_sample(http.get(&metrics).await.text(), "tollgate_open_connections")
            .unwrap_or(1);
    }
    let mut got = Vec::new();
    let read = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut got),
    )
    .await;
    assert!(
        read.is_ok(),
        "the proxy never closed the stalled connection ({} bytes arrived)",
        got.len()
    );
    assert!(
        got.len() < 64 << 20,
        "the whole answer arrived ({} bytes): no send timeout",
        got.len()
    );
    let r = http.get(&proxy.url("/")).await;
    assert_eq!(r.code(), 200);
}

#[tokio::test]
async fn large_bodies_go_through_files_intact() {
    let backend = LegacyBackend::start(2, Speaks::Http11);
    let proxy = TestProxy::start(&yaml(backend.addr, "{ request: true, response: true }"));
    let r = Http::new().get(&proxy.url("/big")).await;
    assert_eq!(r.code(), 200);
    assert_eq!(r.body.len(), 4 << 20);
    assert!(r.body.iter().all(|&b| b == b'x'));
    let upload = common::client::upload(&proxy.url("/up"), 3 << 20);
    let r = Http::new().send(upload).await;
    assert_eq!(r.text(), format!("ok {}\n", 3 << 20));
}

/// 200 clients ask for 1 MiB each and read nothing, all at once: the proxy's memory stays
/// bounded (memory per body, the proxy-wide cap, files beyond), where streaming would keep
/// each response's data in flight in the proxy. Prints both figures.
#[tokio::test]
async fn memory_stays_bounded_under_200_stalled_downloads() {
    const CLIENTS: usize = 200;
    let up = common::MockUpstream::start();
    let mut grown = Vec::new();
    for buffering in ["true", "false"] {
        let proxy = common::BinaryProxy::start(&config(&format!(
            "upstreams:\n  app:\n    targets: [{}]\n    timeout: 30s\n\
             routes:\n  - name: all\n    upstream: app\n    buffering: {{ response: {buffering} }}\n",
            up.addr()
        )));
        let before = proxy.peak_rss_kib();
        let seen = up.count();
        let _held = non_readers(proxy.addr(), CLIENTS, "/download/1048576").await;
        assert!(
            up.wait_for(seen + CLIENTS, Duration::from_secs(30)),
            "the upstream saw {} of {CLIENTS} requests",
            up.count() - seen
        );
        // Let the proxy take in what the upstream and the sockets let it.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let kib = proxy.peak_rss_kib().saturating_sub(before);
        eprintln!(
            "{CLIENTS} stalled 1 MiB downloads, response buffering {buffering}: peak RSS grew \
             {} MiB ({} KiB per download)",
            kib / 1024,
            kib / CLIENTS as u64
        );
        grown.push(kib);
    }
    // About 300 KiB a download in a debug build (hyper's buffers on both sides and the
    // spool's memory part), whatever the response's size.
    assert!(
        grown[0] < 96 * 1024,
        "buffered: the proxy's peak RSS grew by {} MiB for {CLIENTS} stalled downloads",
        grown[0] / 1024
    );
}

/// HTTP/2: a client that keeps its stream's flow-control window shut takes no bytes either,
/// and is cut off by the send timeout just the same.
#[tokio::test]
async fn an_http2_client_with_a_shut_window_is_cut_off_by_the_send_timeout() {
    let backend = LegacyBackend::start(2, Speaks::Http11);
    let yaml = yaml(backend.addr, "{ response: true }").replace(
        "  - address: 127.0.0.1:0\n",
        "  - address: 127.0.0.1:0\n    timeouts: { send: 1s }\n",
    );
    let proxy = TestProxy::start(&yaml);
    let tcp = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    let (client, connection) = h2::client::Builder::new()
        .initial_window_size(0)
        .handshake::<_, bytes::Bytes>(tcp)
        .await
        .expect("an HTTP/2 handshake");
    let connection = tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let req = http::Request::get("http://legacy/big").body(()).unwrap();
    let (response, _) = client.send_request(req, true).unwrap();
    let response = response.await.expect("a response head");
    assert_eq!(response.status(), 200);
    // Never release any window: the proxy cannot send a byte of the body.
    let ended = tokio::time::timeout(Duration::from_secs(20), connection).await;
    assert!(
        ended.is_ok(),
        "the proxy kept a connection whose client takes nothing"
    );
}
