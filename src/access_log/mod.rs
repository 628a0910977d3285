//! The access log: one line per request, formatted by the worker that served it into a buffer
//! of its own and written by one writer thread, off the request path.
//!
//! A request's line is written when its response body ends or is dropped (so it has the bytes
//! sent and the whole duration), from an `Entry` the proxy fills as the request goes: values
//! copied or reference-counted per thread, no allocation. Each thread formats lines into its
//! buffer (no lock, no tracing event) and hands the buffer to the writer when it is nearly full,
//! when its oldest line is a second old, once a second from each worker's ticker, on reload and
//! when the thread ends. The writer makes one write per buffer to stderr, stdout or a file,
//! which it reopens on SIGUSR1 or when the file was renamed (logrotate).
//!
//! When the writer cannot keep up (the destination blocks: a full pipe nobody reads, a stalled
//! disk) and its queue of buffers is full, a worker drops its buffer and counts the lines in
//! `tollgate_access_log_dropped_lines_total` rather than stall the requests it serves.
//!
//! The destination is process-wide, as the tracing subscriber is: the binary installs it once
//! (`install`); a process that installs nothing logs no access lines.

mod format;
mod keys;
mod span;
mod writer;

use std::net::IpAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Method, Request, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use smallvec::SmallVec;
use tokio::time::Instant;

use crate::body::Sent;
pub use keys::{Digests, KeySources, Keys};
pub use writer::{dropped_lines, enabled, flush_local, flush_periodically, json, reopen, sync};

/// Where access-log lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    Off,
    Stderr,
    Stdout,
    /// Appended to; reopened on SIGUSR1 or when renamed.
    File(PathBuf),
}

impl Destination {
    /// `true`, `on` or `stderr`; `false` or `off`; `stdout`; anything else is a file path.
    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s.trim() {
            "" => return Err("expected stderr, stdout, off or a file path".to_owned()),
            "true" | "on" | "stderr" => Self::Stderr,
            "false" | "off" => Self::Off,
            "stdout" => Self::Stdout,
            path => Self::File(PathBuf::from(path)),
        })
    }
}

/// How a line is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `TIMESTAMP  INFO tollgate::access: key=value ...`, as the text log's lines.
    Text,
    /// One JSON object per line, with OpenTelemetry's attribute names where they exist.
    Json,
}

/// Start the access log: open `destination` and the writer thread. Once per process; `Off`
/// starts nothing.
pub fn install(destination: &Destination, format: Format) -> std::io::Result<()> {
    writer::install(destination, format)
}

/// A name (route, limit, upstream target) copied into the entry: short ones need no
/// allocation, and no reference count shared with the other workers is touched.
pub type Name = SmallVec<[u8; 32]>;

/// What a request's line says, filled in as the request goes.
#[derive(Debug)]
pub struct Entry {
    pub started: Instant,
    pub request_id: HeaderValue,
    pub traceparent: Option<HeaderValue>,
    pub method: Method,
    /// As the client sent it (before normalisation); only its path is logged.
    pub uri: Uri,
    pub host: Option<HeaderValue>,
    pub user_agent: Option<HeaderValue>,
    pub version: Version,
    pub tls: bool,
    /// The connection's peer (the PROXY header's client when there is one).
    pub peer: IpAddr,
    /// `peer` as text, rendered once per connection.
    pub peer_text: HeaderValue,
    /// The client address tollgate resolved; `None` before routing (then `peer` is logged).
    pub client_ip: Option<IpAddr>,
    pub status: u16,
    pub route: Name,
    /// The limit that rejected the request.
    pub limit: Name,
    pub outcome: &'static str,
    /// The first 64 bits of the identity digest the closest limit counted the request under.
    pub client: Option<u64>,
    /// The target (`host:port`) that answered.
    pub upstream: Name,
    /// From sending upstream to the upstream's response head.
    pub upstream_time: Option<Duration>,
    /// The wait for a slot of a capped upstream.
    pub queue_time: Option<Duration>,
    /// Request body bytes read from the client when it was received whole.
    pub bytes_in: u64,
    /// A streamed request body's progress (its bytes are read when the line is written).
    pub body_in: Sent,
    /// The digests of the identity sources the route's limits read (JSON lines only).
    pub keys: Keys,
    /// A gRPC call's status: from the answer's head (a trailers-only answer, tollgate's own
    /// among them) or its trailers.
    pub grpc_status: Option<u16>,
    /// What the response said the request cost (`cost.from_response`), once settled.
    pub cost: Option<u64>,
    /// The request's trace, when tracing is on and it may be exported: made into spans when
    /// the entry is complete.
    pub span: Option<Box<crate::telemetry::RequestSpan>>,
}

