//! The `routes` section: match conditions, actions, body limits, and each route's limits.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};

use super::{duration_or, values, Problems};
use crate::body::BodyLimits;
use crate::config::file;
use crate::config::settings::{
    ActionSpec, Backend, LimitSpec, LimiterSettings, Rate, Respond, RouteSpec, UpstreamSpec,
};
use crate::identity::{Alternative, Exemption, KeySpec};
use crate::route::{HostPattern, Matcher, PathPattern};

/// What compiling one route needs from the rest of the file.
pub(super) struct RouteCtx<'a> {
    pub(super) upstreams: &'a HashMap<String, Option<Arc<UpstreamSpec>>>,
    pub(super) limiter: &'a LimiterSettings,
    /// Limit names seen so far (they are global: they name buckets).
    pub(super) limit_names: HashSet<String>,
    pub(super) broken_upstreams: &'a [String],
}

fn valid_name(s: &str) -> Result<(), String> {
    if s.len() > 128 {
        return Err(format!("name `{s}` is longer than 128 characters"));
    }
    let ok = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "name `{s}` may only use letters, digits, `_`, `.` and `-`"
        ))
    }
}

/// One route and its match conditions.
pub(super) fn route(
    r: &file::Route,
    path: &str,
    ctx: &mut RouteCtx<'_>,
    p: &mut Problems,
) -> Option<(RouteSpec, Matcher)> {
    p.take(format!("{path}.name"), valid_name(&r.name));
    let matcher = matcher(&r.matcher, &format!("{path}.match"), p);
    let action = match (&r.upstream, &r.respond) {
        (Some(name), None) => match ctx.upstreams.get(name) {
            Some(u) => u.clone().map(ActionSpec::Forward),
            None => {
                if !ctx.broken_upstreams.contains(name) {
                    p.add(
                        format!("{path}.upstream"),
                        format!("unknown upstream `{name}`"),
                    );
                }
                None
            }
        },
        (None, Some(respond)) => respond_action(respond, &format!("{path}.respond"), p),
        (Some(_), Some(_)) => {
            p.add(path, "a route has either `upstream` or `respond`, not both");
            None
        }
        (None, None) => {
            p.add(path, "a route needs `upstream: NAME` or `respond: {...}`");
            None
        }
    };
    let limits: Vec<LimitSpec> = r
        .limits
        .iter()
        .enumerate()
        .filter_map(|(i, l)| limit(l, &format!("{path}.limits[{i}]"), ctx, p))
        .collect();
    let body = body_limits(r, path, p);
    let websocket_idle = websocket_idle(r, path, p);
    let buffering = r.buffering.as_ref();
    let route = RouteSpec {
        buffer_request: buffering.and_then(|b| b.request).unwrap_or(true),
        buffer_response: buffering.and_then(|b| b.response).unwrap_or(true),
        fold_path: matcher.as_ref().is_some_and(|m| m.fold_case),
        name: r.name.as_str().into(),
        action: action?,
        limits,
        body,
        websocket: r.websocket,
        websocket_idle,
        retry_idempotent: r.retry_idempotent,
        priority: super::capacity::priority(r, path, p),
    };
    Some((route, matcher?))
}

fn websocket_idle(r: &file::Route, path: &str, p: &mut Problems) -> Duration {
    let key = format!("{path}.timeouts.websocket_idle");
    let idle = duration_or(
        p,
        key.clone(),
        r.timeouts.as_ref().and_then(|t| t.websocket_idle.as_ref()),
        Duration::from_hours(1),
    );
    if idle.is_zero() {
        p.add(key, "must be longer than zero");
    }
    idle
}

fn body_limits(r: &file::Route, path: &str, p: &mut Problems) -> BodyLimits {
    let d = BodyLimits::default();
    let t = r.timeouts.as_ref();
    let idle = duration_or(
        p,
        format!("{path}.timeouts.body_idle"),
        t.and_then(|t| t.body_idle.as_ref()),
        d.idle,
    );
    if idle.is_zero() {
        p.add(
            format!("{path}.timeouts.body_idle"),
            "must be longer than zero",
        );
    }
    let request = duration_or(
        p,
        format!("{path}.timeouts.request"),
        t.and_then(|t| t.request.as_ref()),
        d.request.unwrap_or_default(),
    );
    let max_bytes = r
        .max_body
        .as_ref()
        .and_then(|s| p.take(format!("{path}.max_body"), values::size(s)))
        .unwrap_or(d.max_bytes);
    BodyLimits {
        idle,
        request: (!request.is_zero()).then_some(request),
        max_bytes,
    }
}

