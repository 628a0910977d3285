//! HTTP/2 attacks on a plain-text (h2c prior knowledge) listener, written as raw frames so the
//! client can do what well-behaved libraries refuse to: open more streams than the server
//! allows, reset every stream right after opening it (rapid reset, CVE-2023-44487), and send a
//! header block that never ends (CONTINUATION flood, CVE-2024-27316 and relatives).
//!
//! The proxies are served in-process (`TestProxy`); the floods, which judge the proxy by how
//! much its peak memory grows, run the binary (`BinaryProxy`), whose peak RSS is its own.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::client::{h2c_to, request};
use common::{config, upstream_app, BinaryProxy, Http, MockUpstream, TestProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};

const WAIT: Duration = Duration::from_secs(5);

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;

const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
const REFUSED_STREAM: u32 = 0x7;
const CANCEL: u32 = 0x8;

/// A proxy forwarding everything to `up`.
fn proxy(up: &MockUpstream) -> TestProxy {
    TestProxy::start(&forward_all(up))
}

/// The binary forwarding everything to `up`, for the tests that read its peak memory.
fn binary(up: &MockUpstream) -> BinaryProxy {
    BinaryProxy::start(&forward_all(up))
}

fn forward_all(up: &MockUpstream) -> String {
    config(&format!(
        "{}routes:\n  - name: all\n    upstream: app\n",
        upstream_app(up.addr(), "5s")
    ))
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = Vec::with_capacity(9 + payload.len());
    f.extend_from_slice(&len.to_be_bytes()[1..]);
    f.push(kind);
    f.push(flags);
    f.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK header block for `GET path` (static-table names, literal values, no Huffman).
fn get_block(path: &str) -> Vec<u8> {
    assert!(path.len() < 127);
    let mut b = vec![0x82, 0x86]; // :method GET, :scheme http
    b.push(0x04); // :path, literal without indexing
    b.push(path.len() as u8);
    b.extend_from_slice(path.as_bytes());
    b.push(0x01); // :authority, literal without indexing
    b.push(6);
    b.extend_from_slice(b"h2.tst");
    b
}

/// One frame as received.
#[derive(Debug)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

impl Frame {
    fn u32_at(&self, i: usize) -> u32 {
        u32::from_be_bytes(self.payload[i..i + 4].try_into().expect("4 bytes"))
    }
}

/// What the reader task saw: frames, then the end of the connection.
#[derive(Debug)]
enum Event {
    Frame(Frame),
    Closed,
}

/// A raw HTTP/2 connection: frames are written by hand; a task reads every frame the server
/// sends (so the server never blocks on a full socket) and passes them on.
struct H2 {
    write: OwnedWriteHalf,
    events: mpsc::UnboundedReceiver<Event>,
    closed: bool,
}

impl H2 {
    /// Connect, send the preface and empty SETTINGS, and return the server's SETTINGS once
    /// acknowledged.
    async fn handshake(addr: SocketAddr) -> (Self, Vec<(u16, u32)>) {
        let stream = timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("connect timed out")
            .expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (mut read, write) = stream.into_split();
        let (tx, events) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut head = [0u8; 9];
            loop {
                if read.read_exact(&mut head).await.is_err() {
                    break;
                }
                let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                let mut payload = vec![0; len];
                if read.read_exact(&mut payload).await.is_err() {
                    break;
                }
                let f = Frame {
                    kind: head[3],
                    flags: head[4],
                    stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
                    payload,
                };
                if tx.send(Event::Frame(f)).is_err() {
                    return;
                }
            }
            let _ = tx.send(Event::Closed);
        });
        let mut h2 = Self {
            write,
            events,
            closed: false,
        };
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        h2.send(&hello).await.expect("send the preface");
        let deadline = Instant::now() + WAIT;
        let settings = loop {
            match h2.next(deadline).await {
                Some(f) if f.kind == SETTINGS && f.flags & ACK == 0 => break f,
                Some(_) => {}
                None => panic!("the server closed before its SETTINGS"),
            }
        };
        let values = settings
            .payload
            .chunks_exact(6)
            .map(|c| {
                (
                    u16::from_be_bytes([c[0], c[1]]),
                    u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
                )
            })
            .collect();
        h2.send(&frame(SETTINGS, ACK, 0, &[]))
            .await
            .expect("ack SETTINGS");
        (h2, values)
    }

    async fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match timeout(WAIT, self.write.write_all(bytes)).await {
            Ok(r) => r,
            Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
        }
    }

    /// The next frame, or `None` once the connection is closed; panics at `deadline`.
    async fn next(&mut self, deadline: Instant) -> Option<Frame> {
        self.try_next(deadline)
            .await
            .unwrap_or_else(|| panic!("no frame from the server in time"))
    }

    /// `None` at the deadline, `Some(None)` once closed.
    async fn try_next(&mut self, deadline: Instant) -> Option<Option<Frame>> {
        if self.closed {
            return Some(None);
        }
        match tokio::time::timeout_at(deadline, self.events.recv()).await {
            Err(_) => None,
            Ok(Some(Event::Frame(f))) => Some(Some(f)),
            Ok(Some(Event::Closed) | None) => {
                self.closed = true;
                Some(None)
            }
        }
    }

    /// The next frame of `kind`, skipping the others; panics if none comes by `deadline`.
    async fn next_of(&mut self, kind: u8, deadline: Instant) -> Frame {
        loop {
            let f = self.try_next(deadline).await.flatten();
            match f {
                Some(f) if f.kind == kind => return f,
                Some(_) => {}
                None => panic!("no frame of type {kind} by the deadline"),
            }
        }
    }

    /// Read until a GOAWAY or the end of the connection, up to `deadline`: the GOAWAY's
    /// error code (`Some(None)`: closed without one), `None` if the connection stayed open.
    async fn goaway(&mut self, deadline: Instant) -> Option<Option<u32>> {
        loop {
            match self.try_next(deadline).await {
                None => return None,
                Some(None) => return Some(None),
                Some(Some(f)) if f.kind == GOAWAY => return Some(Some(f.u32_at(4))),
                Some(Some(_)) => {}
            }
        }
    }
}

