//! `MockUpstream`: a real hyper HTTP/1.1 server on `127.0.0.1:0`, on its own thread and runtime,
//! that records every request it receives (after reading its whole body) and answers by path:
//!
//! - `/slow/MS`: wait MS milliseconds, then `200 slow`.
//! - `/download/N`: stream N bytes (with a Content-Length), in 64 KiB chunks.
//! - `/upload`: count the request body as it streams in and answer the count.
//! - `/hop`: a response carrying hop-by-hop headers, which a proxy must strip.
//! - `/status/CODE`: an empty response with that status.
//! - `/cost/N`: `200 ok` saying what the request cost in `X-Cost: N` (as an LLM API does).
//! - anything else: `200 ok`.
//!
//! `MockUpstream::h2c()` serves the same over HTTP/2 only, by prior knowledge.

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

/// One request as the upstream received it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    pub uri: Uri,
    pub version: Version,
    pub headers: HeaderMap,
    /// Bytes of body received.
    pub body_len: u64,
    /// The proxy's end of the upstream connection the request came on.
    pub peer: SocketAddr,
}

impl Seen {
    /// One header's value as text; panics with the full header list when it is absent.
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .unwrap_or_else(|| panic!("upstream did not receive `{name}`: {:?}", self.headers))
            .to_str()
            .expect("header is text")
    }
}

/// The requests received so far, and a signal for each new one.
#[derive(Default)]
struct Record {
    seen: Mutex<Vec<Seen>>,
    arrived: Condvar,
}

/// A recording backend; stopped on drop.
pub struct MockUpstream {
    addr: SocketAddr,
    record: Arc<Record>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MockUpstream {
    pub fn start() -> Self {
        Self::serving(false)
    }

    /// The same backend speaking HTTP/2 without TLS (h2c) only.
    pub fn h2c() -> Self {
        Self::serving(true)
    }

    fn serving(h2c: bool) -> Self {
        let std_listener = listen_loopback();
        let addr = std_listener.local_addr().expect("local addr");
        let record = Arc::new(Record::default());
        let (stop, stopped) = oneshot::channel();
        let shared = record.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("mock upstream runtime");
            rt.block_on(serve(std_listener, shared, stopped, h2c));
        });
        Self {
            addr,
            record,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every request received so far, in arrival order (of their body's end).
    pub fn seen(&self) -> Vec<Seen> {
        self.record.seen.lock().unwrap().clone()
    }

    /// How many requests reached the upstream.
    pub fn count(&self) -> usize {
        self.record.seen.lock().unwrap().len()
    }

    /// Block until at least `n` requests have arrived; false after `timeout`.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut seen = self.record.seen.lock().unwrap();
        while seen.len() < n {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            seen = self
                .record
                .arrived
                .wait_timeout(seen, deadline - now)
                .unwrap()
                .0;
        }
        true
    }

    /// The last request received; panics if there was none.
    pub fn last(&self) -> Seen {
        self.record
            .seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("the upstream received no request")
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A nonblocking listener on `127.0.0.1:0` with a backlog of 1024, as tokio's and tollgate's
/// own. std's `TcpListener::bind` queues only 128: a proxy opening 300 upstream connections at
/// once overflows that, the kernel drops the SYNs, and their 1 s retransmit meets the test's
/// 1 s connect timeout as a 504.
fn listen_loopback() -> StdListener {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("mock upstream socket");
    socket
        .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .expect("bind the mock upstream");
    socket.listen(1024).expect("listen");
    socket.set_nonblocking(true).expect("nonblocking");
    socket.into()
}

/// A free loopback address nobody listens on: connecting to it is refused.
pub fn refused_addr() -> SocketAddr {
    let l = StdListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("local addr");
    drop(l);
    addr
}

async fn serve(
    listener: StdListener,
    record: Arc<Record>,
    mut stopped: oneshot::Receiver<()>,
    h2c: bool,
) {
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(_) => continue,
            },
        };
        let record = record.clone();
        let service = service_fn(move |req| handle(req, peer, record.clone()));
        tokio::spawn(async move {
            let io = TokioIo::new(stream);
            let _ = if h2c {
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(io, service)
                    .await
            } else {
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await
            };
        });
    }
}

type MockBody = Either<Full<Bytes>, Zeros>;

async fn handle(
    req: Request<Incoming>,
    peer: SocketAddr,
    record: Arc<Record>,
) -> Result<Response<MockBody>, hyper::Error> {
    let (parts, mut body) = req.into_parts();
    let mut body_len = 0u64;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame?.data_ref() {
            body_len += data.len() as u64;
        }
    }
    let path = parts.uri.path().to_owned();
    record.seen.lock().unwrap().push(Seen {
        method: parts.method,
        uri: parts.uri,
        version: parts.version,
        headers: parts.headers,
        body_len,
        peer,
    });
    record.arrived.notify_all();
    let text = |s: String| Either::Left(Full::new(Bytes::from(s)));
    let res = if let Some(ms) = after(&path, "/slow/") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap_or(10_000))).await;
        Response::new(text("slow\n".into()))
    } else if let Some(n) = after(&path, "/download/") {
        Response::new(Either::Right(Zeros::new(n.parse().expect("/download/N"))))
    } else if path.ends_with("/upload") {
        Response::new(text(body_len.to_string()))
    } else if path.ends_with("/hop") {
        Response::builder()
            .header("connection", "x-up-secret")
            .header("x-up-secret", "1")
            .header("keep-alive", "timeout=5")
            .header("proxy-authenticate", "Basic realm=\"up\"")
            .header("upgrade", "websocket")
            .header("trailer", "x-checksum")
            .header("x-up-kept", "yes")
            .body(text("hop\n".into()))
            .expect("response")
    } else if path.ends_with("/close") {
        // hyper closes the connection after this response.
        Response::builder()
            .header("connection", "close")
            .body(text("bye\n".into()))
            .expect("response")
    } else if let Some(units) = after(&path, "/cost/") {
        Response::builder()
            .header("x-cost", units)
            .body(text("ok\n".into()))
            .expect("response")
    } else if let Some(code) = after(&path, "/status/") {
        let mut r = Response::new(text(String::new()));
        *r.status_mut() = StatusCode::from_u16(code.parse().expect("/status/CODE")).expect("code");
        r
    } else {
        Response::builder()
            .header("x-upstream", "mock")
            .body(text("ok\n".into()))
            .expect("response")
    };
    Ok(res)
}

/// What follows `marker` in `path`.
fn after<'a>(path: &'a str, marker: &str) -> Option<&'a str> {
    path.find(marker).map(|i| &path[i + marker.len()..])
}

/// A body of `left` bytes generated on the fly in 64 KiB chunks: large transfers without
/// holding them in memory. With `exact`, the length is announced (Content-Length); without,
/// it is sent chunked.
pub struct Zeros {
    left: u64,
    exact: bool,
    chunk: Bytes,
}

impl Zeros {
    pub fn new(len: u64) -> Self {
        Self {
            left: len,
            exact: true,
            chunk: Bytes::from(vec![b'x'; 64 * 1024]),
        }
    }

    /// The same bytes, length not announced (chunked transfer encoding).
    pub fn chunked(len: u64) -> Self {
        Self {
            exact: false,
            ..Self::new(len)
        }
    }
}

impl Body for Zeros {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = self.left.min(self.chunk.len() as u64);
        self.left -= n;
        let data = self.chunk.slice(..n as usize);
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        if self.exact {
            SizeHint::with_exact(self.left)
        } else {
            SizeHint::default()
        }
    }
}
