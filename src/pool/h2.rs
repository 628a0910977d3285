//! HTTP/2 upstream connections (`protocol: h2c | h2 | auto`): one multiplexed connection per
//! target in each pool, shared by every request to it, replaced once it closes or refuses new
//! streams (GOAWAY).
//!
//! hyper's HTTP/2 client keeps the streams within the peer's `MAX_CONCURRENT_STREAMS` itself
//! (a request past it waits for a stream to end), answers the peer's PINGs and sends its own
//! (`KEEPALIVE`), and hands back a request that never became a stream (refused, or past a
//! GOAWAY's last stream), which is then sent once more on a new connection.

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

/// The connection in use to each target.
#[derive(Debug)]
pub(super) struct Conns {
    per_target: Mutex<Vec<Option<Sender>>>,
}

impl Conns {
    pub(super) fn new(targets: usize) -> Self {
        Self {
            per_target: Mutex::new(vec![None; targets]),
        }
    }

    /// The live connection to `target`, if there is one.
    pub(super) fn get(&self, target: usize) -> Option<Sender> {
        let mut conns = self.per_target.lock();
        let slot = conns.get_mut(target)?;
        if slot.as_ref().is_some_and(Sender::is_closed) {
            *slot = None;
        }
        slot.clone()
    }

    /// `sender` is the connection to `target` from now on.
    pub(super) fn put(&self, target: usize, sender: &Sender) {
        if let Some(slot) = self.per_target.lock().get_mut(target) {
            *slot = Some(sender.clone());
        }
    }

    /// Forget the connection to `target` (it refused a stream, or failed): the next request
    /// opens another.
    pub(super) fn forget(&self, target: usize) {
        if let Some(slot) = self.per_target.lock().get_mut(target) {
            *slot = None;
        }
    }
}

impl super::Pool {
    /// `req` to `target` over HTTP/2: on its live connection, or a new one.
    pub(super) async fn send_over_h2(
        &self,
        target: usize,
        uri: &Uri,
        req: Box<Request<Guarded>>,
        head_by: Option<Instant>,
    ) -> Result<(Response<Incoming>, Option<Lease>), Failed> {
        let sender = match self.h2.as_ref().and_then(|h2| h2.get(target)) {
            Some(sender) => sender,
            None => loop {
                match self.open(target, uri).await {
                    Ok(Some(super::Opened::H2(sender))) => break sender,
                    // An `auto` target that picked HTTP/1.1 since its last HTTP/2 connection
                    // closed: this request goes elsewhere, the next ones over HTTP/1.1.
                    Ok(Some(super::Opened::H1(_))) => {
                        let e = "the target now speaks HTTP/1.1".into();
                        return Err(Failed::unsent(SendError::Connect(e), req));
                    }
                    Ok(None) => {}
                    Err(e) => return Err(Failed::unsent(e, req)),
                }
            },
        };
        self.send_h2(target, uri, sender, req, head_by).await
    }

    /// `req` as a stream of HTTP/2 connection `sender` to `target`; a request that never
    /// became a stream (refused, or past a GOAWAY) is sent once more on a new connection.
    pub(super) async fn send_h2(
        &self,
        target: usize,
        uri: &Uri,
        mut sender: Sender,
        mut req: Box<Request<Guarded>>,
        head_by: Option<Instant>,
    ) -> Result<(Response<Incoming>, Option<Lease>), Failed> {
        let scheme = uri.scheme().cloned().unwrap_or(http::uri::Scheme::HTTP);
        to_h2(&mut req, scheme);
        let mut again = true;
        loop {
            match send(&mut sender, *req, head_by).await {
                Ok(res) => return Ok((res, None)),
                Err((error, unsent)) => {
                    if let Some(h2) = &self.h2 {
                        h2.forget(target);
                    }
                    let Some(unsent) = unsent else {
                        return Err(Failed::written(error));
                    };
                    req = Box::new(unsent);
                    if !again {
                        return Err(Failed::unsent(error, req));
                    }
                    again = false;
                    sender = match self.open(target, uri).await {
                        Ok(Some(super::Opened::H2(s))) => s,
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
        (SendError::Exchange(e.into_error()), unsent)
    })
}
