//! Helpers of the `edge_*` tests: a raw backend that records the exact bytes of every request
//! and answers with canned bytes, raw HTTP/2 frames, the proxy configs they share, and the raw
//! client of `common::raw`.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout_at, Instant};

/// Request bodies both ways upstream: `/buffered` (the default), everything else streamed
/// (`buffering.request: false`).
pub const BUFFERED_AND_STREAMED: &str = "  - name: buffered
    match: { path_prefix: /buffered }
    upstream: app
  - name: streamed
    upstream: app
    buffering: { request: false }
";

#[allow(unused_imports)]
pub use crate::common::raw::{find, lossy, Raw, Resp, WAIT};

/// One connection the `RawBackend` accepted: the exact bytes of each request on it, and
/// whether the proxy has closed it.
#[derive(Debug, Clone, Default)]
pub struct BackendConn {
    pub requests: Vec<Vec<u8>>,
    pub closed: bool,
}

type Answer = Arc<dyn Fn(&[u8]) -> Vec<u8> + Send + Sync>;

/// A backend that reads each request (head, and a body framed by Content-Length or chunked
/// coding), records its exact bytes, and answers with `answer(head)`, as bytes.
pub struct RawBackend {
    pub addr: SocketAddr,
    conns: Arc<Mutex<Vec<Arc<Mutex<BackendConn>>>>>,
}

/// `200 ok`, framed by its length.
pub fn ok_answer(_head: &[u8]) -> Vec<u8> {
    b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n".to_vec()
}

impl RawBackend {
    pub async fn start(answer: impl Fn(&[u8]) -> Vec<u8> + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let conns: Arc<Mutex<Vec<Arc<Mutex<BackendConn>>>>> = Arc::default();
        let all = conns.clone();
        let answer: Answer = Arc::new(answer);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let record = Arc::new(Mutex::new(BackendConn::default()));
                all.lock().unwrap().push(record.clone());
                tokio::spawn(serve(stream, record, answer.clone()));
            }
        });
        Self { addr, conns }
    }

    /// Every connection so far, in the order they were accepted.
    pub fn connections(&self) -> Vec<BackendConn> {
        self.conns
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.lock().unwrap().clone())
            .collect()
    }

    /// Every request received so far, across connections.
    pub fn requests(&self) -> Vec<Vec<u8>> {
        self.connections()
            .into_iter()
            .flat_map(|c| c.requests)
            .collect()
    }

    /// The head of the last request, as text; panics if there was none.
    pub fn last_head(&self) -> String {
        let last = self
            .requests()
            .pop()
            .expect("the backend received no request");
        let end = find(&last, b"\r\n\r\n").map_or(last.len(), |i| i + 4);
        String::from_utf8_lossy(&last[..end]).into_owned()
    }

    /// Wait until `n` requests have arrived; false at the deadline.
    pub async fn wait_for(&self, n: usize) -> bool {
        let deadline = Instant::now() + WAIT;
        while self.requests().len() < n {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }
}

async fn serve(mut stream: TcpStream, record: Arc<Mutex<BackendConn>>, answer: Answer) {
    let mut buf = Vec::new();
    loop {
        let Some(request) = read_request(&mut stream, &mut buf).await else {
            break;
        };
        let head_end = find(&request, b"\r\n\r\n").map_or(request.len(), |i| i + 4);
        let reply = answer(&request[..head_end]);
        record.lock().unwrap().requests.push(request);
        if stream.write_all(&reply).await.is_err() {
            break;
        }
    }
    record.lock().unwrap().closed = true;
}

/// One request's bytes, head and body; `None` at the end of the connection.
async fn read_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let head_end = loop {
        if let Some(i) = find(buf, b"\r\n\r\n") {
            break i + 4;
        }
        read_more(stream, buf).await?;
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let header = |name: &str| {
        head.split("\r\n")
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
    };
    let end = if let Some(len) = header("content-length:") {
        let len: usize = len.parse().unwrap_or(0);
        while buf.len() < head_end + len {
            read_more(stream, buf).await?;
        }
        head_end + len
    } else if header("transfer-encoding:").is_some_and(|t| t.contains("chunked")) {
        loop {
            if let Some(i) = find(&buf[head_end..], b"0\r\n\r\n") {
                break head_end + i + 5;
            }
            read_more(stream, buf).await?;
        }
    } else {
        head_end
    };
    Some(buf.drain(..end).collect())
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 8192];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}