/// The proxy at `addr` is still serving: an HTTP/1.1 and an HTTP/2 client each get a 200.
async fn still_serving(addr: SocketAddr) {
    let r = timeout(WAIT, Http::new().get(&format!("http://{addr}/after")))
        .await
        .expect("HTTP/1.1 client timed out");
    assert_eq!(r.code(), 200);
    let r = timeout(
        WAIT,
        h2c_to(
            addr,
            request("GET", &format!("http://{addr}/after-h2"), &[]),
        ),
    )
    .await
    .expect("HTTP/2 client timed out");
    assert_eq!(r.code(), 200);
}

/// The server announces 100 concurrent streams and refuses the 101st while 100 are open.
#[tokio::test]
async fn max_concurrent_streams_is_100_and_enforced() {
    let up = MockUpstream::start();
    let proxy = proxy(&up);
    let (mut h2, settings) = H2::handshake(proxy.addr()).await;
    let max = settings
        .iter()
        .find(|(id, _)| *id == SETTINGS_MAX_CONCURRENT_STREAMS)
        .map(|(_, v)| *v);
    assert_eq!(max, Some(100), "server SETTINGS: {settings:?}");
    // 101 streams at once, each held open by a slow upstream answer.
    let mut burst = Vec::new();
    for i in 0..101u32 {
        burst.extend(frame(
            HEADERS,
            END_STREAM | END_HEADERS,
            1 + 2 * i,
            &get_block("/slow/2000"),
        ));
    }
    h2.send(&burst).await.expect("send 101 streams");
    let deadline = Instant::now() + WAIT;
    let last = 1 + 2 * 100;
    let refused = loop {
        match h2.next(deadline).await {
            Some(f) if f.kind == RST_STREAM && f.stream == last => break f.u32_at(0),
            Some(f) if f.kind == GOAWAY => {
                panic!(
                    "GOAWAY (code {}) instead of refusing one stream",
                    f.u32_at(4)
                )
            }
            Some(f) if f.kind == HEADERS && f.stream == last => {
                panic!("the 101st concurrent stream was answered")
            }
            Some(_) => {}
            None => panic!("connection closed instead of refusing one stream"),
        }
    };
    assert_eq!(
        refused, REFUSED_STREAM,
        "RST_STREAM code for the 101st stream"
    );
    // The first 100 are served (after the slow upstream), the 101st never went upstream.
    let mut answered = 0;
    let deadline = Instant::now() + WAIT;
    while answered < 100 {
        match h2.next(deadline).await {
            Some(f) if f.kind == HEADERS => answered += 1,
            Some(f) if f.kind == RST_STREAM => panic!("stream {} reset: {f:?}", f.stream),
            Some(_) => {}
            None => panic!("closed after {answered} answers"),
        }
    }
    assert_eq!(up.count(), 100);
}

