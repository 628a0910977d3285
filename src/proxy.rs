//! One request through the stages: route, identity, limits, then forward or answer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use http::{Request, Response, StatusCode, Version};
use http_body::Body as _;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::access_log::{self, Entry};
use crate::body::{Guarded, Sent};
use crate::config::settings::Respond;
use crate::error::ProxyError;
use crate::forward::{self, Downstream, Tunnel};
use crate::identity::{self, Arrival, RequestView};
use crate::limiter::{self, Outcome};
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

/// The stages in order: screen, route, client, operators' entries, limits (and the candidate
/// config's beside them), then forward or answer. Each stage returns a value or an error; none
/// writes to the socket.
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
    let route = route(state, rt, conn, &req, started, trace)?;
    let client_ip = client(&rt.settings, conn, &req, trace);
    let arrival = Arrival::of(&req, client_ip);
    // Verified on first use by a `jwt:` source, once for all the route's limits.
    let jwt = rt.settings.jwt.as_deref().map(|v| arrival.jwt(v));
    let view = arrival.view(route.fold_path, jwt.as_ref());
    let control = state.control.active();
    let tuned = match operators(state, control.as_deref(), &view, route, trace) {
        Ok(tuned) => tuned,
        Err(refused) => return Ok(*refused),
    };
    let now_us = limits(state, rt, conn, route, (&view, &tuned), started, trace).await;
    beside(rt, &arrival, now_us, &mut trace.slots);
    let decision = trace.decision.as_ref().expect("decided above");
    if let Some(refused) = refusal(route, decision, rt.settings.headers) {
        // Refused by a rate limit: its concurrency slots are given back at once.
        trace.slots = limiter::concurrency::Guard::default();
        return refused;
    }
    let mut res = match &route.action {
        Action::Forward(upstream) => {
            let down = downstream(conn, &rt.settings, route, client_ip, request_id);
            forward_to(state, rt, route, upstream, req, down, started, trace).await?
        }
        Action::Respond(r) => respond(r),
    };
    let decision = trace.decision.as_ref().expect("decided above");
    response::add_headers(
        res.headers_mut(),
        &route.limits,
        &route.rendered,
        decision,
        rt.settings.headers,
    );
    Ok(res)
}

/// The live route of the request, or `NoRoute` (the candidate config decides it anyway); a
/// declared body over the route's `max_body` is refused here, before anything is read.
fn route<'a, B: http_body::Body>(
    state: &State,
    rt: &'a Runtime,
    conn: &ClientConn,
    req: &Request<B>,
    started: Instant,
    trace: &mut Trace<'a>,
) -> Result<&'a Route, ProxyError> {
    let Some(route) = rt.find(req) else {
        if let Some(c) = &rt.candidate {
            let client_ip = client_ip(&rt.settings, conn, req);
            let arrival = Arrival::of(req, client_ip);
            c.evaluate(&arrival, state.clock.at_us(started), &mut trace.slots);
        }
        return Err(ProxyError::NoRoute);
    };
    trace.route = Some(route);
    // A request without a body (every GET) declares nothing worth a header lookup.
    if !req.body().is_end_stream() && declared_length(req).is_some_and(|n| n > route.body.max_bytes)
    {
        return Err(ProxyError::PayloadTooLarge);
    }
    Ok(route)
}

/// The client address, through the trusted proxies.
fn client<B>(
    settings: &crate::config::Settings,
    conn: &ClientConn,
    req: &Request<B>,
    trace: &mut Trace<'_>,
) -> std::net::IpAddr {
    let ip = client_ip(settings, conn, req);
    trace.client_ip = Some(ip);
    ip
}

fn client_ip<B>(
    settings: &crate::config::Settings,
    conn: &ClientConn,
    req: &Request<B>,
) -> std::net::IpAddr {
    identity::client_ip_from(
        conn.peer.ip(),
        req.headers(),
        &settings.trusted_proxies,
        settings.client_ip_header,
    )
}

