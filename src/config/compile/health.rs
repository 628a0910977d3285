//! The resilience keys of an upstream: `load_balancing`, `retries` and `health` (passive
//! ejection and the active check).

use std::time::Duration;

use http::uri::PathAndQuery;
use http::StatusCode;

use super::{duration_or, Problems};
use crate::config::file;
use crate::config::settings::{CheckSpec, HealthSpec, LoadBalancing};

/// `retries` when unset: enough to get past one dead target and one that just died, while a
/// request that every target refuses still fails in a few connection attempts.
const DEFAULT_RETRIES: u32 = 2;
/// More retries than this multiply a dead upstream's cost per request without a chance of
/// success that the first few did not have.
const MAX_RETRIES: u32 = 10;
/// nginx's `max_fails` is 1, Envoy's `consecutive_5xx` 5: three failures in a row are rarely
/// bad luck, and a target ejected one request too late costs a retry each, not an error.
const DEFAULT_MAX_FAILS: u32 = 3;
/// nginx's `fail_timeout` default: short enough that a target back from a restart gets
/// traffic again soon, and doubling makes a target that stays broken cost little.
const DEFAULT_FAIL_TIMEOUT: Duration = Duration::from_secs(10);
/// Envoy's `max_ejection_time` default.
const DEFAULT_MAX_EJECTION: Duration = Duration::from_mins(5);
/// nginx Plus's default check interval.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);
const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_THRESHOLD: u32 = 2;

/// How upstream `u` (at `path`, as `upstreams.NAME`) spreads, retries and ejects.
pub(super) fn resilience(
    u: &file::Upstream,
    path: &str,
    p: &mut Problems,
) -> (LoadBalancing, u32, HealthSpec) {
    let balance = match u.load_balancing.as_deref() {
        None | Some("round_robin") => LoadBalancing::RoundRobin,
        Some("least_request") => LoadBalancing::LeastRequest,
        Some(other) => {
            p.add(
                format!("{path}.load_balancing"),
                format!("`{other}` is not a load-balancing policy (round_robin or least_request)"),
            );
            LoadBalancing::RoundRobin
        }
    };
    let retries = u.retries.unwrap_or(DEFAULT_RETRIES);
    if retries > MAX_RETRIES {
        p.add(
            format!("{path}.retries"),
            format!("must be at most {MAX_RETRIES}"),
        );
    }
    let health = health(u.health.as_ref(), &format!("{path}.health"), p);
    (balance, retries, health)
}

fn health(h: Option<&file::Health>, path: &str, p: &mut Problems) -> HealthSpec {
    let fail_timeout = positive(
        p,
        format!("{path}.fail_timeout"),
        h.and_then(|h| h.fail_timeout.as_ref()),
        DEFAULT_FAIL_TIMEOUT,
    );
    let max_ejection = positive(
        p,
        format!("{path}.max_ejection"),
        h.and_then(|h| h.max_ejection.as_ref()),
        DEFAULT_MAX_EJECTION,
    );
    if max_ejection < fail_timeout {
        p.add(
            format!("{path}.max_ejection"),
            "must not be shorter than `fail_timeout`",
        );
    }
    let mut failure_statuses: Vec<StatusCode> = h
        .map(|h| h.failure_statuses.as_slice())
        .unwrap_or_default()
        .iter()
        .enumerate()
        .filter_map(|(i, &code)| {
            let status = StatusCode::from_u16(code)
                .ok()
                .filter(|s| s.is_client_error() || s.is_server_error())
                .ok_or_else(|| format!("`{code}` is not an error status (400-599)"));
            p.take(format!("{path}.failure_statuses[{i}]"), status)
        })
        .collect();
    failure_statuses.sort_unstable();
    failure_statuses.dedup();
    HealthSpec {
        max_fails: h.and_then(|h| h.max_fails).unwrap_or(DEFAULT_MAX_FAILS),
        fail_timeout,
        max_ejection,
        failure_statuses,
        check: h
            .and_then(|h| h.check.as_ref())
            .and_then(|c| check(c, &format!("{path}.check"), p)),
    }
}

/// The path gRPC's health check asks.
const GRPC_HEALTH: &str = "/grpc.health.v1.Health/Check";

