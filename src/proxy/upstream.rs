//! The forwarding stage of a request: its body held where the route buffers it, sent upstream,
//! the answer made ready for the client.

use http::{Request, Response};
use http_body::Body as _;
use hyper::body::Incoming;
use tokio::time::Instant;

use super::{ClientConn, Ctx};
use crate::body::Guarded;
use crate::error::ProxyError;
use crate::forward::{self, Downstream};
use crate::identity;
use crate::limiter;
use crate::response::Body;
use crate::runtime::{Action, Route, Runtime};
use http::HeaderValue;

/// Forward the request upstream (its body received whole first where the route buffers it)
/// and make the answer ready for the client.
/// `who`: the client's address and the identity a capped upstream's queue serves it by.
pub(super) async fn forward_to(
    cx: &mut Ctx<'_, '_>,
    route: &Route,
    upstream: &forward::Upstream,
    req: Box<Request<Incoming>>,
    who: (std::net::IpAddr, u128),
) -> Result<Response<Body>, ProxyError> {
    let Ctx {
        state,
        rt,
        conn,
        started,
        request_id,
        peer_trusted,
        trace,
    } = cx;
    let (state, rt, started) = (*state, *rt, *started);
    let down = &downstream(
        (conn, rt, request_id, *peer_trusted),
        route,
        who,
        (trace.grpc, trace.span.as_deref()),
    );
    // In a block: the request's parts, borrowed on the way, would otherwise be kept in this
    // future while the upstream is awaited.
    let grpc = trace.grpc;
    let (req, head, buffered) = {
        let (mut parts, body) = (*req).into_parts();
        let mut body = Guarded::new(body, route.body, started);
        trace.body_taken = true;
        // A body of unknown length is received whole first unless the upstream is known to
        // read chunked bodies: an HTTP/1.0 server would lose it, or read its chunks as requests.
        let unknown_length = || http_body::Body::size_hint(&body).exact().is_none();
        // A gRPC stream is never held: its messages go as they come, both ways.
        let buffered = !body.is_end_stream()
            && !grpc
            && (route.buffer_request || (unknown_length() && !upstream.takes_chunked()));
        if buffered {
            (body, trace.bytes_in) = forward::hold(body, &mut parts, &rt.store).await?;
        }
        trace.sent = body.sent();
        let head = parts.method == http::Method::HEAD;
        // Boxed: each stage down to hyper's client takes the request by value, and moved
        // whole it would be copied twice per async stage (into the stage's future, then into
        // its body's locals); boxed, those moves are of a pointer.
        (Box::new(Request::from_parts(parts, body)), head, buffered)
    };
    // Goes upstream now: with the in-process limiter that is microseconds after its arrival
    // (no clock read); a Redis check may have taken milliseconds.
    let now = if rt.redis.is_some() || buffered {
        Instant::now()
    } else {
        started
    };
    let sent = forward::send_timed(upstream, req, down, now, &state.metrics).await;
    if let Err(ProxyError::AtCapacity { refusal, .. }) = &sent {
        trace.refused = super::Refused::AtCapacity;
        trace.queued = refusal.waited;
    }
    let (forwarded, took) = sent?;
    trace.upstream = Some((forwarded.target, took));
    // An HTTP/1.0 answer may be read whole (if it has no length) before its head is ready.
    trace.head_ready =
        (forwarded.response.version() != http::Version::HTTP_10).then_some(forwarded.answered);
    trace.queued = forwarded.waited;
    trace.tunnel = forwarded.tunnel;
    let read_ahead = route.buffer_response && !head && trace.tunnel.is_none() && !grpc;
    forward::body_out(forwarded.response, read_ahead, &rt.store).await
}

/// The identity a capped upstream's queue serves the request by: its `queue.key`, else the
/// identity the route's first limit counted it under, else the client address.
/// 0 for a route tollgate answers itself, or an uncapped upstream.
pub(super) fn queue_key(
    action: &Action,
    view: &identity::RequestView<'_>,
    decision: Option<&limiter::Decision>,
    client_ip: std::net::IpAddr,
) -> u128 {
    let Action::Forward(upstream) = action else {
        return 0;
    };
    if upstream.gate.is_none() {
        return 0;
    }
    if let Some(key) = &upstream.queue_key {
        return view.resolve(key).0;
    }
    let counted = decision.and_then(|d| d.results.iter().find_map(|r| r.client));
    counted.map_or_else(
        || {
            u128::from(match client_ip {
                std::net::IpAddr::V4(a) => a.to_ipv6_mapped(),
                std::net::IpAddr::V6(a) => a,
            })
        },
        |id| id.0,
    )
}

/// What forwarding needs to know about the client (its connection, the config, the request's
/// ID, whether the peer is trusted) and the route.
fn downstream<'a>(
    (conn, rt, request_id, peer_trusted): (&'a ClientConn, &'a Runtime, &'a HeaderValue, bool),
    route: &'a Route,
    (client_ip, queue): (std::net::IpAddr, u128),
    (grpc, span): (bool, Option<&'a crate::telemetry::RequestSpan>),
) -> Downstream<'a> {
    let settings = &rt.settings;
    Downstream {
        peer: conn.peer.ip().to_canonical(),
        peer_value: &conn.peer_value,
        peer_trusted,
        tls: conn.tls,
        client_ip,
        websocket_allowed: route.websocket,
        grpc,
        wants_trailers: route.counts_responses && route.limits.iter().any(|l| l.settle.is_some()),
        websocket_idle: route.websocket_idle,
        underscores: settings.underscores_in_headers,
        untrusted_strip: &settings.strip_untrusted_headers,
        worker: conn.worker,
        route: &route.name,
        retry_idempotent: route.retry_idempotent,
        request_id: (&settings.request_id_header, request_id),
        queue: (queue, route.priority),
        span,
    }
}
