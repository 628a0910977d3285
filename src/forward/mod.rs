//! Forwarding upstream: target choice, retries, the request rewrite, a pooled keep-alive
//! client, streaming.

mod attempt;
mod balance;
mod buffered;
mod check;
mod deadline;
mod framing;
mod health;
mod held;
mod rewrite;
pub mod tunnel;
mod upstream;

use std::net::IpAddr;
use std::time::Duration;

use http::header::{CONNECTION, UPGRADE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::body::Guarded;
use crate::capacity::{Priority, Slot, Ticket};
use crate::error::ProxyError;
use crate::identity::peer_key;
use crate::metrics::{AttemptResult, Metrics, RetryReason, UpstreamErrorKind, UpstreamErrorLabels};
use crate::pool::{Failed, Lease, Pooled, SendError};
use crate::Small;
pub use buffered::{body_out, hold};
use rewrite::rewrite;
pub use rewrite::strip_hop_by_hop;
pub use tunnel::Tunnel;
pub use upstream::Upstream;

/// An upstream's answer: its response head (the body still streaming), and the tunnel a
/// WebSocket handshake opened.
#[derive(Debug)]
pub struct Forwarded {
    pub response: Response<Pooled>,
    /// Boxed, as WebSockets are rare: every forward moves `Forwarded` on its way out.
    pub tunnel: Option<Box<Tunnel>>,
    /// The target that answered (its index in the upstream's `targets`).
    pub target: usize,
    /// How long the request waited for a slot of a capped upstream (retries included).
    pub waited: Duration,
    /// When the response head came: the one clock read the upstream's histogram, the pool
    /// and the route's duration share.
    pub answered: Instant,
}

/// What the rewrite needs to know about the downstream connection.
// Four independent facts about one request, not a state machine in disguise.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug, Clone, Copy)]
pub struct Downstream<'a> {
    pub peer: IpAddr,
    /// `peer`, rendered once per connection.
    pub peer_value: &'a HeaderValue,
    pub peer_trusted: bool,
    pub tls: bool,
    /// The client address tollgate decided on (sent as `X-Real-IP`).
    pub client_ip: IpAddr,
    /// The route proxies WebSocket upgrades.
    pub websocket_allowed: bool,
    /// A gRPC call (`content-type: application/grpc`), as the proxy found it.
    pub grpc: bool,
    /// The route settles a cost from the response, which may come in its trailers: an HTTP/1.1
    /// upstream is told `TE: trailers` (hyper's servers, among others, send none without it).
    pub wants_trailers: bool,
    /// The route's idle timeout for an open tunnel.
    pub websocket_idle: Duration,
    /// Headers with `_` in their names go upstream (else they are dropped).
    pub underscores: bool,
    /// Headers removed when the peer is not a trusted proxy (`strip_untrusted_headers`).
    pub untrusted_strip: &'a [http::HeaderName],
    /// The worker serving the connection (whose upstream pool it uses).
    pub worker: usize,
    /// The route's name, for the logs.
    pub route: &'a str,
    /// The route sends idempotent requests that reached a failing target to another one.
    pub retry_idempotent: bool,
    /// The request-ID header and the request's ID (`request_id`), sent upstream.
    pub request_id: (&'a http::HeaderName, &'a HeaderValue),
    /// The identity and class the queue of a capped upstream serves the request by.
    pub queue: (u128, Priority),
    /// The request's trace, when tracing is on: each attempt a span, told upstream.
    pub span: Option<&'a crate::telemetry::RequestSpan>,
}

/// `send`, timed: the answer comes back with the time to its response head, observed in the
/// upstream's histogram; a failure is counted by kind in `metrics`.
pub async fn send_timed(
    upstream: &Upstream,
    req: Box<Request<Guarded>>,
    down: &Downstream<'_>,
    now: Instant,
    metrics: &Metrics,
) -> Result<(Forwarded, Duration), ProxyError> {
    // Boxed: the exchange's state is large, and every future that held it inline (this one,
    // the pipeline's, the request's) would be copied in full each time one is created and
    // moved. In a statement of its own: a temporary of the `.await` statement would be kept in
    // this future's state, unboxed, for the whole exchange.
    let exchange = crate::boxed(|| send(upstream, req, down, now));
    let error = match exchange.await {
        Ok(forwarded) => {
            // The upstream's time: a wait for a slot of a capped upstream is the queue's.
            let took = (forwarded.answered.saturating_duration_since(now))
                .saturating_sub(forwarded.waited);
            upstream.seconds.observe(took.as_secs_f64());
            return Ok((forwarded, took));
        }
        Err(e) => e,
    };
    let kind = match &error {
        ProxyError::UpstreamTimeout => Some(UpstreamErrorKind::timeout),
        ProxyError::UpstreamUnreachable | ProxyError::UpstreamInvalid => {
            Some(UpstreamErrorKind::unreachable)
        }
        _ => None,
    };
    if let Some(kind) = kind {
        let labels = UpstreamErrorLabels {
            upstream: upstream.name.to_string(),
            kind,
        };
        metrics.upstream_errors.get_or_create(&labels).inc();
    }
    Err(error)
}