/// `methods` and `headers`, parsed (a header's value compared without surrounding
/// whitespace, as a request's arrives).
fn methods_and_headers(
    m: &file::Match,
    path: &str,
    p: &mut Problems,
) -> (Option<Vec<Method>>, Vec<(HeaderName, HeaderValue)>) {
    if m.methods.as_ref().is_some_and(Vec::is_empty) {
        p.add(
            format!("{path}.methods"),
            "is empty, so the route could never match: list methods or remove the key",
        );
    }
    let methods = m.methods.as_ref().map(|ms| {
        ms.iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let r = Method::from_bytes(s.to_ascii_uppercase().as_bytes())
                    .map_err(|_| format!("`{s}` is not an HTTP method"));
                p.take(format!("{path}.methods[{i}]"), r)
            })
            .collect()
    });
    let headers = m
        .headers
        .iter()
        .filter_map(|(k, v)| {
            let name = p.take(
                format!("{path}.headers.{k}"),
                HeaderName::from_bytes(k.as_bytes())
                    .map_err(|_| format!("`{k}` is not a valid header name")),
            );
            // A request's field value arrives without surrounding whitespace: compared so.
            let value = p.take(
                format!("{path}.headers.{k}"),
                HeaderValue::from_str(v.trim_matches([' ', '\t']))
                    .map_err(|_| format!("`{v}` is not a valid header value")),
            );
            Some((name?, value?))
        })
        .collect();
    (methods, headers)
}

fn matcher(m: &file::Match, path: &str, p: &mut Problems) -> Option<Matcher> {
    let host = m
        .host
        .as_ref()
        .and_then(|h| p.take(format!("{path}.host"), HostPattern::parse(h)));
    let path_pattern = match (&m.path, &m.path_prefix) {
        (None, None) => PathPattern::Any,
        (Some(x), None) => PathPattern::Exact(p.take(format!("{path}.path"), normal_form(x))?),
        (None, Some(x)) => {
            PathPattern::Prefix(p.take(format!("{path}.path_prefix"), normal_form(x))?)
        }
        (Some(_), Some(_)) => {
            p.add(path, "use `path` (exact) or `path_prefix`, not both");
            return None;
        }
    };
    let fold_case = match m.path_case.as_deref() {
        None | Some("sensitive") => false,
        Some("insensitive") => true,
        Some(other) => {
            p.add(
                format!("{path}.path_case"),
                format!("`{other}` is not sensitive or insensitive"),
            );
            false
        }
    };
    if m.path_case.is_some() && path_pattern == PathPattern::Any {
        p.add(
            format!("{path}.path_case"),
            "only applies with `path` or `path_prefix`",
        );
    }
    let extensions = m.path_extensions.unwrap_or(false);
    if extensions && !matches!(path_pattern, PathPattern::Exact(_)) {
        p.add(
            format!("{path}.path_extensions"),
            "only applies with an exact `path`",
        );
    }
    let (methods, headers) = methods_and_headers(m, path, p);
    Some(Matcher {
        host,
        path: path_pattern,
        methods,
        headers,
        fold_case,
        extensions,
    })
}

/// A route's path as requests are matched: it must start with `/` and be in the normal form
/// screening gives request paths (else it could never match).
fn normal_form(s: &String) -> Result<String, String> {
    if !s.starts_with('/') {
        return Err(format!("`{s}` must start with `/`"));
    }
    let Ok(normal) = crate::screen::normalize_path(s) else {
        return Err(format!(
            "`{s}` could never match: requests spelled so are refused with 400"
        ));
    };
    let routed = crate::screen::route_form(&normal);
    if routed != s.as_str() {
        return Err(format!(
            "`{s}` could never match: request paths are matched in normal form, as `{routed}`"
        ));
    }
    Ok(s.clone())
}

fn respond_action(r: &file::Respond, path: &str, p: &mut Problems) -> Option<ActionSpec> {
    let status = p.take(
        format!("{path}.status"),
        StatusCode::from_u16(r.status)
            .ok()
            .filter(|s| (200..=599).contains(&s.as_u16()))
            .ok_or_else(|| format!("`{}` is not a final HTTP status (200-599)", r.status)),
    );
    let mut headers = HeaderMap::new();
    for (k, v) in &r.headers {
        let kv = HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| format!("`{k}` is not a valid header name"))
            .and_then(|n| {
                Ok((
                    n,
                    HeaderValue::from_str(v)
                        .map_err(|_| format!("`{v}` is not a valid header value"))?,
                ))
            });
        if let Some((n, v)) = p.take(format!("{path}.headers.{k}"), kv) {
            headers.insert(n, v);
        }
    }
    Some(ActionSpec::Respond(Arc::new(Respond {
        status: status?,
        body: Bytes::from(r.body.clone()),
        headers,
    })))
}

