//! One request through the stages: route, identity, limits, then forward or answer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use http::{Request, Response, StatusCode, Version};
use http_body::Body as _;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::access_log::{self, Entry};
use crate::body::{BodyFailure, Guarded, HoldError, Sent};
use crate::buffer::{self, ReadAhead};
use crate::config::settings::Respond;
use crate::error::ProxyError;
use crate::forward::{self, Downstream, Tunnel};
use crate::identity::{self, RequestView};
use crate::limiter::{self, Outcome};
use crate::metrics::{UpstreamErrorKind, UpstreamErrorLabels};
use crate::pool::Pooled;
use crate::request_id;
use crate::response::{self, Body};
use crate::runtime::{Action, Route, Runtime};
use crate::screen;
use crate::state::State;

/// The downstream connection a request arrived on.
#[derive(Debug)]
pub struct ClientConn {
    pub peer: SocketAddr,
    /// The peer's address as a header value (`X-Forwarded-For`, `X-Real-IP`), rendered once.
    pub peer_value: http::HeaderValue,
    pub tls: bool,
    /// The listener's `max_uri_bytes`.
    pub max_uri_bytes: usize,
    /// The worker serving the connection.
    pub worker: usize,
}

impl ClientConn {
    pub fn new(peer: SocketAddr, tls: bool, max_uri_bytes: usize, worker: usize) -> Self {
        let peer_value = http::HeaderValue::try_from(peer.ip().to_canonical().to_string())
            .unwrap_or(http::HeaderValue::from_static("unknown"));
        Self {
            peer,
            peer_value,
            tls,
            max_uri_bytes,
            worker,
        }
    }
}

/// A request's answer, the WebSocket tunnel it opened (for the connection to run once the
/// response is written), and its access-log entry (written once the response body is done).
#[derive(Debug)]
pub struct Handled {
    pub response: Response<Body>,
    pub tunnel: Option<Tunnel>,
    pub access: Option<Entry>,
    /// The concurrency slots the request holds until its response (or tunnel) is done.
    pub slots: limiter::concurrency::Guard,
}

/// What the stages learned about a request, for the access log and metrics.
#[derive(Debug, Default)]
struct Trace<'a> {
    route: Option<&'a Route>,
    decision: Option<limiter::Decision>,
    client_ip: Option<std::net::IpAddr>,
    /// The request body went upstream (so it was, or is being, read).
    body_taken: bool,
    /// The WebSocket tunnel the upstream accepted.
    tunnel: Option<Tunnel>,
    /// The target that answered, and the time to its response head.
    upstream: Option<(usize, std::time::Duration)>,
    /// Request body bytes received whole (buffered); a streamed body's are counted by `sent`.
    bytes_in: u64,
    sent: Sent,
    /// The concurrency slots taken for the request (the candidate config's too).
    slots: limiter::concurrency::Guard,
    /// Refused by an operator's ban (`control`), before any limit.
    operator_ban: bool,
    /// `tollgate.keys` of a JSON access log (named when the line is written).
    keys: access_log::Digests,
}

/// Serve one request. Loads the config snapshot exactly once; every error becomes its response
/// here and nowhere else.
pub async fn handle(state: &State, conn: &ClientConn, req: Request<Incoming>) -> Handled {
    let started = Instant::now();
    let runtime = state.current();
    let id_header = &runtime.settings.request_id_header;
    let request_id = request_id::resolve(req.headers(), id_header, || {
        identity::is_trusted(conn.peer.ip(), &runtime.settings.trusted_proxies)
    });
    let mut entry = access_log::enabled().then(|| {
        Entry::begin(
            &req,
            (conn.peer.ip(), &conn.peer_value),
            conn.tls,
            request_id.clone(),
            started,
        )
    });
    let version = req.version();
    let has_body = !req.body().is_end_stream();
    let mut trace = Trace::default();
    let Some(_admitted) = Admission::enter(&state.inflight, runtime.settings.max_inflight) else {
        state.metrics.overloaded.inc();
        let mut response = response::from_error(&ProxyError::Overloaded);
        response.headers_mut().insert(id_header.clone(), request_id);
        record(state, &trace, response.status(), started, &mut entry);
        return Handled {
            response,
            tunnel: None,
            access: entry,
            slots: limiter::concurrency::Guard::default(),
        };
    };
    let pipeline = pipeline(state, &runtime, conn, req, started, &request_id, &mut trace);
    let (mut res, close) = match pipeline.await {
        Ok(res) => (res, false),
        Err(err) => {
            tracing::debug!(error = %err, "request failed");
            (response::from_error(&err), err.closes_connection())
        }
    };
    // An unread request body must never be parsed as the next request: close instead.
    if version <= Version::HTTP_11 && (close || (has_body && !trace.body_taken)) {
        res.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
    }
    // Every answer carries the ID, tollgate's own included.
    res.headers_mut().insert(id_header.clone(), request_id);
    record(state, &trace, res.status(), started, &mut entry);
    let mut slots = std::mem::take(&mut trace.slots);
    let mut tunnel = trace.tunnel.take();
    // A WebSocket holds its slots until the tunnel closes.
    if let Some(t) = &mut tunnel {
        t.slots = std::mem::take(&mut slots);
    }
    Handled {
        response: res,
        tunnel,
        access: entry,
        slots,
    }
}

