//! The candidate config: its routes and limits evaluated beside the live ones on every
//! request, counted in `tollgate_candidate_decisions_total`, never enforced.
//!
//! A candidate has buckets of its own, in process, never shared with the live config's; a
//! reload keeps those of its unchanged limits, as the live runtime does. It is decided
//! synchronously, right after the live decision: the in-process store never waits, so the
//! decision's future completes on its first poll, on the stack, and adds no task, no
//! allocation and no await to the request. With `limiter.backend: redis` the candidate is
//! still decided in process, at the per-replica share of each limit that the `local` failure
//! policy enforces (`limiter.local_fallback.divide_by`): a candidate never adds a Redis call,
//! a Redis latency or a Redis failure to live traffic. Bans are not evaluated (a candidate
//! refuses nobody, so nobody would strike out); concurrency slots are held for the request's
//! lifetime, as the live ones are.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::FutureExt as _;

use crate::config::settings::{Backend, LimitSpec, Settings};
use crate::identity::{Arrival, RequestView};
use crate::limiter::concurrency::{self, Guard};
use crate::limiter::{self, Decision, Limit, Moment, Outcome};
use crate::metrics::{CandidateCounters, CandidateOutcome, Metrics};
use crate::sharded;

/// A candidate config, live: its route table and limits, with their own buckets.
#[derive(Debug)]
pub struct Candidate {
    pub settings: Arc<Settings>,
    /// In file order, as `settings.routes`.
    pub routes: Vec<Route>,
    /// Requests that matched no candidate route.
    unrouted: sharded::Counter,
}

/// A candidate route: only what a decision needs (a candidate never forwards).
#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    pub limits: Vec<Arc<Limit>>,
    /// The route compares paths without case, so its limits read the path lower-cased.
    pub fold_path: bool,
    counters: CandidateCounters,
}

/// The candidate of `live` (`candidate:`), built into the runtime that replaces `previous`.
/// A candidate that did not load is logged and counted, and `previous`'s goes on (at start:
/// none); the live config loads either way.
pub(crate) fn build(
    live: &Settings,
    previous: Option<&Arc<Candidate>>,
    metrics: &Metrics,
) -> Option<Arc<Candidate>> {
    let load = live.candidate.as_ref()?;
    let kept = previous.cloned();
    match &load.settings {
        Ok(settings) => {
            metrics.candidate_loaded(true);
            let built = Candidate::build(settings.clone(), kept.as_deref(), metrics);
            tracing::info!(
                candidate = %load.path.display(),
                routes = built.routes.len(),
                "candidate config loaded: evaluated beside the live one, never enforced"
            );
            Some(Arc::new(built))
        }
        Err(e) => {
            metrics.candidate_loaded(false);
            let keeping = if kept.is_some() {
                "the previous candidate goes on"
            } else {
                "no candidate is evaluated"
            };
            tracing::error!("the candidate config did not load; {keeping} (the live config is not affected)\n{e}");
            kept
        }
    }
}

impl Candidate {
    /// The candidate of `settings`, keeping `previous`'s buckets of unchanged limits.
    pub fn build(settings: Arc<Settings>, previous: Option<&Candidate>, metrics: &Metrics) -> Self {
        let old: HashMap<&str, &Arc<Limit>> = previous
            .map(|p| p.limits().map(|l| (&*l.name, l)).collect())
            .unwrap_or_default();
        let shared = matches!(settings.limiter.backend, Backend::Redis(_));
        let routes = (settings.routes.iter())
            .map(|spec| {
                let limits: Vec<Arc<Limit>> = (spec.limits.iter())
                    .map(|l| {
                        let l = in_process(l, shared);
                        Limit::build(&l, old.get(&*l.name).map(|o| &***o), &settings.limiter)
                    })
                    .collect();
                Route {
                    name: spec.name.clone(),
                    counters: metrics
                        .candidate_counters(&spec.name, limits.iter().map(|l| &*l.name)),
                    limits,
                    fold_path: spec.fold_path,
                }
            })
            .collect();
        Self {
            unrouted: metrics.candidate_unrouted(),
            settings,
            routes,
        }
    }

    /// Every limit of every route, in file order.
    pub fn limits(&self) -> impl Iterator<Item = &Arc<Limit>> {
        self.routes.iter().flat_map(|r| r.limits.iter())
    }

    /// What the candidate decided so far, as `tollgate_candidate_decisions_total` holds it:
    /// (route, limit, outcome, count) for each of its limits, then the requests that matched
    /// none of its routes, as ("", "", `no_route`, count). For the admin API and dashboards.
    pub fn decisions(&self) -> Vec<(Arc<str>, Arc<str>, CandidateOutcome, u64)> {
        let mut out = Vec::new();
        for r in &self.routes {
            for (i, l) in r.limits.iter().enumerate() {
                out.extend(
                    (r.counters.counts(i)).map(|(o, n)| (r.name.clone(), l.name.clone(), o, n)),
                );
            }
        }
        let none: Arc<str> = Arc::from("");
        out.push((
            none.clone(),
            none,
            CandidateOutcome::no_route,
            self.unrouted.get(),
        ));
        out
    }