/// A config with one listener, one upstream `app` at `backend`, `top` extra top-level keys
/// and `routes` the items of `routes:`.
pub fn yaml(backend: SocketAddr, top: &str, routes: &str) -> String {
    format!(
        "listeners:\n  - address: 127.0.0.1:0\nupstreams:\n  app:\n    targets: [{backend}]\n    \
         connect_timeout: 1s\n    timeout: 5s\n{top}routes:\n{routes}"
    )
}

/// A catch-all route forwarding everything to `app`, unlimited.
pub const CATCH_ALL: &str = "  - name: all\n    upstream: app\n";

/// HTTP/2 by hand: the client preface and an empty SETTINGS frame.
pub const H2_PREFACE: &[u8] =
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// A HEADERS frame (END_STREAM, END_HEADERS) on stream 1 whose HPACK block is `block`.
pub fn h2_headers(block: &[u8]) -> Vec<u8> {
    let len = u32::try_from(block.len()).expect("a small block");
    let mut frame = len.to_be_bytes()[1..].to_vec();
    frame.extend_from_slice(&[0x01, 0x05, 0, 0, 0, 1]);
    frame.extend_from_slice(block);
    frame
}

/// An HPACK field `name: value`, the name from the static table (`index`), not indexed.
pub fn hpack_literal(index: u8, value: &str) -> Vec<u8> {
    assert!(index < 16 && value.len() < 127);
    let mut out = vec![index, u8::try_from(value.len()).unwrap()];
    out.extend_from_slice(value.as_bytes());
    out
}

/// `:method GET`, `:scheme http`, `:path /` from the static table.
pub const HPACK_GET_ROOT: [u8; 3] = [0x82, 0x86, 0x84];

/// The frames in `bytes` whose 9-byte header is complete: (type, stream, payload), the payload
/// `None` when it is cut short (the walk ends there).
fn frames(bytes: &[u8]) -> impl Iterator<Item = (u8, u32, Option<&[u8]>)> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        if rest.len() < 9 {
            return None;
        }
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        let (kind, stream) = (
            rest[3],
            u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]),
        );
        let payload = rest.get(9..9 + len);
        rest = rest.get(9 + len..).unwrap_or_default();
        Some((kind, stream, payload))
    })
}

/// The `:status` of the first response HEADERS frame on stream 1 among `frames`: 200, 400,
/// 404 and 500 are static-table indexes; any other status is `Some(0)`.
pub fn h2_status(bytes: &[u8]) -> Option<u16> {
    for (kind, stream, payload) in frames(bytes) {
        let payload = payload?;
        if kind == 1 && stream == 1 {
            return match payload.first()? {
                0x88 => Some(200),
                0x8c => Some(400),
                0x8d => Some(404),
                0x8e => Some(500),
                _ => Some(0),
            };
        }
    }
    None
}

/// Whether stream 1 was reset (RST_STREAM): h2 refuses some malformed requests so, before
/// they become requests at all.
pub fn h2_reset(bytes: &[u8]) -> bool {
    frames(bytes).any(|(kind, stream, _)| kind == 3 && stream == 1)
}

/// Send one raw HTTP/2 request (an HPACK block) on a new connection; the frames that came back.
pub async fn h2_exchange(addr: SocketAddr, block: &[u8]) -> Vec<u8> {
    let mut c = Raw::open(addr).await;
    c.send(H2_PREFACE).await;
    c.send(&h2_headers(block)).await;
    // Settings ack, so the server does not wait for it.
    c.send(&[0, 0, 0, 0x04, 0x01, 0, 0, 0, 0]).await;
    let deadline = Instant::now() + WAIT;
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while h2_status(&got).is_none() && !h2_reset(&got) && Instant::now() < deadline {
        match timeout_at(deadline, c.stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&chunk[..n]),
            _ => break,
        }
    }
    got
}
