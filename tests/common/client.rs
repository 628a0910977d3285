//! The HTTP client of the tests: `Http`, hyper-util's pooled client (HTTP/1.1, HTTP/1.1 from a
//! chosen loopback source address, or HTTP/2 prior knowledge). Exact bytes: `raw::Raw`.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

use super::upstream::Zeros;

/// The request body type of every test client.
pub type ReqBody = BoxBody<Bytes, Infallible>;

/// A response with its body read completely.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// A header's value; panics, showing every header, when it is absent.
    pub fn header(&self, name: &str) -> &str {
        self.opt_header(name)
            .unwrap_or_else(|| panic!("no `{name}` in the response: {:?}", self.headers))
    }

    pub fn opt_header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("header is text"))
    }

    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("body is UTF-8")
    }

    /// The status as a number, for compact assertions.
    pub fn code(&self) -> u16 {
        self.status.as_u16()
    }
}

/// A pooled client (keep-alive connections, reused across requests).
#[derive(Clone)]
pub struct Http {
    inner: Client<HttpConnector, ReqBody>,
}

impl Http {
    /// HTTP/1.1 from 127.0.0.1.
    pub fn new() -> Self {
        Self::build(None, false)
    }

    /// HTTP/1.1 from the loopback address `ip` (such as `127.0.0.2`): another client peer.
    pub fn from_ip(ip: &str) -> Self {
        Self::build(Some(ip.parse().expect("an IP address")), false)
    }

    /// HTTP/2 with prior knowledge (h2c), all requests on one connection.
    pub fn h2c() -> Self {
        Self::build(None, true)
    }

    fn build(local: Option<IpAddr>, h2: bool) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_local_address(local);
        connector.set_nodelay(true);
        let inner = Client::builder(TokioExecutor::new())
            .http2_only(h2)
            .build(connector);
        Self { inner }
    }

    /// `GET url`.
    pub async fn get(&self, url: &str) -> Reply {
        self.send(request("GET", url, &[])).await
    }

    /// `GET url` with extra headers.
    pub async fn get_with(&self, url: &str, headers: &[(&str, &str)]) -> Reply {
        self.send(request("GET", url, headers)).await
    }

    /// Send and read the whole response body.
    pub async fn send(&self, req: Request<ReqBody>) -> Reply {
        let res = self.stream(req).await;
        let (parts, body) = res.into_parts();
        let body = body
            .collect()
            .await
            .expect("read the response body")
            .to_bytes();
        Reply {
            status: parts.status,
            version: parts.version,
            headers: parts.headers,
            body,
        }
    }

    /// Send and return the response with its body still streaming.
    pub async fn stream(&self, req: Request<ReqBody>) -> Response<Incoming> {
        let what = format!("{} {}", req.method(), req.uri());
        self.inner
            .request(req)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"))
    }

    /// Send `n` requests one after the other and return their statuses.
    pub async fn statuses(&self, n: usize, url: &str, headers: &[(&str, &str)]) -> Vec<u16> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.get_with(url, headers).await.code());
        }
        out
    }
}

impl Default for Http {
    fn default() -> Self {
        Self::new()
    }
}

/// Send `req` over a new HTTP/2 (h2c) connection to `addr`, whatever host its URI names: the
/// URI's authority becomes `:authority`, so names need not resolve.
pub async fn h2c_to(addr: SocketAddr, req: Request<ReqBody>) -> Reply {
    let stream = TcpStream::connect(addr)
        .await
        .expect("connect to the proxy");
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("HTTP/2 handshake");
    tokio::spawn(conn);
    let res = send.send_request(req).await.expect("HTTP/2 request");
    let (parts, body) = res.into_parts();
    let body = body.collect().await.expect("read the body").to_bytes();
    Reply {
        status: parts.status,
        version: parts.version,
        headers: parts.headers,
        body,
    }
}

/// A request with an empty body.
pub fn request(method: &str, url: &str, headers: &[(&str, &str)]) -> Request<ReqBody> {
    let mut b = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Empty::new().boxed()).expect("a valid request")
}

/// A `POST` whose body is `len` generated bytes, sent chunked (length not announced).
pub fn upload(url: &str, len: u64) -> Request<ReqBody> {
    Request::builder()
        .method("POST")
        .uri(url)
        .body(Zeros::chunked(len).boxed())
        .expect("a valid request")
}

/// Read a streaming body to its end, counting bytes without keeping them.
pub async fn drain(body: &mut Incoming) -> u64 {
    let mut n = 0;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame.expect("read a body frame").data_ref() {
            n += data.len() as u64;
        }
    }
    n
}
