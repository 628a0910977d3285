//! The dashboard's sampler: once a second, every source's counters into `metrics::history`,
//! and every few minutes a new window of the most-limited sketches.
//!
//! A source is one function that reads totals off the live runtime and the metrics; adding a
//! series is adding one to `SOURCES`.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};

use crate::metrics::history::{Key, Reading};
use crate::metrics::top::WINDOW_SECS;
use crate::metrics::{OutcomeLabel, RouteLabels, RouteLimitLabels};
use crate::runtime::Runtime;
use crate::state::State;

/// Reads totals off the live runtime and the metrics.
type Source = fn(&State, &Runtime, &mut Vec<Reading>);

/// Every series sampled. A source's series are in `GET /api/v1/dashboard` under `series`,
/// by its name, unless it is one of `SHOWN`.
const SOURCES: &[Source] = &[
    decisions,
    rls_decisions,
    bans,
    redis,
    reloads,
    operator_bans,
    candidates,
];

/// The sources the dashboard's answer shows in sections of their own.
pub const SHOWN: &[&str] = &["decisions", "bans", "redis", "reloads"];

/// The channels of a limit's decisions: these outcomes, by these names.
pub const DECISIONS: &[&str] = &["admitted", "limited", "shadow_limited", "without_backend"];
pub const DECISION_OUTCOMES: [OutcomeLabel; 4] = [
    OutcomeLabel::admitted,
    OutcomeLabel::limited,
    OutcomeLabel::shadow_limited,
    OutcomeLabel::without_backend,
];
/// The channels of a ban limit.
pub const BANS: &[&str] = &["started", "refused", "lifted"];
/// The channels of the Redis client.
pub const REDIS: &[&str] = &["calls", "errors", "timeouts"];
/// The channels of config reloads.
pub const RELOADS: &[&str] = &["ok", "failed"];

/// Sample until `stop`; rejections are counted into the sketches from now on.
pub async fn run(state: Arc<State>, mut stop: watch::Receiver<bool>) {
    state.metrics.most_limited.enable();
    let started = Instant::now();
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = every.tick() => {}
        }
        let tick = started.elapsed().as_secs();
        sample(&state, tick);
        if tick > 0 && tick.is_multiple_of(WINDOW_SECS) {
            state.metrics.most_limited.rotate();
        }
    }
}

/// One sample of every source, as of `tick`.
pub fn sample(state: &State, tick: u64) {
    let runtime = state.runtime.load_full();
    let mut readings = Vec::new();
    for source in SOURCES {
        source(state, &runtime, &mut readings);
    }
    state.metrics.history.record(tick, readings);
}

fn key(source: &'static str, route: &Arc<str>, limit: &Arc<str>) -> Key {
    Key {
        source,
        route: route.clone(),
        limit: limit.clone(),
    }
}

/// Each limit's decisions, by route.
fn decisions(_: &State, rt: &Runtime, out: &mut Vec<Reading>) {
    for route in &rt.routes {
        for (limit, counters) in route.limits.iter().zip(&route.counters.decisions) {
            let totals = DECISION_OUTCOMES
                .map(|o| counters[o as usize].get())
                .to_vec();
            out.push(Reading {
                key: key("decisions", &route.name, &limit.name),
                channels: DECISIONS,
                totals,
            });
        }
    }
}

/// A rate limit service rule's decisions as a route limit's channels (`DECISIONS`): within
/// and near its limit admitted, over it limited, over a shadow one shadow-limited.
pub fn rls_totals(state: &State, domain: &str, rule: &str) -> Vec<u64> {
    let get = |result: &'static str| {
        let labels = crate::metrics::RlsLabels {
            domain: domain.to_owned(),
            rule: rule.to_owned(),
            result,
        };
        state
            .metrics
            .rls_descriptors
            .get(&labels)
            .map_or(0, |c| c.get())
    };
    let admitted = get("within_limit") + get("near_limit");
    vec![admitted, get("over_limit"), get("shadow_mode"), 0]
}

/// Each rate limit service rule's decisions, its route `rls:DOMAIN`.
fn rls_decisions(state: &State, rt: &Runtime, out: &mut Vec<Reading>) {
    for (domain, meta, limit) in rt.rls.iter().flat_map(|d| d.rules()) {
        out.push(Reading {
            key: key(
                "decisions",
                &Arc::from(format!("rls:{domain}")),
                &limit.name,
            ),
            channels: DECISIONS,
            totals: rls_totals(state, domain, &meta.rule),
        });
    }
}

/// The escalating bans of every `ban:` limit.
fn bans(state: &State, rt: &Runtime, out: &mut Vec<Reading>) {
    let m = &state.metrics;
    for route in &rt.routes {
        for limit in route.limits.iter().filter(|l| l.ban.is_some()) {
            let labels = RouteLimitLabels {
                route: route.name.to_string(),
                limit: limit.name.to_string(),
            };
            let get = |f: &Family<RouteLimitLabels, Counter>| f.get(&labels).map_or(0, |c| c.get());
            out.push(Reading {
                key: key("bans", &route.name, &limit.name),
                channels: BANS,
                totals: vec![get(&m.bans), get(&m.banned_requests), get(&m.ban_lifts)],
            });
        }
    }
}

/// The Redis client's calls and failures.
fn redis(_: &State, rt: &Runtime, out: &mut Vec<Reading>) {
    let Some(redis) = &rt.redis else { return };
    let s = redis.stats();
    out.push(Reading {
        key: key("redis", &"".into(), &"".into()),
        channels: REDIS,
        totals: vec![s.redis_calls, s.errors, s.timeouts],
    });
}

/// Requests refused by an operator's ban (`POST /api/v1/bans`), by route.
fn operator_bans(state: &State, rt: &Runtime, out: &mut Vec<Reading>) {
    let family = &state.metrics.admin_banned_requests;
    for route in &rt.routes {
        let labels = RouteLabels {
            route: route.name.to_string(),
        };
        out.push(Reading {
            key: key("operator_bans", &route.name, &"".into()),
            channels: &["refused"],
            totals: vec![family.get(&labels).map_or(0, |c| c.get())],
        });
    }
}

/// The candidate config's decisions (`candidate:`), by its route and limit: what it would
/// have admitted and limited.
fn candidates(_: &State, rt: &Runtime, out: &mut Vec<Reading>) {
    use crate::metrics::CandidateOutcome;
    let Some(candidate) = &rt.candidate else {
        return;
    };
    let mut by_limit: std::collections::BTreeMap<(Arc<str>, Arc<str>), [u64; 2]> =
        std::collections::BTreeMap::new();
    for (route, limit, outcome, n) in candidate.decisions() {
        let slot = match outcome {
            CandidateOutcome::admitted => 0,
            CandidateOutcome::limited => 1,
            _ => continue,
        };
        by_limit.entry((route, limit)).or_default()[slot] += n;
    }
    for ((route, limit), totals) in by_limit {
        out.push(Reading {
            key: key("candidates", &route, &limit),
            channels: &["admitted", "limited"],
            totals: totals.to_vec(),
        });
    }
}

/// Config reloads.
fn reloads(state: &State, _: &Runtime, out: &mut Vec<Reading>) {
    let (ok, failed) = state.metrics.reload_counts();
    out.push(Reading {
        key: key("reloads", &"".into(), &"".into()),
        channels: RELOADS,
        totals: vec![ok, failed],
    });
}
