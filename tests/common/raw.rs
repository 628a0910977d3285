//! A raw HTTP/1.1 client for the tests that need exact bytes on the wire: requests written as
//! given (in pieces, malformed, smuggled), responses read by their own framing, every read
//! bounded by a deadline so a test fails instead of hanging.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::{timeout, timeout_at, Instant};

/// The longest any single step may take before a test gives up.
pub const WAIT: Duration = Duration::from_secs(5);

/// Bytes as text for assertion messages, cut short.
pub fn lossy(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    match text.char_indices().nth(400) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text.into_owned(),
    }
}

pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// One response read off a raw connection.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    /// Names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The response announces that the connection closes after it.
    pub fn says_close(&self) -> bool {
        self.header("connection")
            .is_some_and(|v| v.to_ascii_lowercase().contains("close"))
    }
}

/// One TCP connection speaking HTTP/1.1 by hand; what arrives is buffered, every read bounded.
pub struct Raw {
    pub stream: TcpStream,
    pub buf: Vec<u8>,
    eof: bool,
}

impl Raw {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = timeout(WAIT, TcpStream::connect(addr))
            .await
            .expect("connect timed out")
            .expect("connect to the proxy");
        Self::wrap(stream)
    }

    /// Connect from the loopback address `ip` (another client as far as the proxy can tell).
    pub async fn open_from(addr: SocketAddr, ip: &str) -> Self {
        let socket = TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::new(ip.parse().expect("an IP"), 0))
            .expect("bind the client address");
        let stream = timeout(WAIT, socket.connect(addr))
            .await
            .expect("connect timed out")
            .expect("connect to the proxy");
        Self::wrap(stream)
    }

    pub fn wrap(stream: TcpStream) -> Self {
        stream.set_nodelay(true).expect("nodelay");
        Self {
            stream,
            buf: Vec::new(),
            eof: false,
        }
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        timeout(WAIT, self.stream.write_all(bytes))
            .await
            .expect("write timed out")
            .expect("write the request");
    }

    /// Read more into the buffer; false once the peer has closed (or reset) the connection.
    async fn fill(&mut self, deadline: Instant) -> bool {
        if self.eof {
            return false;
        }
        let mut chunk = [0u8; 4096];
        let read = timeout_at(deadline, self.stream.read(&mut chunk))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "nothing more arrived in time; so far: {:?}",
                    lossy(&self.buf)
                )
            });
        match read {
            Ok(0) | Err(_) => {
                self.eof = true;
                false
            }
            Ok(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                true
            }
        }
    }

    /// Read one response (an interim `1xx` counts as one), framed by Content-Length, chunked
    /// coding or the end of the connection.
    pub async fn response(&mut self) -> Resp {
        let deadline = Instant::now() + WAIT;
        let head_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i;
            }
            assert!(
                self.fill(deadline).await,
                "the connection closed without a (complete) response head; got {:?}",
                lossy(&self.buf)
            );
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        self.buf.drain(..head_end + 4);
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let headers: Vec<(String, String)> = lines
            .map(|l| {
                let (k, v) = l.split_once(':').expect("a header line");
                (k.trim().to_ascii_lowercase(), v.trim().to_owned())
            })
            .collect();
        let mut res = Resp {
            status,
            headers,
            body: Vec::new(),
        };
        if (100..200).contains(&status) || status == 204 || status == 304 {
            return res;
        }
        if let Some(len) = res.header("content-length") {
            let len: usize = len.parse().expect("a length");
            while self.buf.len() < len {
                assert!(self.fill(deadline).await, "short body: {res:?}");
            }
            res.body = self.buf.drain(..len).collect();
        } else if res
            .header("transfer-encoding")
            .is_some_and(|t| t.contains("chunked"))
        {
            res.body = self.chunked(deadline).await;
        } else {
            while self.fill(deadline).await {}
            res.body = std::mem::take(&mut self.buf);
        }
        res
    }

    async fn chunked(&mut self, deadline: Instant) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(i) = find(&self.buf, b"\r\n") {
                    break i;
                }
                assert!(self.fill(deadline).await, "chunked body cut short");
            };
            let line = String::from_utf8_lossy(&self.buf[..line_end]).into_owned();
            let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                .expect("a hex chunk size");
            while self.buf.len() < line_end + 2 + size + 2 {
                assert!(self.fill(deadline).await, "chunk cut short");
            }
            body.extend_from_slice(&self.buf[line_end + 2..line_end + 2 + size]);
            self.buf.drain(..line_end + 2 + size + 2);
            if size == 0 {
                return body;
            }
        }
    }

    /// Whether the peer closes the connection within `within`. Anything that arrives meanwhile
    /// is kept in `buf` (so a test can see an unexpected extra response).
    pub async fn closed_within(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut chunk = [0u8; 4096];
        while !self.eof {
            match timeout_at(deadline, self.stream.read(&mut chunk)).await {
                Err(_) => return false,
                Ok(Ok(0) | Err(_)) => self.eof = true,
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
        true
    }

    /// Write as much of `bytes` as the proxy takes (it may answer and close first).
    pub async fn send_some(&mut self, bytes: &[u8]) {
        let _ = timeout(WAIT, self.stream.write_all(bytes)).await;
    }

    /// Write a request made of `lines` (the request line and headers) and an empty body, then
    /// read the response.
    pub async fn roundtrip(&mut self, lines: &[&str]) -> Resp {
        self.send(format!("{}\r\n\r\n", lines.join("\r\n")).as_bytes())
            .await;
        self.response().await
    }

    /// Whether the peer closes the connection within `within`, nothing more arriving.
    pub async fn closed_clean(&mut self, within: Duration) -> bool {
        self.closed_within(within).await && self.buf.is_empty()
    }

    /// Whether the peer closes within `WAIT` without writing anything more.
    pub async fn is_closed(&mut self) -> bool {
        self.closed_clean(WAIT).await
    }

    /// Everything that arrives until the peer closes (or `within` passes).
    pub async fn read_all(&mut self, within: Duration) -> Vec<u8> {
        let _ = self.closed_within(within).await;
        std::mem::take(&mut self.buf)
    }

    /// After the last response: the connection closes, with nothing more written on it.
    pub async fn assert_closed_clean(&mut self, what: &str) {
        assert!(
            self.closed_within(WAIT).await,
            "{what}: the connection stayed open"
        );
        assert!(
            self.buf.is_empty(),
            "{what}: more bytes after the response: {:?}",
            lossy(&self.buf)
        );
    }
}