fn check(c: &file::HealthCheck, path: &str, p: &mut Problems) -> Option<CheckSpec> {
    let target = match (&c.path, &c.grpc) {
        (Some(_), Some(_)) => Err("has both `path` and `grpc`: a check asks one".to_owned()),
        (None, None) => Err("needs `path` (an HTTP check) or `grpc` (gRPC's health check)".into()),
        (None, Some(_)) => Ok(PathAndQuery::from_static(GRPC_HEALTH)),
        (Some(raw), None) if raw.starts_with('/') => raw
            .parse::<PathAndQuery>()
            .map_err(|_| format!("`{raw}` is not a path (and query) to request")),
        (Some(raw), None) => Err(format!("`{raw}` must start with `/`")),
    };
    let key = match c.path {
        Some(_) => format!("{path}.path"),
        None => path.to_owned(),
    };
    let target = p.take(key, target);
    let interval = positive(
        p,
        format!("{path}.interval"),
        c.interval.as_ref(),
        DEFAULT_INTERVAL,
    );
    // A short interval shortens the default timeout with it: checks never overlap.
    let timeout = positive(
        p,
        format!("{path}.timeout"),
        c.timeout.as_ref(),
        DEFAULT_CHECK_TIMEOUT.min(interval),
    );
    if timeout > interval {
        p.add(
            format!("{path}.timeout"),
            "must not be longer than `interval` (checks would overlap)",
        );
    }
    let mut threshold = |key: &str, raw: Option<u32>| {
        let n = raw.unwrap_or(DEFAULT_THRESHOLD);
        if n == 0 {
            p.add(format!("{path}.{key}"), "must be at least 1");
        }
        n
    };
    let healthy_threshold = threshold("healthy_threshold", c.healthy_threshold);
    let unhealthy_threshold = threshold("unhealthy_threshold", c.unhealthy_threshold);
    Some(CheckSpec {
        path: target?,
        grpc: c
            .grpc
            .as_ref()
            .map(|g| g.service.clone().unwrap_or_default()),
        interval,
        timeout,
        healthy_threshold,
        unhealthy_threshold,
    })
}

/// A duration that must be longer than zero, or `default` when unset.
fn positive(p: &mut Problems, path: String, raw: Option<&String>, default: Duration) -> Duration {
    let d = duration_or(p, path.clone(), raw, default);
    if d.is_zero() {
        p.add(path, "must be longer than zero");
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::settings::UpstreamSpec;
    use std::sync::Arc;

    fn upstream(keys: &str) -> Arc<UpstreamSpec> {
        let text = format!(
            "listeners: [{{ address: 127.0.0.1:0 }}]\nupstreams:\n  app:\n    targets: [127.0.0.1:1, 127.0.0.1:2]\n{keys}"
        );
        let settings = crate::config::parse(&text).unwrap_or_else(|p| panic!("{p:?}"));
        settings.upstreams[0].clone()
    }

    #[test]
    fn defaults_balance_round_robin_retry_twice_and_eject_after_three() {
        let u = upstream("");
        assert_eq!((u.balance, u.retries), (LoadBalancing::RoundRobin, 2));
        assert_eq!(
            u.health,
            HealthSpec {
                max_fails: 3,
                fail_timeout: Duration::from_secs(10),
                max_ejection: Duration::from_mins(5),
                failure_statuses: Vec::new(),
                check: None,
            }
        );
    }

    #[test]
    fn a_check_gets_its_defaults_and_a_short_interval_shortens_the_timeout() {
        let u = upstream(
            "    load_balancing: least_request\n    health:\n      failure_statuses: [504, 502, 504]\n      check: { path: /healthz?deep=1, interval: 300ms }\n",
        );
        assert_eq!(u.balance, LoadBalancing::LeastRequest);
        assert_eq!(
            u.health.failure_statuses,
            [StatusCode::BAD_GATEWAY, StatusCode::GATEWAY_TIMEOUT],
            "sorted, once each"
        );
        let check = u.health.check.clone().expect("a check");
        assert_eq!(check.path.as_str(), "/healthz?deep=1");
        assert_eq!(check.interval, Duration::from_millis(300));
        assert_eq!(check.timeout, Duration::from_millis(300));
        assert_eq!((check.healthy_threshold, check.unhealthy_threshold), (2, 2));
    }

    #[test]
    fn health_settings_are_part_of_the_fingerprint() {
        let plain = upstream("");
        assert_eq!(plain.fingerprint, upstream("").fingerprint);
        for keys in [
            "    retries: 1\n",
            "    load_balancing: least_request\n",
            "    health: { max_fails: 5 }\n",
            "    health: { check: { path: /healthz } }\n",
        ] {
            assert_ne!(plain.fingerprint, upstream(keys).fingerprint, "{keys}");
        }
    }

    #[test]
    fn max_ejection_must_not_be_shorter_than_fail_timeout() {
        let text = "listeners: [{ address: 127.0.0.1:0 }]\nupstreams:\n  app:\n    targets: [127.0.0.1:1]\n    health: { fail_timeout: 1m, max_ejection: 30s, max_fails: 1 }\n";
        let problems = crate::config::parse(text).expect_err("invalid");
        let found: Vec<(&str, &str)> = problems
            .iter()
            .map(|p| (p.path.as_str(), p.message.as_str()))
            .collect();
        assert_eq!(
            found,
            [(
                "upstreams.app.health.max_ejection",
                "must not be shorter than `fail_timeout`"
            )]
        );
    }
}