impl Entry {
    /// The entry of `req` as it arrived, `started` then, with its resolved `request_id`.
    pub fn begin<B>(
        req: &Request<B>,
        peer: (IpAddr, &HeaderValue),
        tls: bool,
        request_id: HeaderValue,
        started: Instant,
    ) -> Self {
        let headers = req.headers();
        Self {
            started,
            request_id,
            traceparent: headers.get(TRACEPARENT).cloned(),
            method: req.method().clone(),
            uri: req.uri().clone(),
            host: headers.get(http::header::HOST).cloned(),
            user_agent: headers.get(http::header::USER_AGENT).cloned(),
            version: req.version(),
            tls,
            peer: peer.0.to_canonical(),
            peer_text: peer.1.clone(),
            client_ip: None,
            status: 0,
            route: Name::new(),
            limit: Name::new(),
            outcome: "none",
            client: None,
            upstream: Name::new(),
            upstream_time: None,
            queue_time: None,
            bytes_in: 0,
            body_in: Sent::default(),
            keys: Keys::default(),
            grpc_status: None,
            cost: None,
            span: None,
        }
    }
}

const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");

/// The `grpc-status` of a head or trailers, if they carry one.
pub fn grpc_status(headers: &http::HeaderMap) -> Option<u16> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

/// Told how a response's body ended: a gRPC call's status once its trailers bring it (for the
/// metrics), with the trailers of any response (a cost settled from them); `2` (UNKNOWN) for
/// trailers or an end without a status, `1` (CANCELLED) for a body dropped before its end.
/// Returns the cost settled, for the log line.
/// Boxed twice: a thin pointer, as every response body carries the field.
pub struct EndTally(pub Box<TallyFn>);

/// What an `EndTally` calls.
pub type TallyFn = Box<dyn FnOnce(u16, Option<&http::HeaderMap>) -> Option<u64> + Send + Sync>;

impl std::fmt::Debug for EndTally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EndTally")
    }
}

/// A response body that writes its request's access-log line when it ends or is dropped,
/// with the bytes it carried, and tells how it ended (a gRPC call's status, the trailers) to
/// its tally.
#[derive(Debug)]
pub struct LoggedBody<B> {
    body: B,
    entry: Option<Box<Entry>>,
    sent: u64,
    at_end: Option<EndTally>,
}

impl<B> LoggedBody<B> {
    pub fn new(body: B, entry: Option<Box<Entry>>, at_end: Option<EndTally>) -> Self {
        Self {
            body,
            entry,
            sent: 0,
            at_end,
        }
    }

    fn tally(&mut self, status: u16, trailers: Option<&http::HeaderMap>) {
        if let Some(tally) = self.at_end.take() {
            let cost = (tally.0)(status, trailers);
            if let (Some(entry), Some(_)) = (self.entry.as_mut(), cost) {
                entry.cost = cost;
            }
        }
    }

    fn write(&mut self) {
        if let Some(entry) = self.entry.take() {
            if let Some(traced) = &entry.span {
                span::export(&entry, traced, self.sent);
            }
            writer::write(&entry, self.sent);
        }
    }
}

impl<B: Body + Unpin> Body for LoggedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if self.entry.is_some() || self.at_end.is_some() {
            match &polled {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        self.sent += bytes::Buf::remaining(data) as u64;
                    } else if let Some(trailers) = frame.trailers_ref() {
                        let status = grpc_status(trailers);
                        if let (Some(entry), Some(_)) = (self.entry.as_mut(), status) {
                            entry.grpc_status = status;
                        }
                        self.tally(status.unwrap_or(2), Some(trailers));
                    }
                }
                Poll::Ready(None) => {
                    self.tally(2, None);
                    self.write();
                }
                _ => {}
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<B> Drop for LoggedBody<B> {
    fn drop(&mut self) {
        self.tally(1, None);
        self.write();
    }
}