/// Send `req` to one of the upstream's targets and return its response head, the body still
/// streaming. Connection refused is `UpstreamUnreachable` (502); no response head within the
/// upstream's `timeout`, or no connection within `connect_timeout`, is `UpstreamTimeout` (504).
/// `now`: about now (a request without a body is sent from then on). A WebSocket handshake
/// the upstream accepted comes back with its tunnel, for the connection to run.
///
/// A request that failed goes to another target, up to the upstream's `retries` more times:
/// always when none of it reached the target (it comes back from the pool unwritten), and when
/// it did only if the route has `retry_idempotent`, the method is idempotent and the body can
/// be sent again. A failure status from the last target tried is its answer.
// One loop over the attempts: the response is made ready in place, and a helper would move (copy) it on its way out.
#[allow(clippy::too_many_lines)]
pub async fn send(
    upstream: &Upstream,
    mut req: Box<Request<Guarded>>,
    down: &Downstream<'_>,
    now: Instant,
) -> Result<Forwarded, ProxyError> {
    let asks = attempt::Asks::of(upstream, &req, down, now);
    let deadline = asks.deadline;
    let mut client_side = asks.websocket.then(|| hyper::upgrade::on(&mut *req));
    let mut at = now;
    // Most upstreams have no cap: no slot to wait for, and no future built to learn that.
    let mut slot = if upstream.gate.is_some() {
        admit(upstream, down, &[], &mut at).await?
    } else {
        None
    };
    let mut waited = slot.as_ref().map_or(Duration::ZERO, |s| s.waited);
    let mut target = target_of(upstream, slot.as_ref(), now, &[]);
    let host_is_target = asks.rewrite(&mut req, &upstream.targets[target], down)?;
    let replayable = down.retry_idempotent && upstream.retries > 0 && idempotent(req.method());
    let mut tried: Small<usize> = Small::new();
    loop {
        tried.push(target);
        let left = tried.len() <= upstream.retries as usize;
        // Taken before the request goes: once written, hyper keeps it.
        let replay = if replayable && left { copy(&req) } else { None };
        let sent = req.body().sent();
        let in_flight = upstream.enter(target);
        let on = (target, at, deadline);
        let traced = (down.span)
            .and_then(|s| s.attempt(req.headers_mut(), upstream.targets[target].as_str()));
        let exchanged = attempt::exchange(upstream, on, down, req, &sent, &mut slot).await;
        if let (Some(span), Some(i)) = (down.span, traced) {
            let (status, error) = match &exchanged {
                Ok((res, _)) => (Some(res.status().as_u16()), None),
                Err(failed) => (None, Some(failed.error.kind())),
            };
            span.attempt_ended(i, status, error);
        }
        let (retry, next) = match exchanged {
            // One arm for every answer, the response made ready in place and returned from
            // here: each move of the response on its way out is a copy of it.
            Ok((mut res, mut lease)) => {
                let tunnel = client_side.is_some();
                let failure = attempt::judged(upstream, (target, at), &res, slot.as_mut(), tunnel)?;
                if let Some(next) = replay.filter(|_| failure) {
                    (RetryReason::idempotent, next)
                } else {
                    let tunnel = prepare(&mut res, &mut lease, client_side.take(), down);
                    let answered = Instant::now();
                    let in_flight = (in_flight, slot.map(Box::new));
                    return Ok(Forwarded {
                        response: res.map(|body| Pooled::new(body, lease, in_flight, answered)),
                        tunnel,
                        target,
                        waited,
                        answered,
                    });
                }
            }
            Err(Failed { error, unsent }) => {
                // A request whose own body failed is the client's fault, not the target's: the
                // answer is the body's.
                if let Some(why) = sent.failure() {
                    return Err(why.into());
                }
                attempt::failed(upstream, (target, at), &error, slot.as_mut());
                match (unsent, replay) {
                    (Some(unsent), _) if left => (RetryReason::unreached, unsent),
                    (None, Some(next)) => (RetryReason::idempotent, next),
                    _ => return Err(given_up(upstream, target, &error, down.route, &tried)),
                }
            }
        };
        req = next;
        at = Instant::now();
        // The cap counts attempts: the failed one's slot goes, the next one takes its own.
        drop(slot.take());
        slot = admit(upstream, down, &tried, &mut at).await?;
        waited += slot.as_ref().map_or(Duration::ZERO, |s| s.waited);
        target = target_of(upstream, slot.as_ref(), at, &tried);
        if host_is_target {
            attempt::host(&mut req, &upstream.targets[target]);
        }
        upstream.retried(retry);
    }
}

