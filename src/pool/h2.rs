//! HTTP/2 upstream connections (`protocol: h2c | h2 | auto`): multiplexed connections to
//! each target in each pool, shared by every request to it, each carrying up to
//! `http2.max_concurrent_streams` streams (past it, another connection is opened), forgotten
//! once it closes or refuses new streams (GOAWAY).
//!
//! hyper's HTTP/2 client does not say how many streams the peer allows: a stream past the
//! peer's `MAX_CONCURRENT_STREAMS` waits in hyper for one to end, hence the configured bound,
//! counted here. hyper answers the peer's PINGs and sends its own (`KEEPALIVE`), and hands
//! back a request that never became a stream (refused, or past a GOAWAY's last stream), which
//! is then sent once more on a new connection.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use parking_lot::Mutex;
use tokio::time::Instant;

use super::{Counted, Failed, Lease, SendError};
use crate::body::Guarded;

/// A live HTTP/2 connection's request side (cheap to clone: a handle on the connection).
pub(super) type Sender = http2::SendRequest<Guarded>;

/// A PING every this long on a connection, answered within `KEEPALIVE_TIMEOUT`, or the
/// connection is closed (a peer gone without a FIN, a middlebox that dropped the flow).
const KEEPALIVE: Duration = Duration::from_secs(20);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The connections in use to each target.
#[derive(Debug)]
pub(super) struct Conns {
    per_target: Mutex<Vec<Target>>,
    /// Streams per connection at most.
    max_streams: usize,
    /// Woken when a connection being opened is up, or failed.
    opened: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Target {
    conns: Vec<Shared>,
    /// Connections being opened: a request finding no room waits for one rather than open
    /// its own, so a burst opens one connection, not one per request.
    opening: usize,
    /// Opens that failed: a request that waited for one that failed opens its own.
    failures: u64,
}

/// One connection, and its streams open now.
#[derive(Debug)]
struct Shared {
    sender: Sender,
    streams: Arc<AtomicUsize>,
}

/// One stream counted against its connection's bound until dropped (when the response body
/// ends, or the exchange failed).
#[derive(Debug)]
pub struct Stream(Arc<AtomicUsize>);

impl Drop for Stream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Where a request's stream goes.
pub(super) enum Found<'a> {
    /// A live connection with room, its stream counted.
    Live(Sender, Stream),
    /// None has room, one is being opened: ask again once it is up or failed.
    Wait(tokio::sync::futures::Notified<'a>),
    /// Open one: counted as being opened until this is dropped.
    Open(Opening<'a>),
}

/// A connection being opened, for the requests waiting for it.
pub(super) struct Opening<'a> {
    conns: &'a Conns,
    target: usize,
    up: bool,
}

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.conns.per_target.lock().get_mut(self.target) {
            t.opening -= 1;
            if !self.up {
                t.failures += 1;
            }
        }
        self.conns.opened.notify_waiters();
    }
}

impl Conns {
    pub(super) fn new(targets: usize, max_streams: usize) -> Self {
        Self {
            per_target: Mutex::new((0..targets).map(|_| Target::default()).collect()),
            max_streams: max_streams.max(1),
            opened: tokio::sync::Notify::new(),
        }
    }

    /// A live connection to `target` with room for one more stream; or else wait for the one
    /// being opened, unless an open failed since `failures` (the count this request first
    /// saw, returned); or else open one. Closed connections are forgotten on the way.
    pub(super) fn find(&self, target: usize, failures: &mut Option<u64>) -> Option<Found<'_>> {
        let mut conns = self.per_target.lock();
        let t = conns.get_mut(target)?;
        t.conns.retain(|c| !c.sender.is_closed());
        if let Some(c) = t
            .conns
            .iter()
            .find(|c| c.streams.load(Ordering::Acquire) < self.max_streams)
        {
            c.streams.fetch_add(1, Ordering::AcqRel);
            return Some(Found::Live(
                c.sender.clone(),
                Stream(Arc::clone(&c.streams)),
            ));
        }
        let seen = *failures.get_or_insert(t.failures);
        if t.opening > 0 && seen == t.failures {
            let wait = self.opened.notified();
            return Some(Found::Wait(wait));
        }
        t.opening += 1;
        Some(Found::Open(Opening {
            conns: self,
            target,
            up: false,
        }))
    }

    /// Whether `target` has a live connection (for `auto`: it picked HTTP/2).
    pub(super) fn any(&self, target: usize) -> bool {
        let conns = self.per_target.lock();
        conns
            .get(target)
            .is_some_and(|t| t.conns.iter().any(|c| !c.sender.is_closed()))
    }

    /// `sender` is a connection to `target` from now on, with one stream counted for its
    /// opener.
    pub(super) fn put(&self, target: usize, sender: &Sender) -> Stream {
        let streams = Arc::new(AtomicUsize::new(1));
        if let Some(t) = self.per_target.lock().get_mut(target) {
            t.conns.push(Shared {
                sender: sender.clone(),
                streams: Arc::clone(&streams),
            });
        }
        Stream(streams)
    }

    /// Forget the connection of `stream` (it refused a stream, or failed): requests go to
    /// the others, or a new one.
    pub(super) fn forget(&self, target: usize, stream: &Stream) {
        if let Some(t) = self.per_target.lock().get_mut(target) {
            t.conns.retain(|c| !Arc::ptr_eq(&c.streams, &stream.0));
        }
    }
}

