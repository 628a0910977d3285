//! The limit stages of a request: the operators' entries, the route's limits (concurrency
//! slots, then rates), the candidate config's decision beside them, and the refusal.

use http::Response;

use super::{ClientConn, Trace};
use crate::access_log;
use crate::error::ProxyError;
use crate::identity::{Arrival, RequestView};
use crate::limiter::{self, Outcome};
use crate::response::{self, Body};
use crate::runtime::{Route, Runtime};
use crate::state::State;
use tokio::time::Instant;

/// Decide the route's limits (into `trace`); returns the instant they were decided at, on the
/// limiter's clock, for the candidate config to decide at too.
pub(super) async fn limits(
    state: &State,
    rt: &Runtime,
    conn: &ClientConn,
    route: &Route,
    asked: (&RequestView<'_>, &[Option<&limiter::Tuning>]),
    started: Instant,
    trace: &mut Trace<'_>,
) -> limiter::Moment {
    let redis = rt.redis.as_deref();
    // The request's arrival is "now" for the in-process limiter: one clock read fewer.
    let sent = redis.is_some().then(Instant::now);
    let now = state.clock.at(sent.unwrap_or(started));
    let decision = decide(conn, route, asked, now, &mut trace.slots, rt).await;
    if let (Some(sent), false) = (sent, route.limits.is_empty()) {
        let took = sent.elapsed().as_secs_f64();
        state.metrics.backend_seconds.observe(took);
    }
    noted(route, asked.0, decision, trace);
    now
}

/// `limits` for a route without concurrency limits, without Redis: nothing to wait for, so
/// no future to build and move (`limits`, `decide` and the store's, some 4 KB a request).
pub(super) fn in_process(
    state: &State,
    route: &Route,
    (view, tuned): (&RequestView<'_>, &[Option<&limiter::Tuning>]),
    started: Instant,
    trace: &mut Trace<'_>,
) -> limiter::Moment {
    // The request's arrival is "now" for the in-process limiter: one clock read fewer.
    let now = state.clock.at(started);
    let decision = limiter::decide_in_process(&route.limits, view, now, tuned);
    noted(route, view, decision, trace);
    now
}

/// Keep the decision in `trace`, with the identities' digests for replay (`tollgate
/// simulate`, only with a JSON access log).
fn noted(
    route: &Route,
    view: &RequestView<'_>,
    decision: limiter::Decision,
    trace: &mut Trace<'_>,
) {
    trace.decision = Some(decision);
    if !route.logged_keys.is_empty() && access_log::json() {
        trace.keys = route.logged_keys.digests(view);
    }
}

/// The answer to a request a limit refused: 429, or 503 when a `closed` limit's store is away.
/// The request's concurrency slots are given back at once.
pub(super) fn refusal(
    rt: &Runtime,
    route: &Route,
    trace: &mut super::Trace<'_>,
) -> Option<Result<Response<Body>, ProxyError>> {
    let decision = trace.decision.as_ref()?;
    let rejected = decision.rejected_by()?;
    trace.slots = limiter::concurrency::Guard::default();
    if rejected.outcome == Outcome::FailedClosed {
        let limit = route.limits[rejected.index].name.clone();
        return Some(Err(ProxyError::LimiterUnavailable { limit }));
    }
    let (headers, id_header) = (rt.settings.headers, &rt.settings.request_id_header);
    let limits = &route.limits;
    let answer = response::too_many_requests(limits, &route.rendered, decision, headers, id_header);
    trace.refused = super::Refused::RateLimited;
    Some(Ok(answer))
}

/// The rate-limit headers of the route's limits on `res`, from the request's decision.
pub(super) fn add_limit_headers(
    rt: &Runtime,
    route: &Route,
    decision: Option<&limiter::Decision>,
    res: &mut Response<Body>,
) {
    if let Some(decision) = decision {
        let (limits, rendered) = (&route.limits, &route.rendered);
        response::add_headers(
            res.headers_mut(),
            limits,
            rendered,
            decision,
            rt.settings.headers,
        );
    }
}

/// The candidate config's decision of the request (see `candidate`), beside the live one,
/// whatever that was; it never changes the answer. Its slots join `slots`, the request's.
#[inline]
pub(super) fn beside(
    rt: &Runtime,
    arrival: &Arrival<'_>,
    now: limiter::Moment,
    slots: &mut limiter::concurrency::Guard,
) {
    if let Some(c) = &rt.candidate {
        c.evaluate(arrival, now, slots);
    }
}

/// The route's limits for one request: concurrency slots first (into `slots`), so that a
/// request they refuse takes no token from a rate limit, then the rate limits.
async fn decide(
    conn: &ClientConn,
    route: &Route,
    (view, tuned): (&RequestView<'_>, &[Option<&limiter::Tuning>]),
    now: limiter::Moment,
    slots: &mut limiter::concurrency::Guard,
    rt: &Runtime,
) -> limiter::Decision {
    let (worker, redis) = (conn.worker, rt.redis.as_deref());
    let mut taken = limiter::Small::new();
    if limiter::concurrency::any(&route.limits) {
        let acquire = crate::boxed(|| {
            limiter::concurrency::acquire(redis, Some(worker), &route.limits, view)
        });
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
    let mut d = limiter::decide_tuned(redis, Some(worker), &route.limits, view, now, tuned).await;
    d.results.extend(taken);
    d
}

/// The operators' entries for one request (`control`): the numbers of its limits' overrides,
/// or the answer of a ban that refuses it (counted). One atomic load while there are none.
pub(super) fn operators<'t>(
    state: &State,
    table: Option<&'t crate::control::InForce>,
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
        trace.refused = super::Refused::OperatorBan;
        return Err(Box::new(refused));
    }
    Ok(table.tunings(view, &route.limits))
}