/// A request counted against `max_inflight` while it lives.
struct Admission<'a>(&'a AtomicUsize);

impl<'a> Admission<'a> {
    /// Count a request in `inflight`; `None` (still counted until dropped) past `max`.
    fn enter(inflight: &'a AtomicUsize, max: usize) -> Option<Self> {
        let before = inflight.fetch_add(1, Ordering::AcqRel);
        let admitted = Self(inflight);
        (before < max).then_some(admitted)
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

// The stages in order, read top to bottom: split further, they would read as a list of calls.
#[allow(clippy::too_many_lines)]
async fn pipeline<'a>(
    state: &State,
    rt: &'a Runtime,
    conn: &ClientConn,
    mut req: Request<Incoming>,
    started: Instant,
    request_id: &http::HeaderValue,
    trace: &mut Trace<'a>,
) -> Result<Response<Body>, ProxyError> {
    screen::screen(&mut req, conn.max_uri_bytes)?;
    let settings = &*rt.settings;
    let Some(route) = rt.find(&req) else {
        return Err(unrouted(state, rt, conn, &req, started, &mut trace.slots));
    };
    trace.route = Some(route);
    // A request without a body (every GET) declares nothing worth a header lookup.
    if !req.body().is_end_stream()
        && declared_length(&req).is_some_and(|n| n > route.body.max_bytes)
    {
        return Err(ProxyError::PayloadTooLarge);
    }
    let client_ip = identity::client_ip_from(
        conn.peer.ip(),
        req.headers(),
        &settings.trusted_proxies,
        settings.client_ip_header,
    );
    trace.client_ip = Some(client_ip);
    // A case-insensitive route's limits count `/Admin` where they count `/admin`.
    let folded;
    let uri = if route.fold_path && req.uri().path().bytes().any(|b| b.is_ascii_uppercase()) {
        folded = identity::fold_path(req.uri()).ok_or(ProxyError::BadRequest)?;
        &folded
    } else {
        req.uri()
    };
    // Verified on first use by a `jwt:` source, once for all the route's limits.
    let jwt = (settings.jwt.as_deref())
        .map(|v| identity::jwt::Context::new(v, identity::bearer(req.headers())));
    let view = RequestView {
        method: req.method(),
        uri,
        headers: req.headers(),
        client_ip,
        jwt: jwt.as_ref(),
    };
    // Operators' bans and overrides (`control`): one atomic load while there are none.
    let control = state.control.active();
    let tuned = match operators(state, control.as_deref(), &view, route, trace) {
        Ok(tuned) => tuned,
        Err(refused) => return Ok(*refused),
    };
    let redis = rt.redis.as_deref();
    // The request's arrival is "now" for the in-process limiter: one clock read fewer.
    let asked = redis.is_some().then(Instant::now);
    let now_us = state.clock.at_us(asked.unwrap_or(started));
    let decision = decide(conn, route, (&view, &tuned), now_us, &mut trace.slots, rt).await;
    if let (Some(asked), false) = (asked, route.limits.is_empty()) {
        state
            .metrics
            .backend_seconds
            .observe(asked.elapsed().as_secs_f64());
    }
    let decision = trace.decision.insert(decision);
    // For replay (`tollgate simulate`): only with a JSON access log.
    if !route.logged_keys.is_empty() && access_log::json() {
        trace.keys = route.logged_keys.digests(&view);
    }
    if let Some(rejected) = decision.rejected_by() {
        // Refused by a rate limit: its concurrency slots are given back at once.
        trace.slots = limiter::concurrency::Guard::default();
        beside(rt, &req, client_ip, now_us, &mut trace.slots);
        if rejected.outcome == Outcome::FailedClosed {
            let limit = route.limits[rejected.index].name.clone();
            return Err(ProxyError::LimiterUnavailable { limit });
        }
        return Ok(response::too_many_requests(
            &route.limits,
            &route.rendered,
            decision,
            settings.headers,
        ));
    }
    beside(rt, &req, client_ip, now_us, &mut trace.slots);
    let mut res = match &route.action {
        Action::Forward(upstream) => {
            let down = downstream(conn, settings, route, client_ip, request_id);
            let (mut parts, body) = req.into_parts();
            let mut body = Guarded::new(body, route.body, started);
            trace.body_taken = true;
            let buffered = route.buffer_request && !body.is_end_stream();
            if buffered {
                let len;
                (body, len) = hold(body, &mut parts, &rt.store).await?;
                trace.bytes_in = len;
            }
            let sent = body.sent();
            trace.sent = sent.clone();
            let head = parts.method == http::Method::HEAD;
            // Boxed: each stage down to hyper's client takes the request by value, and moved
            // whole it would be copied twice per async stage (into the stage's future, then
            // into its body's locals); boxed, those moves are of a pointer.
            let req = Box::new(Request::from_parts(parts, body));
            // Goes upstream now: with the in-process limiter that is microseconds after its
            // arrival (no clock read); a Redis check may have taken milliseconds.
            let now = if redis.is_some() || buffered {
                Instant::now()
            } else {
                started
            };
            let (forwarded, took) = forward_timed(state, upstream, req, down, &sent, now).await?;
            trace.upstream = Some((forwarded.target, took));
            trace.tunnel = forwarded.tunnel;
            let read_ahead = route.buffer_response && !head && trace.tunnel.is_none();
            body_out(forwarded.response, read_ahead, &rt.store).await?
        }
        Action::Respond(r) => respond(r),
    };
    response::add_headers(
        res.headers_mut(),
        &route.limits,
        &route.rendered,
        decision,
        settings.headers,
    );
    Ok(res)
}

/// The candidate config's decision of the request (see `candidate`), beside the live one,
/// whatever that was; it never changes the answer. Its slots join `slots`, the request's.
#[inline]
fn beside<B>(
    rt: &Runtime,
    req: &Request<B>,
    client_ip: std::net::IpAddr,
    now_us: f64,
    slots: &mut limiter::concurrency::Guard,
) {
    if let Some(c) = &rt.candidate {
        c.evaluate(req, client_ip, now_us, slots);
    }
}

/// A request the live config has no route for: the candidate config may have one.
fn unrouted<B>(
    state: &State,
    rt: &Runtime,
    conn: &ClientConn,
    req: &Request<B>,
    started: Instant,
    slots: &mut limiter::concurrency::Guard,
) -> ProxyError {
    if let Some(c) = &rt.candidate {
        let now_us = state.clock.at_us(started);
        c.evaluate_unrouted(&rt.settings, conn.peer.ip(), req, now_us, slots);
    }
    ProxyError::NoRoute
}

/// The route's limits for one request: concurrency slots first (into `slots`), so that a
/// request they refuse takes no token from a rate limit, then the rate limits.
async fn decide(
    conn: &ClientConn,
    route: &Route,
    (view, tuned): (&RequestView<'_>, &[Option<&limiter::Tuning>]),
    now_us: f64,
    slots: &mut limiter::concurrency::Guard,
    rt: &Runtime,
) -> limiter::Decision {
    let (worker, redis) = (conn.worker, rt.redis.as_deref());
    let mut taken = limiter::Small::new();
    if limiter::concurrency::any(&route.limits) {
        let acquire = crate::boxed(|| limiter::concurrency::acquire(redis, &route.limits, view));
        (*slots, taken) = acquire.await;
    }
    if taken
        .iter()
        .any(|r| matches!(r.outcome, Outcome::Limited | Outcome::FailedClosed))
    {
        return limiter::Decision {
            results: taken.into_iter().collect(),
        };
    }
    let mut d =
        limiter::decide_tuned(redis, Some(worker), &route.limits, view, now_us, tuned).await;
    d.results.extend(taken);
    d
}

/// The operators' entries for one request (`control`): the numbers of its limits' overrides,
/// or the answer of a ban that refuses it (counted).
fn operators<'t>(
    state: &State,
    table: Option<&'t crate::control::Table>,
    view: &RequestView<'_>,
    route: &Route,
    trace: &mut Trace<'_>,
) -> Result<limiter::Small<Option<&'t limiter::Tuning>>, Box<Response<Body>>> {
    let Some(table) = table else {
        return Ok(limiter::Small::new());
    };
    if let Some(refused) = table.refusal_of(view, &route.name) {
        let labels = crate::metrics::RouteLabels {
            route: route.name.to_string(),
        };
        let banned = &state.metrics.admin_banned_requests;
        banned.get_or_create(&labels).inc();
        trace.operator_ban = true;
        return Err(Box::new(refused));
    }
    Ok(table.tunings(view, &route.limits))
}

