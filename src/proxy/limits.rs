//! The limit stages of a request: the operators' entries, the route's limits (concurrency
//! slots, then rates), the candidate config's decision beside them, and the refusal.

use http::Response;

use super::Ctx;
use crate::error::ProxyError;
use crate::identity::{Arrival, RequestView};
use crate::limiter::{self, Outcome};
use crate::response::{self, Body};
use crate::runtime::{Route, Runtime};
use tokio::time::Instant;

/// What the limits are asked about: the request's view, the operators' overrides of each limit,
/// and the request as it arrived (for the candidate config).
type Asked<'r, 't> = (
    &'r RequestView<'r>,
    &'r [Option<&'t limiter::Tuning>],
    &'r Arrival<'r>,
);

/// The route's limits decided at once where nothing can wait (in process, no concurrency
/// slots), and the candidate config's beside them; `None` otherwise, for `shared`. No future is
/// built for this path (`shared`, `decide` and the store's, some 4 KB a request).
pub(super) fn in_process(
    cx: &mut Ctx<'_, '_>,
    route: &Route,
    (view, tuned, arrival): Asked<'_, '_>,
) -> Option<limiter::Decision> {
    if cx.rt.redis.is_some() || limiter::concurrency::any(&route.limits) {
        return None;
    }
    // The request's arrival is "now" for the in-process limiter: one clock read fewer.
    let now = cx.state.clock.at(cx.started);
    let decision = limiter::decide_in_process(&route.limits, view, now, tuned);
    beside(cx, arrival, now);
    Some(decision)
}

/// The route's limits over Redis, or with concurrency slots, and the candidate config's beside
/// them (at the same instant on the limiter's clock). The caller boxes this future: inline, its
/// state would make every request's pipeline future larger.
pub(super) async fn shared(
    cx: &mut Ctx<'_, '_>,
    route: &Route,
    (view, tuned, arrival): Asked<'_, '_>,
) -> limiter::Decision {
    let (state, rt) = (cx.state, cx.rt);
    let redis = rt.redis.as_deref();
    // The request's arrival is "now" for the in-process limiter: one clock read fewer.
    let sent = redis.is_some().then(Instant::now);
    let now = state.clock.at(sent.unwrap_or(cx.started));
    let asked = (view, tuned);
    let decision = decide(cx.conn.worker, route, asked, now, &mut cx.trace.slots, rt).await;
    if let (Some(sent), false) = (sent, route.limits.is_empty()) {
        let took = sent.elapsed();
        state.metrics.backend_seconds.observe(took.as_secs_f64());
        if let Some(span) = cx.trace.span.as_mut() {
            span.notes.redis = Some(took);
        }
    }
    beside(cx, arrival, now);
    decision
}

/// The candidate config's decision of the request (see `candidate`), beside the live one,
/// whatever that was; it never changes the answer. Its slots join the request's.
fn beside(cx: &mut Ctx<'_, '_>, arrival: &Arrival<'_>, now: limiter::Moment) {
    if let Some(c) = &cx.rt.candidate {
        let verdict = c.evaluate(arrival, now, &mut cx.trace.slots);
        if let Some(span) = cx.trace.span.as_mut() {
            span.notes.candidate = Some(verdict);
        }
    }
}