/// `cost`: at least 1, and no more than `burst` (or no request could pass).
fn cost(l: &file::Limit, burst: Option<u32>, path: &str, p: &mut Problems) -> u32 {
    let (cost, key) = match &l.cost {
        None => (1, "cost"),
        Some(file::Cost::Fixed(n)) => (*n, "cost"),
        Some(file::Cost::Settled(s)) => (s.reserve, "cost.reserve"),
    };
    if cost == 0 {
        p.add(format!("{path}.{key}"), "must be at least 1");
    }
    if let Some(b) = burst {
        if cost > b {
            let what = if key == "cost" { "cost" } else { "reserve" };
            p.add(
                format!("{path}.{key}"),
                format!("{what} {cost} is larger than burst {b}: no request could ever pass"),
            );
        }
    }
    cost
}

/// Whom a limit counts and whom it lets through: `key` and `exempt`, parsed.
fn who(l: &file::Limit, path: &str, p: &mut Problems) -> (KeySpec, Vec<Exemption>) {
    if l.key.is_empty() {
        p.add(
            format!("{path}.key"),
            "needs at least one source, as in `[ip]`",
        );
    }
    let key = KeySpec(
        l.key
            .iter()
            .enumerate()
            .filter_map(|(i, k)| p.take(format!("{path}.key[{i}]"), Alternative::parse(k)))
            .collect(),
    );
    let exempt = l
        .exempt
        .iter()
        .enumerate()
        .filter_map(|(i, e)| p.take(format!("{path}.exempt[{i}]"), Exemption::parse(e)))
        .collect();
    (key, exempt)
}

fn limit(
    l: &file::Limit,
    path: &str,
    ctx: &mut RouteCtx<'_>,
    p: &mut Problems,
) -> Option<LimitSpec> {
    p.take(format!("{path}.name"), valid_name(&l.name));
    if !ctx.limit_names.insert(l.name.clone()) {
        p.add(
            format!("{path}.name"),
            format!(
                "duplicate limit name `{}` (limit names are global: they name buckets)",
                l.name
            ),
        );
    }
    spec(l, path, ctx.limiter, p)
}

/// The spec of limit `l` at `path` under `limiter`'s settings, whatever names it (a route's
/// `limits` item, an RLS descriptor's `rate_limit`); `None` when it is wrong.
pub(super) fn spec(
    l: &file::Limit,
    path: &str,
    limiter: &LimiterSettings,
    p: &mut Problems,
) -> Option<LimitSpec> {
    let concurrency = super::concurrency::spec(l, path, limiter.divide_by, p);
    let (rate, burst, quota) = match concurrency {
        None => super::quota::shape(l, path, limiter.divide_by, p),
        Some(c) => {
            for (key, set) in [("quota", l.quota.is_some()), ("ban", l.ban.is_some())] {
                if set {
                    p.add(
                        format!("{path}.{key}"),
                        "is for `rate` and `quota` limits, not `concurrency` (use two limits)",
                    );
                }
            }
            (c.map(super::concurrency::as_rate), c.map(|c| c.max), None)
        }
    };
    let cost = cost(l, burst, path, p);
    let (key, exempt) = who(l, path, p);
    let on_failure = match &l.on_failure {
        Some(s) => p.take(format!("{path}.on_failure"), super::limiter::policy(s))?,
        None => limiter.on_failure,
    };
    let rate = Rate {
        per_sec: rate?.per_sec(),
        burst: burst?,
    };
    let redis = matches!(limiter.backend, Backend::Redis(_));
    let leasing = super::leasing::spec(l, path, &rate, cost, redis, p);
    let fallback = Rate {
        per_sec: rate.per_sec / f64::from(limiter.divide_by),
        burst: (rate.burst / limiter.divide_by).max(1),
    };
    Some(LimitSpec {
        name: l.name.as_str().into(),
        rate,
        cost,
        shadow: l.shadow,
        key,
        exempt,
        on_failure,
        fallback,
        quota,
        ban: l
            .ban
            .as_ref()
            .and_then(|b| super::quota::ban(b, l.shadow, path, p)),
        concurrency: concurrency.flatten(),
        leasing,
        count_when: super::responses::spec(l, path, p),
        settle: super::responses::settle(l, path, p),
    })
}