/// A slot of a capped upstream (none when uncapped), for a request that tried `tried`; `at`
/// moves to when it came if the request waited.
async fn admit(
    upstream: &Upstream,
    down: &Downstream<'_>,
    tried: &[usize],
    at: &mut Instant,
) -> Result<Option<Slot>, ProxyError> {
    let Some(gate) = &upstream.gate else {
        return Ok(None);
    };
    let (key, priority) = down.queue;
    let ticket = Ticket {
        key,
        peer: peer_key(down.client_ip),
        priority,
        tried,
    };
    match gate.admit(ticket).await {
        Ok(slot) => {
            if !slot.waited.is_zero() {
                *at = Instant::now();
            }
            Ok(Some(slot))
        }
        Err(refusal) => Err(ProxyError::AtCapacity {
            upstream: upstream.name.clone(),
            refusal,
        }),
    }
}

/// The target a capped upstream's slot was given, else the balancer's pick (not one of
/// `tried` where it can).
fn target_of(upstream: &Upstream, slot: Option<&Slot>, at: Instant, tried: &[usize]) -> usize {
    slot.map_or_else(|| upstream.pick(at, tried), |s| s.target)
}

/// The upstream's answer made ready for the client, in place: hop-by-hop headers gone, and
/// on `101` the WebSocket tunnel set up (returned) and the connection kept from the pool.
fn prepare(
    res: &mut Response<Incoming>,
    lease: &mut Option<Lease>,
    client_side: Option<hyper::upgrade::OnUpgrade>,
    down: &Downstream<'_>,
) -> Option<Box<Tunnel>> {
    let websocket_idle = down.websocket_idle;
    // Only a switch of protocols needs the upstream's `Upgrade` after the strip.
    let upgrade = (res.status() == StatusCode::SWITCHING_PROTOCOLS)
        .then(|| res.headers().get(UPGRADE).cloned())
        .flatten();
    strip_hop_by_hop(res.headers_mut());
    let mut tunnel = None;
    if let (Some(client_side), StatusCode::SWITCHING_PROTOCOLS) = (client_side, res.status()) {
        let headers = res.headers_mut();
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(
            UPGRADE,
            upgrade.unwrap_or(HeaderValue::from_static("websocket")),
        );
        tunnel = Some(Box::new(Tunnel {
            client: client_side,
            upstream: hyper::upgrade::on(&mut *res),
            idle: websocket_idle,
            slots: crate::limiter::concurrency::Guard::default(),
        }));
    }
    if res.status() == StatusCode::SWITCHING_PROTOCOLS {
        // The connection now belongs to the tunnel (or is useless): never back in the pool.
        *lease = None;
    }
    tunnel
}

/// A method whose request may be sent twice with the effect of once (RFC 9110 9.2.2).
fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

/// The request again, for another target: its head as rewritten, and its body from the start;
/// `None` when the body was streamed and is gone.
fn copy(req: &Request<Guarded>) -> Option<Box<Request<Guarded>>> {
    let mut copy = Request::new(req.body().replay()?);
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    Some(Box::new(copy))
}

/// The last attempt failed too: say why (at most once a second per upstream, as a dead
/// backend fails every request), and the error the client gets.
fn given_up(
    upstream: &Upstream,
    target: usize,
    e: &SendError,
    route: &str,
    tried: &[usize],
) -> ProxyError {
    let error = classify(e);
    let now_us = upstream.health.ms(Instant::now()).saturating_mul(1000);
    if let Some(held_back) = upstream.log_gate.open(now_us) {
        tracing::warn!(
            upstream = &*upstream.name,
            target = upstream.targets[target].as_str(),
            route,
            attempts = tried.len(),
            status = error.status().as_u16(),
            error = %error_chain(e.as_error()),
            similar_since_last = held_back,
            "upstream request failed"
        );
    }
    error
}

/// The client's status for a request that got no response head.
/// How a failed attempt counts in `tollgate_upstream_target_attempts_total`.
fn attempt_result(e: &SendError) -> AttemptResult {
    match classify(e) {
        ProxyError::UpstreamTimeout => AttemptResult::timeout,
        _ => AttemptResult::unreachable,
    }
}

fn classify(e: &SendError) -> ProxyError {
    if let SendError::HeadTimeout = e {
        return ProxyError::UpstreamTimeout;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e.as_error());
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return ProxyError::UpstreamTimeout;
            }
        }
        source = s.source();
    }
    ProxyError::UpstreamUnreachable
}

/// `e` and its causes, `: `-separated.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut chain = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        chain.push_str(": ");
        chain.push_str(&s.to_string());
        source = s.source();
    }
    chain
}