/// Decide the route's limits (into `trace`); returns the instant they were decided at, on the
/// limiter's clock, for the candidate config to decide at too.
async fn limits(
    state: &State,
    rt: &Runtime,
    conn: &ClientConn,
    route: &Route,
    asked: (&RequestView<'_>, &[Option<&limiter::Tuning>]),
    started: Instant,
    trace: &mut Trace<'_>,
) -> f64 {
    let redis = rt.redis.as_deref();
    // The request's arrival is "now" for the in-process limiter: one clock read fewer.
    let sent = redis.is_some().then(Instant::now);
    let now_us = state.clock.at_us(sent.unwrap_or(started));
    let decision = decide(conn, route, asked, now_us, &mut trace.slots, rt).await;
    if let (Some(sent), false) = (sent, route.limits.is_empty()) {
        let took = sent.elapsed().as_secs_f64();
        state.metrics.backend_seconds.observe(took);
    }
    trace.decision = Some(decision);
    // For replay (`tollgate simulate`): only with a JSON access log.
    if !route.logged_keys.is_empty() && access_log::json() {
        trace.keys = route.logged_keys.digests(asked.0);
    }
    now_us
}

/// The answer to a request a limit refused: 429, or 503 when a `closed` limit's store is away.
fn refusal(
    route: &Route,
    decision: &limiter::Decision,
    headers: crate::config::settings::HeaderPolicy,
) -> Option<Result<Response<Body>, ProxyError>> {
    let rejected = decision.rejected_by()?;
    if rejected.outcome == Outcome::FailedClosed {
        let limit = route.limits[rejected.index].name.clone();
        return Some(Err(ProxyError::LimiterUnavailable { limit }));
    }
    let limits = &route.limits;
    Some(Ok(response::too_many_requests(
        limits,
        &route.rendered,
        decision,
        headers,
    )))
}

/// The candidate config's decision of the request (see `candidate`), beside the live one,
/// whatever that was; it never changes the answer. Its slots join `slots`, the request's.
#[inline]
fn beside(
    rt: &Runtime,
    arrival: &Arrival<'_>,
    now_us: f64,
    slots: &mut limiter::concurrency::Guard,
) {
    if let Some(c) = &rt.candidate {
        c.evaluate(arrival, now_us, slots);
    }
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
/// or the answer of a ban that refuses it (counted). One atomic load while there are none.
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

/// Forward the request upstream (its body received whole first where the route buffers it)
/// and make the answer ready for the client.
#[allow(clippy::too_many_arguments)] // the request, where it goes, and what it is traced into
async fn forward_to(
    state: &State,
    rt: &Runtime,
    route: &Route,
    upstream: &forward::Upstream,
    req: Request<Incoming>,
    down: Downstream<'_>,
    started: Instant,
    trace: &mut Trace<'_>,
) -> Result<Response<Body>, ProxyError> {
    let (mut parts, body) = req.into_parts();
    let mut body = Guarded::new(body, route.body, started);
    trace.body_taken = true;
    let buffered = route.buffer_request && !body.is_end_stream();
    if buffered {
        (body, trace.bytes_in) = forward::hold(body, &mut parts, &rt.store).await?;
    }
    trace.sent = body.sent();
    let head = parts.method == http::Method::HEAD;
    // Boxed: each stage down to hyper's client takes the request by value, and moved whole it
    // would be copied twice per async stage (into the stage's future, then into its body's
    // locals); boxed, those moves are of a pointer.
    let req = Box::new(Request::from_parts(parts, body));
    // Goes upstream now: with the in-process limiter that is microseconds after its arrival
    // (no clock read); a Redis check may have taken milliseconds.
    let now = if rt.redis.is_some() || buffered {
        Instant::now()
    } else {
        started
    };
    let (forwarded, took) = forward::send_timed(upstream, req, down, now, &state.metrics).await?;
    trace.upstream = Some((forwarded.target, took));
    trace.tunnel = forwarded.tunnel;
    let read_ahead = route.buffer_response && !head && trace.tunnel.is_none();
    forward::body_out(forwarded.response, read_ahead, &rt.store).await
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

/// The Content-Length the client declared, if any.
fn declared_length<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
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

/// Count the request and its limit decisions (`metrics`), and complete its access-log entry.
fn record(
    state: &State,
    trace: &Trace<'_>,
    status: StatusCode,
    started: Instant,
    entry: &mut Option<Entry>,
) {
    let route = trace.route.map(|r| (&r.counters, &*r.name, &r.limits[..]));
    state
        .metrics
        .count_request(route, status, started, trace.decision.as_ref());
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
    if let Some(decision) = &trace.decision {
        let limit;
        (entry.outcome, entry.client, limit) = decision.logged();
        if let Some(i) = limit {
            entry
                .limit
                .extend_from_slice(route.limits[i].name.as_bytes());
        }
    }
}
