//! One request through the stages: route, identity, limits, then forward or answer.

use std::net::SocketAddr;

use arc_swap::{ArcSwap, Guard};
use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response, StatusCode, Version};
use http_body::Body as _;
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::body::{BodyFailure, Guarded, Sent};
use crate::config::reload::ReloadStats;
use crate::config::Snapshot;
use crate::error::ProxyError;
use crate::forward::{self, Downstream};
use crate::guard;
use crate::identity::{self, RequestView};
use crate::limiter::{self, local::Clock, Outcome};
use crate::metrics::{
    Metrics, OutcomeLabel, RequestLabels, StatusClass, UpstreamErrorKind, UpstreamErrorLabels,
    UpstreamLabels,
};
use crate::response::{self, Body};
use crate::route::{self, Action, Respond};

/// What every request shares: the current config and the limiter clock.
#[derive(Debug)]
pub struct State {
    pub config: ArcSwap<Snapshot>,
    pub clock: Clock,
    pub reloads: ReloadStats,
    pub metrics: Metrics,
    /// Requests in flight, all listeners together (for `max_inflight`).
    pub inflight: AtomicUsize,
}

impl Conn {
    pub fn new(peer: SocketAddr, tls: bool, max_uri_bytes: usize) -> Self {
        let peer_value = http::HeaderValue::try_from(peer.ip().to_canonical().to_string())
            .unwrap_or(http::HeaderValue::from_static("unknown"));
        Self {
            peer,
            peer_value,
            tls,
            max_uri_bytes,
            tunnel: forward::TunnelSlot::new(None),
        }
    }
}

impl State {
    pub fn new(snapshot: Snapshot) -> Self {
        Self {
            config: ArcSwap::from_pointee(snapshot),
            clock: Clock::new(),
            reloads: ReloadStats {
                generation: 1.into(),
                ..ReloadStats::default()
            },
            metrics: Metrics::new(),
            inflight: AtomicUsize::new(0),
        }
    }
}

/// The downstream connection a request arrived on.
#[derive(Debug)]
pub struct Conn {
    pub peer: SocketAddr,
    /// The peer's address as a header value (`X-Forwarded-For`, `X-Real-IP`), rendered once.
    pub peer_value: http::HeaderValue,
    pub tls: bool,
    /// The listener's `max_uri_bytes`.
    pub max_uri_bytes: usize,
    /// A WebSocket tunnel this connection's request set up, for the connection's task to run.
    pub tunnel: forward::TunnelSlot,
}

/// What the stages learned about a request, for the access log and metrics.
#[derive(Debug, Default)]
struct Trace<'a> {
    route: Option<&'a route::Route>,
    decision: Option<limiter::Decision>,
    client_ip: Option<std::net::IpAddr>,
    /// The request body went upstream (so it was, or is being, read).
    body_taken: bool,
}

/// Serve one request. Loads the config snapshot exactly once; every error becomes its response
/// here and nowhere else.
pub async fn handle(state: &State, conn: &Conn, req: Request<Incoming>) -> Response<Body> {
    let started = Instant::now();
    let snapshot = current(state);
    // The path is kept only for the access log, and only when it is on.
    let path = if tracing::enabled!(target: "tollgate::access", tracing::Level::INFO) {
        req.uri().path().to_owned()
    } else {
        String::new()
    };
    let (method, version) = (req.method().clone(), req.version());
    let has_body = !req.body().is_end_stream();
    let mut trace = Trace::default();
    let Some(_inflight) = Inflight::enter(state, snapshot.max_inflight) else {
        state.metrics.overloaded.inc();
        let res = response::from_error(&ProxyError::Overloaded);
        record(state, &trace, &method, &path, res.status(), started);
        return res;
    };
    let (mut res, close) = match pipeline(state, &snapshot, conn, req, started, &mut trace).await {
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
    record(state, &trace, &method, &path, res.status(), started);
    res
}

/// A snapshot as one thread holds it. The second `Arc` is the point: a reference count that
/// only this thread's requests write.
#[allow(clippy::redundant_allocation)]
type Held = Arc<Arc<Snapshot>>;

thread_local! {
    /// The snapshot this thread last served with.
    static SEEN: RefCell<Option<Held>> = const { RefCell::new(None) };
}

/// The live config snapshot, as a reference only this worker thread counts.
///
/// Every request holds the snapshot it started with. Cloning the `Arc` of the live snapshot
/// would have every worker write the same reference count twice per request, and each of those
/// writes waits for the line to come back from the other core. Instead each thread keeps the
/// snapshot it last saw in an `Arc` of its own, and its requests clone that one; checking that
/// it is still the live one is a read (`ArcSwap::load`), and a reload makes each thread take the
/// new snapshot on its next request (and `forget_snapshot` drops the old one of an idle worker).
fn current(state: &State) -> Held {
    let live = state.config.load();
    SEEN.with_borrow_mut(|seen| match seen {
        Some(held) if Arc::ptr_eq(&**held, &*live) => held.clone(),
        _ => seen.insert(Arc::new(Guard::into_inner(live))).clone(),
    })
}

/// Let go of the snapshot this thread last served with, so that a worker with no requests does
/// not keep a replaced config (its Redis connections, its buckets) alive. Run on every worker
/// after a reload.
pub fn forget_snapshot() {
    SEEN.with_borrow_mut(Option::take);
}

/// Counts a request in flight while it lives.
struct Inflight<'a>(&'a AtomicUsize);

