//! What a finished request leaves: its counts in the metrics, its access-log entry completed
//! (with its trace's notes, made into spans when the entry is), its gRPC status and a cost
//! settled at the body's end, and the slots and tunnel the connection holds on to.

use tokio::time::Instant;

use super::{Handled, Refused, Trace};
use crate::access_log::{self, Entry};
use crate::limiter;
use crate::response::Body;
use crate::runtime::Action;
use crate::state::State;
use http::Response;

/// The answer as the connection takes it: the request counted and its log entry completed,
/// with the slots and the tunnel it holds.
pub(super) fn hand_over(
    state: &State,
    trace: &mut Trace<'_>,
    response: Response<Body>,
    started: Instant,
    mut access: Option<Box<Entry>>,
) -> Handled {
    record(state, trace, &response, started, &mut access);
    if let Some(entry) = access.as_mut() {
        traced(trace, entry);
    }
    let at_end = if trace.grpc {
        count_grpc(state, trace, &response, &mut access)
    } else {
        (trace.settle_later.take()).map(|settle| settled_at_end(None, settle))
    };
    let mut slots = std::mem::take(&mut trace.slots);
    let mut tunnel = trace.tunnel.take();
    // A WebSocket holds its slots until the tunnel closes.
    if let Some(t) = &mut tunnel {
        t.slots = std::mem::take(&mut slots);
    }
    Handled {
        response,
        tunnel,
        access,
        slots,
        at_end,
    }
}

/// A gRPC call counted and logged by its status: now for a trailers-only answer (tollgate's
/// own among them), else by the tally returned and the log line, when its trailers come.
fn count_grpc(
    state: &State,
    trace: &mut Trace<'_>,
    res: &Response<Body>,
    access: &mut Option<Box<Entry>>,
) -> Option<access_log::EndTally> {
    let head = access_log::grpc_status(res.headers());
    if let Some(entry) = access {
        entry.grpc_status = head;
    }
    let mut calls = state
        .metrics
        .grpc_tally(trace.route.map_or("", |r| &*r.name));
    if let Some(settle) = trace.settle_later.take() {
        calls = settled_at_end(Some(calls.0), settle);
    }
    match head {
        // Trailers-only: the head is the trailers.
        Some(code) => {
            (calls.0)(code, Some(res.headers()));
            None
        }
        None => Some(calls),
    }
}

/// A cost the response's head did not give, settled at the body's end from its trailers (or
/// from none: the reserve stands), after what `then` counts there.
fn settled_at_end(
    then: Option<access_log::TallyFn>,
    settle: limiter::decide::settled::Deferred,
) -> access_log::EndTally {
    access_log::EndTally(Box::new(Box::new(move |code, trailers| {
        if let Some(count) = then {
            count(code, trailers);
        }
        (settle.0)(trailers.unwrap_or(&http::HeaderMap::new()))
    })))
}

/// The request's trace, with what the stages learned, moved into its entry (made into spans
/// when the entry is complete).
fn traced(trace: &mut Trace<'_>, entry: &mut Entry) {
    let Some(mut span) = trace.span.take() else {
        return;
    };
    if let (Some(route), Some(decision)) = (trace.route, &trace.decision) {
        span.notes.limits = decision.notes(&route.limits);
    }
    span.notes.http_route = trace.route.and_then(|r| r.path_template.clone());
    span.notes.grpc = trace.grpc;
    let rejected = (trace.decision.as_ref()).is_some_and(|d| d.rejected_by().is_some());
    span.notes.refused = rejected || trace.refused != Refused::No;
    // The log line names the request's own span, which the trace holds.
    entry.traceparent = Some(span.traceparent());
    entry.span = Some(span);
}

/// Count the request and its limit decisions (`metrics`), and complete its access-log entry.
fn record(
    state: &State,
    trace: &Trace<'_>,
    res: &Response<Body>,
    started: Instant,
    entry: &mut Option<Box<Entry>>,
) {
    let status = res.status();
    let route = trace.route.map(|r| (&r.counters, &*r.name, &r.limits[..]));
    let took = (trace.head_ready.unwrap_or_else(Instant::now)).saturating_duration_since(started);
    state
        .metrics
        .count_request(route, status, took, trace.decision.as_ref());
    let Some(entry) = entry else { return };
    entry.status = status.as_u16();
    entry.client_ip = trace.client_ip;
    entry.bytes_in = trace.bytes_in;
    entry.cost = trace.cost;
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
        if upstream.gate.is_some() {
            entry.queue_time = Some(trace.queued);
        }
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
    // Admitted by the limits, then refused by tollgate: the refusal is the outcome.
    match trace.refused {
        Refused::AtCapacity => {
            entry.outcome = "at-capacity";
            entry.queue_time = Some(trace.queued);
        }
        Refused::OperatorBan => entry.outcome = "operator-ban",
        Refused::No | Refused::RateLimited => {}
    }
}