/// What forwarding needs to know about the client and the route.
fn downstream<'a>(
    conn: &'a ClientConn,
    settings: &'a crate::config::Settings,
    route: &'a Route,
    client_ip: std::net::IpAddr,
    request_id: &'a http::HeaderValue,
) -> Downstream<'a> {
    let peer = conn.peer.ip().to_canonical();
    Downstream {
        peer,
        peer_value: &conn.peer_value,
        peer_trusted: identity::is_trusted(peer, &settings.trusted_proxies),
        tls: conn.tls,
        client_ip,
        websocket_allowed: route.websocket,
        websocket_idle: route.websocket_idle,
        underscores: settings.underscores_in_headers,
        untrusted_strip: &settings.strip_untrusted_headers,
        worker: conn.worker,
        route: &route.name,
        retry_idempotent: route.retry_idempotent,
        request_id: (&settings.request_id_header, request_id),
    }
}

/// Receive the request body whole (see `buffer`), and say its length upstream.
async fn hold(
    body: Guarded,
    parts: &mut http::request::Parts,
    store: &buffer::Store,
) -> Result<(Guarded, u64), ProxyError> {
    let (held, len) = body.hold(store).await.map_err(|e| match e {
        HoldError::Body(why) => body_error(why),
        HoldError::Store(e) => {
            tracing::warn!(error = %e, dir = %store.temp_dir.display(), "cannot buffer a request body");
            ProxyError::BufferUnavailable
        }
    })?;
    let headers = &mut parts.headers;
    headers.remove(http::header::TRANSFER_ENCODING);
    // The body is here already: the upstream has nothing to wait for.
    headers.remove(http::header::EXPECT);
    headers.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(len));
    Ok((held, len))
}

