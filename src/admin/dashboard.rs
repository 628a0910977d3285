//! The live dashboard: the page at `/dashboard` (HTML and script embedded, no data in them)
//! and its data at `GET /api/v1/dashboard`, read off the live counters, the sampler's history
//! and the most-limited sketches.

use std::collections::HashMap;

use http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, X_CONTENT_TYPE_OPTIONS, X_FRAME_OPTIONS,
};
use http::{HeaderValue, Response, StatusCode};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde_json::{json, Map, Value};

use super::call::Call;
use super::sampler::{BANS, DECISIONS, DECISION_OUTCOMES, REDIS, RELOADS};
use crate::config::settings::Backend;
use crate::limiter::Limit;
use crate::metrics::history::{Rates, SECONDS};
use crate::metrics::top::WINDOW_SECS;
use crate::metrics::RouteLimitLabels;
use crate::response::{fixed, Body};
use crate::runtime::Runtime;
use crate::state::State;

const PAGE: &str = include_str!("dashboard.html");
const SCRIPT: &str = include_str!("dashboard.js");

/// The page may run its own script and talk to this listener, nothing else; no frame may
/// hold it (the token it keeps must not be clicked at from another page).
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; \
    connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

/// Identities listed per limit.
const TOP: usize = 10;

/// The page or its script, for `path`; `None` for any other path.
pub(super) fn asset(path: &str) -> Option<Response<Body>> {
    let (content_type, body) = match path {
        "/dashboard" | "/dashboard/" => ("text/html; charset=utf-8", PAGE),
        "/dashboard.js" => ("text/javascript; charset=utf-8", SCRIPT),
        _ => return None,
    };
    let mut res = fixed(StatusCode::OK, content_type, body);
    let h = res.headers_mut();
    h.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(
        http::header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    Some(res)
}

/// `GET /api/v1/dashboard[?step=S]`: rates in steps of `S` seconds (1 to 60, default 5).
pub(super) fn data(state: &State, call: &Call) -> Response<Body> {
    let step = call
        .query
        .iter()
        .find(|(k, _)| k == "step")
        .and_then(|(_, s)| s.parse::<usize>().ok())
        .unwrap_or(5)
        .clamp(1, 60);
    let rt = state.runtime.load_full();
    let history = &state.metrics.history;
    let tick = history.tick();
    let limits = [limits(state, &rt, step), rls_limits(state, &rt, step)].concat();
    let mut body = json!({
        "step_s": step,
        "points": SECONDS / step,
        "sampled_s": tick,
        "most_limited_window_s": tick.map(|t| t.min(WINDOW_SECS + t % WINDOW_SECS)),
        "limits": limits,
        "limiter": limiter(&rt, &by_key(history.rates("redis", step)), step),
        "config": config(state, step),
        "upstreams": upstreams(&rt),
        "series": other_series(state, step),
    });
    body["generation"] = json!(*state.generation.borrow());
    // Compact: a page polls it every two seconds.
    let mut res = fixed(
        StatusCode::OK,
        "application/json",
        serde_json::to_vec(&body).unwrap_or_default(),
    );
    res.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}

type ByKey = HashMap<(String, String), Rates>;

fn by_key(rates: Vec<Rates>) -> ByKey {
    rates
        .into_iter()
        .map(|r| ((r.key.route.to_string(), r.key.limit.to_string()), r))
        .collect()
}

/// `{"window": {channel: increase over ten minutes}, "rate": {channel: [per second...]}}`
/// of a series (zeros before the sampler saw it).
fn series(rates: Option<&Rates>, channels: &[&str], step: usize) -> (Value, Value) {
    let (mut window, mut rate) = (Map::new(), Map::new());
    for c in channels {
        let found = rates.and_then(|r| r.channels.iter().find(|(n, _, _)| n == c));
        let (points, sum) = found.map_or_else(
            || (vec![0.0; SECONDS / step], 0),
            |(_, p, s)| {
                (
                    p.iter().map(|r| (r * 1000.0).round() / 1000.0).collect(),
                    *s,
                )
            },
        );
        window.insert((*c).to_owned(), json!(sum));
        rate.insert((*c).to_owned(), json!(points));
    }
    (Value::Object(window), Value::Object(rate))
}

/// Every route's limits: counts now, rates, most limited identities, bans.
fn limits(state: &State, rt: &Runtime, step: usize) -> Vec<Value> {
    let history = &state.metrics.history;
    let decisions = by_key(history.rates("decisions", step));
    let bans = by_key(history.rates("bans", step));
    let mut out = Vec::new();
    for route in &rt.routes {
        for (i, limit) in route.limits.iter().enumerate() {
            let k = (route.name.to_string(), limit.name.to_string());
            let mut total = Map::new();
            if let Some(c) = route.counters.decisions.get(i) {
                for (name, o) in DECISIONS.iter().zip(DECISION_OUTCOMES) {
                    total.insert((*name).to_owned(), json!(c[o as usize].get()));
                }
            }
            let most = route
                .counters
                .most_limited
                .get(i)
                .map_or_else(Vec::new, |s| {
                    s.top(TOP)
                    .into_iter()
                    .map(|t| json!({"digest": t.client.hex(), "count": t.count, "error": t.error}))
                    .collect()
                });
            let mut v = row(&route.name, limit, total, decisions.get(&k), step);
            v["most_limited"] = json!(most);
            if limit.ban.is_some() {
                v["bans"] = ban_counts(state, &route.name, &limit.name, bans.get(&k), step);
            }
            if limit.settle.is_some() {
                v["settled"] = settled(state, &route.name, limit, rt.redis.is_some());
            }
            out.push(v);
        }
    }
    out
}

/// The rate limit service's rules, as route limits of the route `rls:DOMAIN`: counts per
/// rule (no identity is listed: descriptors' values are the call's, not kept).
fn rls_limits(state: &State, rt: &Runtime, step: usize) -> Vec<Value> {
    let decisions = by_key(state.metrics.history.rates("decisions", step));
    let rules = rt.rls.iter().flat_map(|d| d.rules());
    rules
        .map(|(domain, meta, limit)| {
            let route = format!("rls:{domain}");
            let totals = super::sampler::rls_totals(state, domain, &meta.rule);
            let total: Map<String, Value> = (DECISIONS.iter().zip(totals))
                .map(|(name, n)| ((*name).to_owned(), json!(n)))
                .collect();
            let k = (route.clone(), limit.name.to_string());
            row(&route, limit, total, decisions.get(&k), step)
        })
        .collect()
}

/// One limit's row: its route, name, rule, decisions so far (`total`) and their sampled
/// series; no identity listed (`most_limited` empty) until the caller adds them.
fn row(
    route: &str,
    limit: &Limit,
    total: Map<String, Value>,
    rates: Option<&Rates>,
    step: usize,
) -> Value {
    let (window, rate) = series(rates, DECISIONS, step);
    json!({
        "route": route,
        "limit": &*limit.name,
        "rule": rule(limit),
        "shadow": limit.shadow,
        "total": Value::Object(total),
        "window": window,
        "rate": rate,
        "most_limited": [],
    })
}

/// A settled cost's limit: the units its responses settled, its reserve, and (in process)
/// the identities owing and what they owe.
fn settled(state: &State, route: &str, limit: &Limit, shared: bool) -> Value {
    let labels = RouteLimitLabels {
        route: route.to_owned(),
        limit: limit.name.to_string(),
    };
    let units = state
        .metrics
        .limit_units
        .get(&labels)
        .map_or(0, |c| c.get());
    let mut v = json!({"units": units, "reserve": limit.cost});
    if !shared {
        let now = state.clock.now().us();
        let (owing, owed) = limit.local.owing_now(&limit.rate, now);
        v["owing"] = json!(owing);
        v["owed"] = json!(owed);
    }
    v
}

/// A ban limit's bans: begun, requests refused, lifted.
fn ban_counts(
    state: &State,
    route: &str,
    limit: &str,
    rates: Option<&Rates>,
    step: usize,
) -> Value {
    let m = &state.metrics;
    let labels = RouteLimitLabels {
        route: route.to_owned(),
        limit: limit.to_owned(),
    };
    let get = |f: &Family<RouteLimitLabels, Counter>| f.get(&labels).map_or(0, |c| c.get());
    let (window, rate) = series(rates, BANS, step);
    json!({
        "total": {"started": get(&m.bans), "refused": get(&m.banned_requests), "lifted": get(&m.ban_lifts)},
        "window": window,
        "rate": rate,
    })
}

/// A limit's rule as a person reads it: `10/s, burst 20`, `1000/day`, `5/15m exact`, `5 in
/// flight`.
fn rule(limit: &Limit) -> String {
    if let Some(c) = &limit.concurrency {
        return format!("{} in flight", c.max);
    }
    if let Some(q) = &limit.quota {
        if q.is_window() {
            return format!(
                "{}/{} {}",
                q.count,
                q.period.describe(),
                q.counting.as_str()
            );
        }
        return format!("{}/{}", q.count, q.period.describe());
    }
    let per_sec = limit.rate.per_sec;
    let (n, unit) = [(1.0, "s"), (60.0, "min"), (3600.0, "h"), (86400.0, "day")]
        .into_iter()
        .map(|(secs, unit)| (per_sec * secs, unit))
        .find(|(n, _)| *n >= 1.0)
        .unwrap_or((per_sec * 86400.0, "day"));
    let n = format!("{n:.2}");
    let n = n.trim_end_matches('0').trim_end_matches('.');
    format!("{n}/{unit}, burst {}", limit.rate.burst)
}

/// The limiter's store: in process, or Redis with its breaker and failures.
fn limiter(rt: &Runtime, rates: &ByKey, step: usize) -> Value {
    // In process: the store, or Redis's fallback.
    let buckets: usize = rt.limits().map(|l| l.local.len()).sum();
    let Backend::Redis(cfg) = &rt.settings.limiter.backend else {
        return json!({"backend": "local", "buckets": buckets});
    };
    let mode = if !cfg.cluster.is_empty() {
        "cluster"
    } else if cfg.sentinel.is_some() {
        "sentinel"
    } else {
        "single"
    };
    let Some(redis) = &rt.redis else {
        return json!({"backend": "redis", "mode": mode, "buckets": buckets});
    };
    let s = redis.stats();
    let (window, rate) = series(rates.get(&(String::new(), String::new())), REDIS, step);
    json!({
        "backend": "redis",
        "mode": mode,
        "breaker_open": redis.breaker_open(),
        "buckets": buckets,
        "total": {"calls": s.redis_calls, "errors": s.errors, "timeouts": s.timeouts, "negative_hits": s.negative_hits, "reconnects": s.reconnects, "failovers": s.failovers},
        "window": window,
        "rate": rate,
    })
}

/// The live config's generation and the reloads' results.
fn config(state: &State, step: usize) -> Value {
    let (ok, failed) = state.metrics.reload_counts();
    let rates = by_key(state.metrics.history.rates("reloads", step));
    let (window, _) = series(rates.get(&(String::new(), String::new())), RELOADS, step);
    json!({
        "generation": *state.generation.borrow(),
        "reloads": {"ok": ok, "failed": failed},
        "window": window,
    })
}

/// The series of sources the sections above do not show, by source, then route and limit: a
/// source added to the sampler is in the answer without more code here.
fn other_series(state: &State, step: usize) -> Value {
    let history = &state.metrics.history;
    let mut out = Map::new();
    for source in history.sources() {
        if super::sampler::SHOWN.contains(&source) {
            continue;
        }
        let all: Vec<Value> = history
            .rates(source, step)
            .iter()
            .map(|r| {
                let channels: Vec<&str> = r.channels.iter().map(|(c, _, _)| *c).collect();
                let (window, rate) = series(Some(r), &channels, step);
                json!({"route": &*r.key.route, "limit": &*r.key.limit, "window": window, "rate": rate})
            })
            .collect();
        out.insert(source.to_owned(), Value::Array(all));
    }
    Value::Object(out)
}

/// Every upstream target's health, load and cap, with its upstream's queue when capped.
fn upstreams(rt: &Runtime) -> Vec<Value> {
    let queues: std::collections::HashMap<&str, crate::capacity::Stats> = (rt.upstreams.iter())
        .filter_map(|u| Some((&*u.name, u.capacity()?)))
        .collect();
    super::target_samples(rt)
        .into_iter()
        .map(|t| {
            let queue = queues.get(&*t.upstream);
            json!({
                "upstream": &*t.upstream,
                "target": t.target,
                "healthy": t.healthy,
                "in_flight": t.in_flight,
                "cap": t.cap,
                "queued": queue.map(|q| q.queued),
                "queue_size": queue.map(|q| q.queue_size),
            })
        })
        .collect()
}