impl<'a> Inflight<'a> {
    fn enter(state: &'a State, max: usize) -> Option<Self> {
        let before = state.inflight.fetch_add(1, Ordering::AcqRel);
        let guard = Self(&state.inflight);
        (before < max).then_some(guard)
    }
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn pipeline<'a>(
    state: &State,
    snap: &'a Snapshot,
    conn: &Conn,
    mut req: Request<Incoming>,
    started: Instant,
    trace: &mut Trace<'a>,
) -> Result<Response<Body>, ProxyError> {
    guard::screen(&mut req, conn.max_uri_bytes)?;
    let route = route::find_indexed(
        &snap.routes,
        &snap.route_index,
        req.method(),
        req.uri(),
        req.headers(),
    )
    .ok_or(ProxyError::NoRoute)?;
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
        &snap.trusted_proxies,
        snap.client_ip_header,
    );
    trace.client_ip = Some(client_ip);
    let view = RequestView {
        method: req.method(),
        uri: req.uri(),
        headers: req.headers(),
        client_ip,
    };
    let redis = snap.redis.as_deref();
    // The request's arrival is "now" for the in-process limiter: one clock read fewer.
    let asked = redis.is_some().then(Instant::now);
    let now_us = state.clock.at_us(asked.unwrap_or(started));
    let decision = limiter::decide(redis, &route.limits, &view, now_us).await;
    if let (Some(asked), false) = (asked, route.limits.is_empty()) {
        state
            .metrics
            .backend_seconds
            .observe(asked.elapsed().as_secs_f64());
    }
    let decision = trace.decision.insert(decision);
    if let Some(rejected) = decision.rejected_by() {
        if rejected.outcome == Outcome::FailedClosed {
            let limit = route.limits[rejected.index].name.clone();
            return Err(ProxyError::LimiterUnavailable { limit });
        }
        return Ok(response::too_many_requests(route, decision, snap.headers));
    }
    let mut res = match &route.action {
        Action::Forward(upstream) => {
            let peer = conn.peer.ip().to_canonical();
            let down = Downstream {
                peer,
                peer_value: &conn.peer_value,
                peer_trusted: identity::is_trusted(peer, &snap.trusted_proxies),
                tls: conn.tls,
                client_ip,
                websocket_allowed: route.websocket,
                websocket_idle: route.websocket_idle,
                underscores: snap.underscores_in_headers,
                tunnel: &conn.tunnel,
            };
            let (parts, body) = req.into_parts();
            let body = Guarded::new(body, route.body, started.into());
            let sent = body.sent();
            trace.body_taken = true;
            // Boxed: each stage down to hyper's client takes the request by value, and moved
            // whole it is 352 bytes, copied twice per async stage (into the stage's future,
            // then into its body's locals); boxed, those moves are of a pointer.
            let req = Box::new(Request::from_parts(parts, body));
            // Goes upstream now: with the in-process limiter that is microseconds after its
            // arrival (no clock read); a Redis check may have taken milliseconds.
            let now = if redis.is_some() {
                Instant::now()
            } else {
                started
            };
            forward_timed(state, upstream, req, down, &sent, now).await?
        }
        Action::Respond(r) => respond(r),
    };
    response::add_headers(res.headers_mut(), route, decision, snap.headers);
    Ok(res)
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
) -> Result<Response<Body>, ProxyError> {
    // A request whose own body failed is the client's fault, not the upstream's.
    // Boxed: the exchange's state is about 2 KB, and every future that held it inline (this
    // one, the pipeline's, the request's) would be copied in full each time one is created
    // and moved: memcpy was the largest user-space item of a forwarded request's profile.
    // In a statement of its own: a temporary of the `.await` statement would be kept in this
    // future's state, unboxed, for the whole exchange.
    let exchange = crate::boxed(|| forward::send(upstream, req, down, now.into()));
    let result = exchange.await.map_err(|e| match body.failure() {
        Some(BodyFailure::Idle | BodyFailure::Deadline) => ProxyError::RequestTimeout,
        Some(BodyFailure::TooLarge) => ProxyError::PayloadTooLarge,
        Some(BodyFailure::Malformed) => ProxyError::BadRequest,
        None => e,
    });
    let kind = match &result {
        Ok(_) => {
            upstream
                .seconds
                .get_or_init(|| {
                    let labels = UpstreamLabels {
                        upstream: upstream.name.to_string(),
                    };
                    state
                        .metrics
                        .upstream_seconds
                        .get_or_create(&labels)
                        .clone()
                })
                .observe(now.elapsed().as_secs_f64());
            None
        }
        Err(ProxyError::UpstreamTimeout) => Some(UpstreamErrorKind::timeout),
        Err(ProxyError::UpstreamUnreachable) => Some(UpstreamErrorKind::unreachable),
        Err(_) => None,
    };
    if let Some(kind) = kind {
        let labels = UpstreamErrorLabels {
            upstream: upstream.name.to_string(),
            kind,
        };
        state.metrics.upstream_errors.get_or_create(&labels).inc();
    }
    Ok(result?.map(Either::Left))
}