/// The answer to a request a limit refused: 429, or 503 when a `closed` limit's store is away.
/// The request's concurrency slots are given back at once.
pub(super) fn refusal(
    cx: &mut Ctx<'_, '_>,
    route: &Route,
) -> Option<Result<Response<Body>, ProxyError>> {
    let (rt, trace) = (cx.rt, &mut cx.trace);
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

/// The rate-limit headers of the route's limits on `res`, from the request's decision; and
/// the response counted against the `count_when` limits its status matches.
pub(super) async fn finish(cx: &mut Ctx<'_, '_>, route: &Route, res: &mut Response<Body>) {
    let Some(decision) = cx.trace.decision.as_ref() else {
        return;
    };
    let (limits, rendered) = (&route.limits, &route.rendered);
    let policy = cx.rt.settings.headers;
    response::add_headers(res.headers_mut(), limits, rendered, decision, policy);
    if !route.counts_responses {
        return;
    }
    // Owned: the settlement writes to the trace the decision lives in.
    let decision = decision.clone();
    let peer = limiter::local::Peer::of(cx.trace.client_ip.unwrap_or(cx.conn.peer.ip()));
    let at = (peer, cx.state.clock.now());
    let status = res.status().as_u16();
    if (limits.iter()).any(|l| l.count_when.is_some_and(|s| s.contains(status))) {
        count_response(cx, route, &decision, status, at).await;
    }
    if limits.iter().any(|l| l.settle.is_some()) {
        cx.trace.cost = settle(cx, route, &decision, res, at);
    }
}

/// Settle the route's `cost.from_response` limits from the response's headers.
fn settle(
    cx: &mut Ctx<'_, '_>,
    route: &Route,
    decision: &limiter::Decision,
    res: &Response<Body>,
    at: (limiter::local::Peer, limiter::Moment),
) -> Option<u64> {
    use limiter::decide::settled::Deferred;
    let headers = res.headers();
    let (redis, units) = (cx.rt.redis.clone(), cx.state.metrics.limit_units.clone());
    let head_says = (route.limits.iter())
        .filter_map(|l| l.settle.as_ref())
        .any(|h| headers.contains_key(h));
    // A gRPC call, or a body still to come (chunked HTTP/1.1, HTTP/2), may report in its
    // trailers: settled when they come, or left at the reserve when the body ends without.
    if !head_says && (cx.trace.grpc || !http_body::Body::is_end_stream(res.body())) {
        let (limits, decision, name) = (route.limits.clone(), decision.clone(), route.name.clone());
        // The body ends on the connection's worker: into its next batch too.
        let worker = Some(cx.conn.worker);
        cx.trace.settle_later = Some(Deferred(Box::new(move |trailers| {
            let settled = settle_in(redis.as_deref(), worker, (&limits, &decision), trailers, at);
            count_units(&units, &name, &limits, &settled);
            settled.first().map(|&(_, units)| units)
        })));
        return None;
    }
    let worker = Some(cx.conn.worker);
    let settled = settle_in(
        redis.as_deref(),
        worker,
        (&route.limits, decision),
        headers,
        at,
    );
    count_units(&units, &route.name, &route.limits, &settled);
    settled.first().map(|&(_, units)| units)
}

/// `settled::settle` in the shared store when there is one, else in process.
fn settle_in(
    redis: Option<&limiter::redis::RedisLimiter>,
    worker: Option<usize>,
    (limits, decision): (&[std::sync::Arc<limiter::Limit>], &limiter::Decision),
    headers: &http::HeaderMap,
    (peer, now): (limiter::local::Peer, limiter::Moment),
) -> Vec<(usize, u64)> {
    use limiter::decide::settled::settle;
    use limiter::store::{Local, Shared};
    match redis {
        Some(redis) => settle(
            &Shared { redis, worker },
            limits,
            decision,
            headers,
            peer,
            now,
        ),
        None => settle(
            &Local { fallback: false },
            limits,
            decision,
            headers,
            peer,
            now,
        ),
    }
}

/// Count the units `settled` (by limit index) in `tollgate_limit_units_total`.
fn count_units(
    units: &prometheus_client::metrics::family::Family<
        crate::metrics::RouteLimitLabels,
        prometheus_client::metrics::counter::Counter,
    >,
    route: &str,
    limits: &[std::sync::Arc<limiter::Limit>],
    settled: &[(usize, u64)],
) {
    for &(index, n) in settled {
        if let Some(limit) = limits.get(index) {
            let labels = crate::metrics::RouteLimitLabels {
                route: route.to_owned(),
                limit: limit.name.to_string(),
            };
            units.get_or_create(&labels).inc_by(n);
        }
    }
}

/// Count a response of `status` against the route's `count_when` limits, under the
/// identities the request was decided under, before the response goes: the client's next
/// request sees it counted.
async fn count_response(
    cx: &Ctx<'_, '_>,
    route: &Route,
    decision: &limiter::Decision,
    status: u16,
    (peer, now): (limiter::local::Peer, limiter::Moment),
) {
    use limiter::decide::counted::count;
    use limiter::store::Shared;
    let mut clients = vec![None; route.limits.len()];
    for r in &decision.results {
        if let Some(slot) = clients.get_mut(r.index) {
            *slot = r.client;
        }
    }
    let shared = (cx.rt.redis.as_deref()).map(|redis| Shared {
        redis,
        worker: Some(cx.conn.worker),
    });
    // Boxed: only a response some limit counts pays for the call's state.
    let limits = &route.limits;
    crate::boxed(|| count(shared.as_ref(), limits, &clients, status, peer, (now, None))).await;
}

/// The route's limits for one request: concurrency slots first (into `slots`), so that a
/// request they refuse takes no token from a rate limit, then the rate limits.
async fn decide(
    worker: usize,
    route: &Route,
    (view, tuned): (&RequestView<'_>, &[Option<&limiter::Tuning>]),
    now: limiter::Moment,
    slots: &mut limiter::concurrency::Guard,
    rt: &Runtime,
) -> limiter::Decision {
    use limiter::store::{Local, Shared};
    let shared = (rt.redis.as_deref()).map(|redis| Shared {
        redis,
        worker: Some(worker),
    });
    let mut taken = limiter::Small::new();
    if limiter::concurrency::any(&route.limits) {
        use limiter::take_slots as acquire;
        let acquire = crate::boxed(|| async move {
            match &shared {
                Some(shared) => acquire(shared, &route.limits, view).await,
                None => acquire(&Local { fallback: false }, &route.limits, view).await,
            }
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
    let mut d = limiter::decide(shared.as_ref(), &route.limits, view, now, tuned).await;
    d.results.extend(taken);
    d
}

/// The operators' entries for one request (`control`): the numbers of its limits' overrides,
/// or the answer of a ban that refuses it (counted). One atomic load while there are none.
pub(super) fn operators<'t>(
    cx: &mut Ctx<'_, '_>,
    table: Option<&'t crate::control::InForce>,
    view: &RequestView<'_>,
    route: &Route,
) -> Result<limiter::Small<Option<&'t limiter::Tuning>>, Box<Response<Body>>> {
    let Some(table) = table else {
        return Ok(limiter::Small::new());
    };
    if let Some(refused) = table.refusal_of(view, &route.name) {
        let labels = crate::metrics::RouteLabels {
            route: route.name.to_string(),
        };
        let banned = &cx.state.metrics.admin_banned_requests;
        banned.get_or_create(&labels).inc();
        cx.trace.refused = super::Refused::OperatorBan;
        return Err(Box::new(refused));
    }
    Ok(table.tunings(view, &route.limits))
}