/// Rapid reset: 2000 streams, each reset right after it is opened, on one connection, to a
/// route that forwards to a slow upstream. The server closes the connection (GOAWAY) or at
/// least keeps serving others, within bounded memory.
#[tokio::test]
async fn a_rapid_reset_flood_is_cut_off_and_memory_stays_bounded() {
    const STREAMS: u32 = 2000;
    let up = MockUpstream::start();
    let proxy = binary(&up);
    still_serving(proxy.addr()).await;
    let baseline = proxy.peak_rss_kib();
    let (mut h2, _) = H2::handshake(proxy.addr()).await;
    let block = get_block("/slow/1000");
    let mut sent = 0;
    'flood: for batch in 0..STREAMS / 100 {
        let mut bytes = Vec::new();
        for i in 0..100 {
            let id = 1 + 2 * (batch * 100 + i);
            bytes.extend(frame(HEADERS, END_STREAM | END_HEADERS, id, &block));
            bytes.extend(frame(RST_STREAM, 0, id, &CANCEL.to_be_bytes()));
        }
        if h2.send(&bytes).await.is_err() {
            break 'flood;
        }
        sent += 100;
    }
    let ended = h2.goaway(Instant::now() + Duration::from_secs(2)).await;
    eprintln!(
        "rapid reset: {sent} streams sent, server: {ended:?} (Some(Some(code)): GOAWAY, \
         Some(None): closed, None: still open), upstream saw {} requests, peak RSS {} KiB \
         (baseline {baseline} KiB)",
        up.count(),
        proxy.peak_rss_kib()
    );
    still_serving(proxy.addr()).await;
    let grown = proxy.peak_rss_kib().saturating_sub(baseline);
    assert!(grown < 64 * 1024, "peak RSS grew by {grown} KiB");
}

/// The issue asks for a guard that closes a connection whose client resets most of the
/// streams it opens, including streams already being proxied.
#[tokio::test]
async fn a_rapid_reset_flood_ends_in_goaway() {
    let up = MockUpstream::start();
    let proxy = proxy(&up);
    let (mut h2, _) = H2::handshake(proxy.addr()).await;
    let block = get_block("/slow/1000");
    let mut bytes = Vec::new();
    for i in 0..2000u32 {
        let id = 1 + 2 * i;
        bytes.extend(frame(HEADERS, END_STREAM | END_HEADERS, id, &block));
        bytes.extend(frame(RST_STREAM, 0, id, &CANCEL.to_be_bytes()));
    }
    let _ = h2.send(&bytes).await;
    let ended = h2.goaway(Instant::now() + Duration::from_secs(2)).await;
    assert!(
        ended.is_some(),
        "2000 streams opened and reset at once: the connection stayed open ({} reached the \
         upstream)",
        up.count()
    );
}