    /// Decide the request (already screened; `arrival`, as the live config read it: its
    /// client through the live `trusted_proxies`) against the candidate and count the outcome;
    /// the verdict (`admitted`, `limited`, `unrouted`) is returned for the request's trace.
    /// Its concurrency slots join `slots`, the request's, to be held as long as it lives.
    pub fn evaluate(&self, arrival: &Arrival<'_>, now: Moment, slots: &mut Guard) -> &'static str {
        let Some(route) = self
            .settings
            .table
            .find_parts(arrival.method, arrival.uri, arrival.headers)
            .and_then(|i| self.routes.get(i))
        else {
            self.unrouted.inc();
            return "unrouted";
        };
        if route.limits.is_empty() {
            return "admitted";
        }
        let jwt = self.settings.jwt.as_deref().map(|v| arrival.jwt(v));
        let view = arrival.view(route.fold_path, jwt.as_ref());
        if decide(route, &view, now, slots) {
            "admitted"
        } else {
            "limited"
        }
    }
}

/// Decide the request on `route` in process and count it, as the live proxy decides:
/// concurrency slots first (they join `slots`), then the rate limits. The in-process store never
/// waits: each future is ready on its first poll. Only whether it admitted is returned, so the
/// decision is not copied out.
fn decide(route: &Route, view: &RequestView<'_>, now: Moment, slots: &mut Guard) -> bool {
    let limits = &route.limits[..];
    if concurrency::any(limits) {
        let in_process = crate::limiter::store::Local { fallback: false };
        let (held, taken) = crate::limiter::take_slots(&in_process, limits, view)
            .now_or_never()
            .unwrap_or_default();
        let refused = taken
            .iter()
            .any(|r| matches!(r.outcome, Outcome::Limited | Outcome::FailedClosed));
        let mut decision = Decision {
            results: taken.into_iter().collect(),
        };
        if !refused {
            let rates = limiter::decide_in_process(limits, view, now, &[]);
            decision.results.extend(rates.results);
        }
        route.counters.decided(&decision);
        // Refused: the slots taken are given back at once, as the live ones are.
        let admitted = decision.rejected_by().is_none();
        if admitted {
            slots.join(held);
        }
        return admitted;
    }
    let decision = limiter::decide_in_process(limits, view, now, &[]);
    route.counters.decided(&decision);
    decision.rejected_by().is_none()
}

/// `spec` as the candidate counts it: without its ban, and, when the candidate's limits are
/// shared in Redis, at the per-replica share its `local` failure policy would enforce.
fn in_process(spec: &LimitSpec, shared: bool) -> LimitSpec {
    let mut spec = spec.clone();
    spec.ban = None;
    if shared {
        spec.rate = spec.fallback.clone();
        if let Some(q) = &mut spec.quota {
            q.count = q.fallback_count;
        }
        if let Some(c) = &mut spec.concurrency {
            c.max = c.fallback;
        }
    }
    spec
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the accessor for the admin and dashboards reads is what the metric counts.
    #[test]
    fn decisions_read_back_what_was_counted() {
        let yaml = "listeners: [{address: 127.0.0.1:0}]\nroutes:\n  - { name: api, match: { path_prefix: /api/ }, respond: { status: 200 }, limits: [{ name: two, rate: 1/min, burst: 2, key: [ip] }] }\n";
        let settings = crate::config::parse(yaml).expect("a candidate");
        let metrics = Metrics::new();
        let candidate = Candidate::build(Arc::new(settings), None, &metrics);
        let ip = "192.0.2.1".parse().unwrap();
        let mut slots = Guard::default();
        for path in ["/api/a", "/api/b", "/api/c", "/other"] {
            let req = http::Request::get(path).body(()).unwrap();
            candidate.evaluate(
                &crate::identity::Arrival::of(&req, ip),
                Moment::from_us(0.0),
                &mut slots,
            );
        }
        let counts: Vec<(String, String, CandidateOutcome, u64)> = (candidate.decisions())
            .into_iter()
            .filter(|d| d.3 > 0)
            .map(|(r, l, o, n)| (r.to_string(), l.to_string(), o, n))
            .collect();
        let row = |r: &str, l: &str, o, n| (r.to_owned(), l.to_owned(), o, n);
        assert_eq!(
            counts,
            [
                row("api", "two", CandidateOutcome::admitted, 2),
                row("api", "two", CandidateOutcome::limited, 1),
                row("", "", CandidateOutcome::no_route, 1),
            ]
        );
        assert!(slots.is_empty(), "no concurrency limit, no slot");
    }
}
