//! One request through the stages: route, identity, limits, then forward or answer.

use std::net::SocketAddr;

use arc_swap::ArcSwap;
use http::{Request, Response};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::config::reload::ReloadStats;
use crate::config::Snapshot;
use crate::error::ProxyError;
use crate::forward::{self, Downstream};
use crate::identity::{self, RequestView};
use crate::limiter::{self, local::Clock, Outcome};
use crate::response::{self, Body};
use crate::route::{self, Action, Respond};

/// What every request shares: the current config and the limiter clock.
#[derive(Debug)]
pub struct State {
    pub config: ArcSwap<Snapshot>,
    pub clock: Clock,
    pub reloads: ReloadStats,
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
        }
    }
}

/// The downstream connection a request arrived on.
#[derive(Debug, Clone, Copy)]
pub struct Conn {
    pub peer: SocketAddr,
    pub tls: bool,
}

/// Serve one request. Loads the config snapshot exactly once; every error becomes its response
/// here and nowhere else.
pub async fn handle(state: &State, conn: Conn, req: Request<Incoming>) -> Response<Body> {
    let snapshot = state.config.load_full();
    match pipeline(state, &snapshot, conn, req).await {
        Ok(res) => res,
        Err(err) => {
            tracing::debug!(error = %err, "request failed");
            response::from_error(&err)
        }
    }
}

async fn pipeline(
    state: &State,
    snap: &Snapshot,
    conn: Conn,
    req: Request<Incoming>,
) -> Result<Response<Body>, ProxyError> {
    let route = route::find(&snap.routes, req.method(), req.uri(), req.headers())
        .ok_or(ProxyError::NoRoute)?;
    let client_ip = identity::client_ip(conn.peer.ip(), req.headers(), &snap.trusted_proxies);
    let view = RequestView {
        method: req.method(),
        uri: req.uri(),
        headers: req.headers(),
        client_ip,
    };
    let redis = snap.redis.as_deref();
    let decision = limiter::decide(redis, &route.limits, &view, state.clock.now_us()).await;
    report_shadow(route, &decision);
    if let Some(rejected) = decision.rejected_by() {
        if rejected.outcome == Outcome::FailedClosed {
            let limit = route.limits[rejected.index].name.clone();
            return Err(ProxyError::LimiterUnavailable { limit });
        }
        return Ok(response::too_many_requests(route, &decision, snap.headers));
    }
    let mut res = match &route.action {
        Action::Forward(upstream) => {
            let peer = conn.peer.ip().to_canonical();
            let down = Downstream {
                peer,
                peer_trusted: snap.trusted_proxies.iter().any(|n| n.contains(&peer)),
                tls: conn.tls,
            };
            forward::send(upstream, req, down).await?.map(Either::Left)
        }
        Action::Respond(r) => respond(r),
    };
    response::add_headers(res.headers_mut(), route, &decision, snap.headers);
    Ok(res)
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

/// A dry-run limit that would have rejected: say so, since that is what `shadow` is for.
fn report_shadow(route: &route::Route, decision: &limiter::Decision) {
    for r in &decision.results {
        if r.outcome == Outcome::ShadowLimited {
            let limit = &route.limits[r.index];
            tracing::info!(
                route = %route.name,
                limit = %limit.name,
                "shadow limit exceeded; request admitted (dry run)"
            );
        }
    }
}