/// A rapid reset paced so every stream is accepted and proxied before its reset arrives:
/// the case hyper's pending-accept cap does not see.
#[tokio::test]
async fn a_paced_reset_of_proxied_streams_ends_in_goaway() {
    let up = MockUpstream::start();
    let proxy = proxy(&up);
    let (mut h2, _) = H2::handshake(proxy.addr()).await;
    let block = get_block("/slow/1000");
    let deadline = Instant::now() + Duration::from_secs(6);
    let mut ended = None;
    let mut opened = 0;
    for i in 0..400u32 {
        let id = 1 + 2 * i;
        if h2
            .send(&frame(HEADERS, END_STREAM | END_HEADERS, id, &block))
            .await
            .is_err()
        {
            break;
        }
        opened += 1;
        // Reset once the request is upstream (it is being proxied).
        while up.count() < opened as usize && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if h2
            .send(&frame(RST_STREAM, 0, id, &CANCEL.to_be_bytes()))
            .await
            .is_err()
        {
            break;
        }
        if let Some(Some(f)) = h2.try_next(Instant::now()).await {
            if f.kind == GOAWAY {
                ended = Some(Some(f.u32_at(4)));
                break;
            }
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    if ended.is_none() {
        ended = h2.goaway(Instant::now() + Duration::from_secs(1)).await;
    }
    let conns: std::collections::HashSet<SocketAddr> = up.seen().iter().map(|s| s.peer).collect();
    assert!(
        ended.is_some(),
        "{opened} streams proxied then reset one by one: the connection stayed open; the \
         upstream received {} requests on {} connections",
        up.count(),
        conns.len()
    );
}

/// A header block that never ends: HEADERS without END_HEADERS, then CONTINUATION frames of
/// 16 KB each. The server closes the connection long before 32 MB, within bounded memory.
#[tokio::test]
async fn a_continuation_flood_is_cut_off() {
    let up = MockUpstream::start();
    let proxy = binary(&up);
    still_serving(proxy.addr()).await;
    let baseline = proxy.peak_rss_kib();
    let before = up.count();
    let (mut h2, _) = H2::handshake(proxy.addr()).await;
    // Literal header fields without indexing, new name: `x-flood: aaa...` (100 bytes).
    let mut field = vec![0x00, 7];
    field.extend_from_slice(b"x-flood");
    field.push(100);
    field.extend_from_slice(&[b'a'; 100]);
    let fragment = field.repeat(16_000 / field.len());
    let mut sent = 0usize;
    let _ = h2
        .send(&frame(HEADERS, END_STREAM, 1, &get_block("/flood")))
        .await;
    let started = Instant::now();
    for _ in 0..2000 {
        let mut batch = Vec::new();
        for _ in 0..16 {
            batch.extend(frame(CONTINUATION, 0, 1, &fragment));
        }
        if h2.send(&batch).await.is_err() {
            break;
        }
        sent += batch.len();
        if sent >= 32 << 20 || started.elapsed() > Duration::from_secs(5) {
            break;
        }
        if let Some(Some(f)) = h2.try_next(Instant::now()).await {
            if f.kind == GOAWAY || f.kind == RST_STREAM {
                eprintln!("continuation flood: {f:?} after {sent} bytes");
                if f.kind == GOAWAY {
                    break;
                }
            }
        }
    }
    let ended = h2.goaway(Instant::now() + Duration::from_secs(2)).await;
    eprintln!(
        "continuation flood: {sent} bytes sent, server: {ended:?}, peak RSS {} KiB (baseline \
         {baseline} KiB)",
        proxy.peak_rss_kib()
    );
    assert!(
        ended.is_some(),
        "{sent} bytes of one header block: the connection stayed open"
    );
    assert!(sent < 32 << 20, "the server read 32 MB of one header block");
    assert_eq!(up.count(), before, "{:?}", up.seen());
    still_serving(proxy.addr()).await;
    let grown = proxy.peak_rss_kib().saturating_sub(baseline);
    assert!(grown < 64 * 1024, "peak RSS grew by {grown} KiB");
}

/// DATA on a stream the server never saw is a connection error; the server must not crash.
#[tokio::test]
async fn frames_for_unknown_streams_do_not_crash_the_server() {
    let up = MockUpstream::start();
    let proxy = proxy(&up);
    let (mut h2, _) = H2::handshake(proxy.addr()).await;
    let _ = h2.send(&frame(DATA, END_STREAM, 7, b"junk")).await;
    let ended = h2.goaway(Instant::now() + WAIT).await;
    assert!(ended.is_some(), "DATA on an idle stream was ignored");
    still_serving(proxy.addr()).await;
}

/// A drain over HTTP/2 says so twice, as RFC 9113 6.8 advises: GOAWAY with the last stream
/// ID 2^31-1 (streams the client sent meanwhile are still served), a PING, and, once the
/// client acknowledged it (a round trip later), GOAWAY with the last stream really taken.
#[tokio::test]
async fn a_drain_sends_two_goaways_a_round_trip_apart() {
    const PING: u8 = 0x6;
    let up = MockUpstream::start();
    let proxy = proxy(&up);
    let (mut h2, _) = H2::handshake(proxy.addr()).await;
    h2.send(&frame(
        HEADERS,
        END_STREAM | END_HEADERS,
        1,
        &get_block("/"),
    ))
    .await
    .expect("send a request");
    let deadline = Instant::now() + WAIT;
    // The answer's end: a frame of stream 1 with END_STREAM.
    loop {
        let f = h2.try_next(deadline).await.flatten().expect("the answer");
        if f.stream == 1 && f.flags & END_STREAM != 0 {
            break;
        }
    }
    let drain = tokio::spawn(proxy.shutdown());
    let first = h2.next_of(GOAWAY, deadline).await;
    assert_eq!(first.u32_at(0) & 0x7fff_ffff, 0x7fff_ffff, "{first:?}");
    let ping = h2.next_of(PING, deadline).await;
    assert_eq!(ping.flags & ACK, 0, "{ping:?}");
    h2.send(&frame(PING, ACK, 0, &ping.payload))
        .await
        .expect("ack the PING");
    let second = h2.next_of(GOAWAY, deadline).await;
    assert_eq!(second.u32_at(0) & 0x7fff_ffff, 1, "{second:?}");
    assert_eq!(second.u32_at(4), 0, "NO_ERROR");
    timeout(WAIT, drain).await.expect("the drain ends").unwrap();
}