/// The upstream response as the client gets it: read ahead (`buffer::read_ahead`), or
/// streamed as the client reads. An HTTP/1.0 upstream's answer goes out in the client's
/// protocol: the client keeps its keep-alive; read ahead, a body that ends with the upstream's
/// connection is read whole first (up to the memory bound) so it gets a Content-Length.
async fn body_out(
    mut res: Response<Pooled>,
    read_ahead: bool,
    store: &buffer::Store,
) -> Result<Response<Body>, ProxyError> {
    let close_delimited = res.version() == Version::HTTP_10
        && !res.headers().contains_key(http::header::CONTENT_LENGTH);
    *res.version_mut() = Version::HTTP_11;
    if !read_ahead || res.body().is_end_stream() {
        return Ok(res.map(|b| Either::Left(Either::Left(b))));
    }
    let (parts, body) = res.into_parts();
    let body = match buffer::read_ahead(body, store, close_delimited).await {
        Ok(ReadAhead::Complete(bytes)) => Either::Right(Full::new(bytes)),
        Ok(ReadAhead::Spooled(spooled)) => Either::Left(Either::Right(spooled)),
        Err(e) => {
            tracing::warn!(error = %e, dir = %store.temp_dir.display(), "cannot buffer a response body");
            return Err(ProxyError::BufferUnavailable);
        }
    };
    Ok(Response::from_parts(parts, body))
}

/// The error a request body's failure answers with.
fn body_error(why: BodyFailure) -> ProxyError {
    match why {
        BodyFailure::Idle | BodyFailure::Deadline => ProxyError::RequestTimeout,
        BodyFailure::TooLarge => ProxyError::PayloadTooLarge,
        BodyFailure::Malformed => ProxyError::BadRequest,
    }
}

/// The Content-Length the client declared, if any.
fn declared_length<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

async fn forward_timed(
    state: &State,
    upstream: &forward::Upstream,
    req: Box<Request<Guarded>>,
    down: Downstream<'_>,
    body: &Sent,
    now: Instant,
) -> Result<(forward::Forwarded, std::time::Duration), ProxyError> {
    // A request whose own body failed is the client's fault, not the upstream's.
    // Boxed: the exchange's state is large, and every future that held it inline (this one,
    // the pipeline's, the request's) would be copied in full each time one is created and
    // moved.
    // In a statement of its own: a temporary of the `.await` statement would be kept in this
    // future's state, unboxed, for the whole exchange.
    let exchange = crate::boxed(|| forward::send(upstream, req, down, now));
    let result = exchange
        .await
        .map_err(|e| body.failure().map_or(e, body_error));
    let mut took = std::time::Duration::ZERO;
    let kind = match &result {
        Ok(_) => {
            took = now.elapsed();
            upstream.seconds.observe(took.as_secs_f64());
            None
        }
        Err(ProxyError::UpstreamTimeout) => Some(UpstreamErrorKind::timeout),
        Err(ProxyError::UpstreamUnreachable | ProxyError::UpstreamInvalid) => {
            Some(UpstreamErrorKind::unreachable)
        }
        Err(_) => None,
    };
    if let Some(kind) = kind {
        let labels = UpstreamErrorLabels {
            upstream: upstream.name.to_string(),
            kind,
        };
        state.metrics.upstream_errors.get_or_create(&labels).inc();
    }
    result.map(|forwarded| (forwarded, took))
}

