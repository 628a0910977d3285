//! One attempt at a target: what the request asks of it (a WebSocket, trailers, a gRPC
//! deadline), its exchange on a pooled connection (in a task holding the slot on a capped
//! upstream) with the response head due by the upstream's timeout or the call's deadline, and
//! the target's health judged from the answer.

use std::sync::Arc;

use http::header::{CONNECTION, UPGRADE};
use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::held::{Attempt, Exchanged};
use super::{deadline, rewrite, Downstream, Upstream};
use crate::body::{Guarded, Sent};
use crate::capacity::Slot;
use crate::config::settings::Protocol;
use crate::error::ProxyError;
use crate::pool::{Failed, SendError};

/// What a request asks of the upstream, read before the rewrite strips the headers that say it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Asks {
    /// A WebSocket upgrade, on a route that allows it.
    pub(super) websocket: bool,
    /// `te: trailers`: the client's, which goes on over HTTP/2, where gRPC servers require
    /// it; tollgate's own to an HTTP/1.1 upstream (hop-by-hop there) for a cost in trailers.
    pub(super) te_trailers: bool,
    /// The upstream speaks HTTP/2 (or may).
    pub(super) h2: bool,
    /// A gRPC call's deadline, over HTTP/2 where gRPC can go: no lookup for HTTP/1.1.
    pub(super) deadline: Option<Instant>,
}

impl Asks {
    pub(super) fn of(
        upstream: &Upstream,
        req: &Request<Guarded>,
        down: &Downstream<'_>,
        now: Instant,
    ) -> Self {
        let h2 = upstream.protocol != Protocol::Http1;
        let headers = req.headers();
        Self {
            websocket: down.websocket_allowed && super::tunnel::is_websocket_upgrade(headers),
            te_trailers: if h2 {
                (headers.get(http::header::TE))
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"))
            } else {
                down.wants_trailers
            },
            h2,
            deadline: h2.then(|| deadline::of(headers, now)).flatten(),
        }
    }

    /// The upstream request, rewritten for `target`, with what it asks put back; whether its
    /// `Host` is the target's (see `rewrite`).
    pub(super) fn rewrite(
        self,
        req: &mut Request<Guarded>,
        target: &http::uri::Authority,
        down: &Downstream<'_>,
    ) -> Result<bool, ProxyError> {
        let host_is_target = rewrite(req, target, down)?;
        if self.te_trailers {
            let headers = req.headers_mut();
            headers.insert(http::header::TE, HeaderValue::from_static("trailers"));
            if !self.h2 {
                // A hop-by-hop field, named as one.
                headers.append(CONNECTION, HeaderValue::from_static("te"));
            }
        }
        if self.websocket {
            let headers = req.headers_mut();
            headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
            headers.insert(UPGRADE, HeaderValue::from_static("websocket"));
        }
        Ok(host_is_target)
    }
}

/// Send `req` to `target` of `upstream` from `at` (`deadline`: a gRPC call's), on the pool of
/// the worker serving `down`: on a capped upstream in a task holding `slot` (given back when the task
/// answers), else here. `timeout` runs from the moment the request is fully sent: until then
/// the route's body limits judge the client, and the connect timeout the connection. A request
/// without a body is sent now, and its connection's task keeps the deadline; one whose body is
/// still streaming gets a timer that starts when the body is done.
pub(super) async fn exchange(
    upstream: &Upstream,
    (target, at, deadline): (usize, Instant, Option<Instant>),
    down: &Downstream<'_>,
    req: Box<Request<Guarded>>,
    sent: &Sent,
    slot: &mut Option<Slot>,
) -> Exchanged {
    let mut req = req;
    if let Some(d) = deadline {
        deadline::propagate(req.headers_mut(), d, at, upstream.timeout);
    }
    let head_by = sent
        .is_done()
        .then(|| deadline.map_or(at + upstream.timeout, |d| d.min(at + upstream.timeout)));
    let pool = upstream.pool(down.worker);
    let uri = &upstream.target_uris[target];
    if let Some(held) = slot.take() {
        let attempt = Attempt {
            pool: Arc::clone(pool),
            target,
            uri: uri.clone(),
            at,
            head_by,
            timeout: upstream.timeout,
            deadline,
            grpc: down.grpc,
        };
        // Boxed: inline, its state would make every forward's future larger.
        let run = crate::boxed(|| attempt.run_holding(req, held));
        let (exchanged, held) = run.await;
        *slot = held;
        return exchanged;
    }
    // Pinned in place: awaited in one of two ways below, it has one slot in this future.
    let mut exchange = std::pin::pin!(pool.send(target, uri, req, at, head_by));
    if head_by.is_some() {
        return exchange.await;
    }
    let head_deadline = deadline::head_due(sent, upstream.timeout, deadline);
    tokio::select! {
        // The response first: no random draw per poll.
        biased;
        exchanged = &mut exchange => exchanged,
        () = head_deadline => Err(Failed { error: SendError::HeadTimeout, unsent: None }),
    }
}

/// An answer from `target` (`at`: when the attempt began; `slot`: a capped upstream's, now
/// answered; `tunnel`: a WebSocket handshake), refused whole when it cannot be passed on (its
/// connection dropped: nothing of it reaches the client), else its status counted for the
/// target's health and its HTTP version remembered: whether the status is one of the
/// upstream's failures.
pub(super) fn judged(
    upstream: &Upstream,
    (target, at): (usize, Instant),
    res: &Response<Incoming>,
    slot: Option<&mut Slot>,
    tunnel: bool,
) -> Result<bool, ProxyError> {
    if let Some(slot) = slot {
        slot.answered();
    }
    super::framing::check_response(res, tunnel).inspect_err(|_| {
        upstream.attempted(target, crate::metrics::AttemptResult::unreachable);
    })?;
    upstream.answered(target, res.status());
    upstream.heard(res.version());
    let failure = upstream.is_failure(res.status());
    if failure {
        upstream.failed(target, at);
    } else {
        upstream.succeeded(target);
    }
    Ok(failure)
}

/// A failed attempt counted against `target`'s health (`at`: when it began). A timeout is
/// latency the adaptive cap must see (its `slot` answered); a refused connection is not.
pub(super) fn failed(
    upstream: &Upstream,
    (target, at): (usize, Instant),
    error: &SendError,
    slot: Option<&mut Slot>,
) {
    upstream.attempted(target, super::attempt_result(error));
    upstream.failed(target, at);
    if let (Some(slot), SendError::HeadTimeout) = (slot, error) {
        slot.answered();
    }
}

/// The request's `Host`, for another target, where it was the target's own.
pub(super) fn host(req: &mut Request<Guarded>, target: &http::uri::Authority) {
    if let Ok(host) = HeaderValue::from_str(target.as_str()) {
        req.headers_mut().insert(http::header::HOST, host);
    }
}