impl super::Pool {
    /// `req` to `target` over HTTP/2: on a live connection with room for a stream, or a new
    /// one.
    pub(super) async fn send_over_h2(
        &self,
        target: usize,
        uri: &Uri,
        req: Box<Request<Guarded>>,
        head_by: Option<Instant>,
    ) -> Result<(Response<Incoming>, Option<Lease>), Failed> {
        let mut failures = None;
        let (sender, stream) = loop {
            let opening = match self
                .h2
                .as_ref()
                .and_then(|h2| h2.find(target, &mut failures))
            {
                Some(Found::Live(sender, stream)) => break (sender, Some(stream)),
                Some(Found::Wait(up)) => {
                    up.await;
                    continue;
                }
                Some(Found::Open(opening)) => Some(opening),
                None => None,
            };
            match self.open(target, uri).await {
                Ok(Some(super::Opened::H2(sender, stream))) => {
                    if let Some(mut opening) = opening {
                        opening.up = true;
                    }
                    break (sender, stream);
                }
                // An `auto` target that picked HTTP/1.1 since its last HTTP/2 connection
                // closed: this request goes elsewhere, the next ones over HTTP/1.1.
                Ok(Some(super::Opened::H1(_))) => {
                    let e = "the target now speaks HTTP/1.1".into();
                    return Err(Failed::unsent(SendError::Connect(e), req));
                }
                Ok(None) => {}
                Err(e) => return Err(Failed::unsent(e, req)),
            }
        };
        self.send_h2(target, uri, (sender, stream), req, head_by)
            .await
    }

    /// `req` as a stream of HTTP/2 connection `sender` to `target`, counted as `stream`; a
    /// request that never became a stream (refused, or past a GOAWAY) is sent once more on a
    /// new connection.
    pub(super) async fn send_h2(
        &self,
        target: usize,
        uri: &Uri,
        (mut sender, mut stream): (Sender, Option<Stream>),
        mut req: Box<Request<Guarded>>,
        head_by: Option<Instant>,
    ) -> Result<(Response<Incoming>, Option<Lease>), Failed> {
        let scheme = uri.scheme().cloned().unwrap_or(http::uri::Scheme::HTTP);
        to_h2(&mut req, scheme);
        let mut again = true;
        loop {
            match send(&mut sender, *req, head_by).await {
                Ok(res) => return Ok((res, stream.map(Lease::Stream))),
                Err((error, unsent)) => {
                    if let (Some(h2), Some(stream)) = (&self.h2, &stream) {
                        h2.forget(target, stream);
                    }
                    let Some(unsent) = unsent else {
                        return Err(Failed::written(error));
                    };
                    req = Box::new(unsent);
                    if !again {
                        return Err(Failed::unsent(error, req));
                    }
                    again = false;
                    (sender, stream) = match self.open(target, uri).await {
                        Ok(Some(super::Opened::H2(s, n))) => (s, n),
                        Ok(_) => return Err(Failed::unsent(error, req)),
                        Err(e) => return Err(Failed::unsent(e, req)),
                    };
                }
            }
        }
    }
}

/// Start HTTP/2 on `io`, the connection's task on this worker (keeping `counted` until it
/// ends).
pub(super) async fn handshake<T>(io: T, counted: Option<Counted>) -> Result<Sender, SendError>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, connection) = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(KEEPALIVE)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .adaptive_window(true)
        .handshake(io)
        .await
        .map_err(SendError::Exchange)?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "upstream HTTP/2 connection ended with an error");
        }
        drop(counted);
    });
    Ok(sender)
}

/// `req`, as the HTTP/1.1 rewrite left it (origin form, `Host`), made an HTTP/2 request to
/// `scheme`: `:authority` from `Host`, the absolute URI h2 takes its pseudo-headers from.
pub(super) fn to_h2(req: &mut Request<Guarded>, scheme: Scheme) {
    let host = req.headers_mut().remove(http::header::HOST);
    let authority = host
        .as_ref()
        .and_then(|h| Authority::try_from(h.as_bytes()).ok());
    let path = req
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let mut parts = http::uri::Parts::default();
    parts.scheme = Some(scheme);
    parts.authority = authority;
    parts.path_and_query = Some(path);
    if let Ok(uri) = Uri::from_parts(parts) {
        *req.uri_mut() = uri;
    } else if let Some(host) = host {
        // No authority h2 could carry: the request goes without one, `Host` kept.
        req.headers_mut().insert(http::header::HOST, host);
    }
    *req.version_mut() = Version::HTTP_2;
}

/// Send `req` on `sender`, its head due by `head_by` (when the whole request is sent at once):
/// the response, or why not, with the request back when it never became a stream.
pub(super) async fn send(
    sender: &mut Sender,
    req: Request<Guarded>,
    head_by: Option<Instant>,
) -> Result<Response<Incoming>, (SendError, Option<Request<Guarded>>)> {
    if let Err(e) = sender.ready().await {
        return Err((SendError::Exchange(e), Some(req)));
    }
    let exchange = sender.try_send_request(req);
    let answered = match head_by {
        Some(at) => match tokio::time::timeout_at(at, exchange).await {
            Ok(answered) => answered,
            Err(_) => return Err((SendError::HeadTimeout, None)),
        },
        None => exchange.await,
    };
    answered.map_err(|mut e| {
        let unsent = e.take_message();
        let e = e.into_error();
        if not_http2(&e) {
            let why = "the target did not answer in HTTP/2 (an HTTP/1.x answer reads as a frame of invalid size): set the upstream's `protocol` to what the target speaks (`http1`)";
            return (SendError::Connect(why.into()), unsent);
        }
        (SendError::Exchange(e), unsent)
    })
}

/// The peer sent what cannot be HTTP/2 framing: "HTTP/1.1 400" read as a frame header is a
/// frame of 4.7 MB, past any peer's size.
fn not_http2(e: &hyper::Error) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<::h2::Error>())
        .is_some_and(|h2| h2.reason() == Some(::h2::Reason::FRAME_SIZE_ERROR) && h2.is_go_away())
}