fn respond(r: &Respond) -> Response<Body> {
    let mut res: Response<Body> = Response::new(Either::Right(Full::new(r.body.clone())));
    *res.status_mut() = r.status;
    *res.headers_mut() = r.headers.clone();
    if !res.headers().contains_key(http::header::CONTENT_TYPE) {
        res.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain; charset=utf-8"),
        );
    }
    res
}

/// Count the request and its limit decisions, and complete its access-log entry.
fn record(
    state: &State,
    trace: &Trace<'_>,
    status: StatusCode,
    started: Instant,
    entry: &mut Option<Entry>,
) {
    count(state, trace, status, started);
    let Some(entry) = entry else { return };
    entry.status = status.as_u16();
    entry.client_ip = trace.client_ip;
    entry.bytes_in = trace.bytes_in;
    entry.body_in = trace.sent.clone();
    let Some(route) = trace.route else {
        return;
    };
    entry.route.extend_from_slice(route.name.as_bytes());
    if !trace.keys.is_empty() {
        entry.keys = route.logged_keys.render(&trace.keys);
    }
    if let (Action::Forward(upstream), Some((target, took))) = (&route.action, trace.upstream) {
        if let Some(t) = upstream.targets.get(target) {
            entry.upstream.extend_from_slice(t.as_str().as_bytes());
        }
        entry.upstream_time = Some(took);
    }
    if trace.operator_ban {
        entry.outcome = "operator-ban";
    }
    let Some(decision) = &trace.decision else {
        return;
    };
    // The digest the closest limit counted this request under (never the raw identity).
    let closest = decision
        .rejected_by()
        .or_else(|| decision.reported().map(|(r, _)| r));
    entry.client = closest.and_then(|r| r.client).map(|id| (id.0 >> 64) as u64);
    let limit;
    (entry.outcome, limit) = match decision.rejected_by() {
        Some(r) if r.outcome == Outcome::FailedClosed => {
            ("store-unavailable", Some(&route.limits[r.index].name))
        }
        Some(r) if r.fallback => ("limited-without-store", Some(&route.limits[r.index].name)),
        Some(r) => ("limited", Some(&route.limits[r.index].name)),
        None if decision.results.iter().any(|r| r.fallback) => ("admitted-without-store", None),
        None => ("admitted", None),
    };
    if let Some(limit) = limit {
        entry.limit.extend_from_slice(limit.as_bytes());
    }
}

/// Count the request, its duration and its limit decisions: through the route's cached
/// handles, so no label is built on the request path (requests that matched no route are rare:
/// 404s).
fn count(state: &State, trace: &Trace<'_>, status: StatusCode, started: Instant) {
    let m = &state.metrics;
    let Some(route) = trace.route else {
        m.unrouted(status);
        return;
    };
    let counters = &route.counters;
    counters.request(status);
    counters.duration.observe(started.elapsed().as_secs_f64());
    let Some(decision) = &trace.decision else {
        return;
    };
    if decision.without_backend() {
        m.without_backend.inc();
    }
    counters.decided(decision);
    for r in &decision.results {
        let family = match r.ban {
            limiter::ban::BanEvent::None => continue,
            limiter::ban::BanEvent::Refused => &m.banned_requests,
            limiter::ban::BanEvent::Started(_) => &m.bans,
            limiter::ban::BanEvent::Lifted => &m.ban_lifts,
        };
        let labels = crate::metrics::RouteLimitLabels {
            route: route.name.to_string(),
            limit: route.limits[r.index].name.to_string(),
        };
        family.get_or_create(&labels).inc();
    }
    for r in &decision.results {
        if r.outcome == Outcome::ShadowLimited {
            tracing::info!(
                route = &*route.name,
                limit = &*route.limits[r.index].name,
                "shadow limit exceeded (dry run: not enforced)"
            );
        }
    }
}