fn respond(r: &Respond) -> Response<Body> {
    let mut res = Response::new(Either::Right(Full::new(r.body.clone())));
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

/// Count the request and its limit decisions, and write its access-log line.
fn record(
    state: &State,
    trace: &Trace<'_>,
    method: &http::Method,
    path: &str,
    status: StatusCode,
    started: Instant,
) {
    count(state, trace, status);
    if !tracing::enabled!(target: "tollgate::access", tracing::Level::INFO) {
        return;
    }
    let route_name = trace.route.map_or("", |r| &*r.name);
    let mut outcome = "none";
    let mut limit_name = "";
    let mut client = String::new();
    if let (Some(route), Some(decision)) = (trace.route, &trace.decision) {
        // The digest the closest limit counted this request under (never the raw identity).
        let closest = decision
            .rejected_by()
            .or_else(|| decision.reported().map(|(r, _)| r));
        if let Some(id) = closest.and_then(|r| r.client) {
            id.hex()[..16].clone_into(&mut client);
        }
        (outcome, limit_name) = match decision.rejected_by() {
            Some(r) if r.outcome == Outcome::FailedClosed => {
                ("store-unavailable", &*route.limits[r.index].name)
            }
            Some(r) if r.fallback => ("limited-without-store", &*route.limits[r.index].name),
            Some(r) => ("limited", &*route.limits[r.index].name),
            None if decision.results.iter().any(|r| r.fallback) => ("admitted-without-store", ""),
            None => ("admitted", ""),
        };
    }
    tracing::info!(
        target: "tollgate::access",
        method = %method,
        path,
        route = route_name,
        status = status.as_u16(),
        limit = limit_name,
        outcome,
        client,
        client_ip = %trace.client_ip.map_or_else(|| "-".to_owned(), |ip| ip.to_string()),
        ms = started.elapsed().as_secs_f64() * 1e3,
    );
}

/// Count the request and its limit decisions: through the route's cached counters, so no
/// label is built on the request path (requests that matched no route are rare: 404s).
fn count(state: &State, trace: &Trace<'_>, status: StatusCode) {
    let m = &state.metrics;
    let Some(route) = trace.route else {
        m.requests
            .get_or_create(&RequestLabels {
                route: String::new(),
                class: StatusClass::of(status),
            })
            .inc();
        return;
    };
    let counters = route
        .counters
        .get_or_init(|| m.route_counters(&route.name, route.limits.iter().map(|l| &*l.name)));
    counters.requests[StatusClass::index(status)].inc();
    let Some(decision) = &trace.decision else {
        return;
    };
    for r in &decision.results {
        let outcome = OutcomeLabel::of(r.outcome, r.fallback);
        counters.decisions[r.index][outcome.index()].inc();
        if r.outcome == Outcome::ShadowLimited {
            tracing::info!(
                route = &*route.name,
                limit = &*route.limits[r.index].name,
                "shadow limit exceeded (dry run: not enforced)"
            );
        }
    }
}
