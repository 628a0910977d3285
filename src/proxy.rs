//! One request through the stages: route, identity, limits, then forward or answer.

use std::net::SocketAddr;

use arc_swap::ArcSwap;
use std::time::Instant;

use http::{Request, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::config::reload::ReloadStats;
use crate::config::Snapshot;
use crate::error::ProxyError;
use crate::forward::{self, Downstream};
use crate::identity::{self, RequestView};
use crate::limiter::{self, local::Clock, Outcome};
use crate::metrics::{
    DecisionLabels, Metrics, OutcomeLabel, RequestLabels, StatusClass, UpstreamErrorKind,
    UpstreamErrorLabels, UpstreamLabels,
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
        }
    }
}

/// The downstream connection a request arrived on.
#[derive(Debug, Clone, Copy)]
pub struct Conn {
    pub peer: SocketAddr,
    pub tls: bool,
}

/// What the stages learned about a request, for the access log and metrics.
#[derive(Debug, Default)]
struct Trace<'a> {
    route: Option<&'a route::Route>,
    decision: Option<limiter::Decision>,
    client_ip: Option<std::net::IpAddr>,
}

/// Serve one request. Loads the config snapshot exactly once; every error becomes its response
/// here and nowhere else.
pub async fn handle(state: &State, conn: Conn, req: Request<Incoming>) -> Response<Body> {
    let started = Instant::now();
    let snapshot = state.config.load_full();
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let mut trace = Trace::default();
    let res = match pipeline(state, &snapshot, conn, req, &mut trace).await {
        Ok(res) => res,
        Err(err) => {
            tracing::debug!(error = %err, "request failed");
            response::from_error(&err)
        }
    };
    record(state, &trace, &method, &path, res.status(), started);
    res
}

async fn pipeline<'a>(
    state: &State,
    snap: &'a Snapshot,
    conn: Conn,
    req: Request<Incoming>,
    trace: &mut Trace<'a>,
) -> Result<Response<Body>, ProxyError> {
    let route = route::find(&snap.routes, req.method(), req.uri(), req.headers())
        .ok_or(ProxyError::NoRoute)?;
    trace.route = Some(route);
    let client_ip = identity::client_ip(conn.peer.ip(), req.headers(), &snap.trusted_proxies);
    trace.client_ip = Some(client_ip);
    let view = RequestView {
        method: req.method(),
        uri: req.uri(),
        headers: req.headers(),
        client_ip,
    };
    let redis = snap.redis.as_deref();
    let asked = Instant::now();
    let decision = limiter::decide(redis, &route.limits, &view, state.clock.now_us()).await;
    if redis.is_some() && !route.limits.is_empty() {
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
                peer_trusted: snap.trusted_proxies.iter().any(|n| n.contains(&peer)),
                tls: conn.tls,
            };
            forward_timed(state, upstream, req, down).await?
        }
        Action::Respond(r) => respond(r),
    };
    response::add_headers(res.headers_mut(), route, decision, snap.headers);
    Ok(res)
}

async fn forward_timed(
    state: &State,
    upstream: &forward::Upstream,
    req: Request<Incoming>,
    down: Downstream,
) -> Result<Response<Body>, ProxyError> {
    let sent = Instant::now();
    let result = forward::send(upstream, req, down).await;
    let name = upstream.name.to_string();
    let kind = match &result {
        Ok(_) => {
            let labels = UpstreamLabels { upstream: name };
            state
                .metrics
                .upstream_seconds
                .get_or_create(&labels)
                .observe(sent.elapsed().as_secs_f64());
            None
        }
        Err(ProxyError::UpstreamTimeout) => Some(UpstreamErrorKind::timeout),
        Err(_) => Some(UpstreamErrorKind::unreachable),
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
    let route_name = trace.route.map_or("", |r| &*r.name);
    let m = &state.metrics;
    m.requests
        .get_or_create(&RequestLabels {
            route: route_name.to_owned(),
            class: StatusClass::of(status),
        })
        .inc();
    let mut outcome = "none";
    let mut limit_name = "";
    if let (Some(route), Some(decision)) = (trace.route, &trace.decision) {
        for r in &decision.results {
            let name = &*route.limits[r.index].name;
            let label = OutcomeLabel::of(r.outcome, r.fallback);
            m.decisions
                .get_or_create(&DecisionLabels {
                    route: route_name.to_owned(),
                    limit: name.to_owned(),
                    outcome: label,
                })
                .inc();
            if r.outcome == Outcome::ShadowLimited {
                tracing::info!(
                    route = route_name,
                    limit = name,
                    "shadow limit exceeded; request admitted (dry run)"
                );
            }
        }
        (outcome, limit_name) = match decision.rejected_by() {
            Some(r) if r.outcome == Outcome::FailedClosed => {
                ("store-unavailable", &*route.limits[r.index].name)
            }
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
        client_ip = %trace.client_ip.map_or_else(|| "-".to_owned(), |ip| ip.to_string()),
        ms = started.elapsed().as_secs_f64() * 1e3,
    );
}
