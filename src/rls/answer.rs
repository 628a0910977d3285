//! A rate limit service call's answer: a status per descriptor, the overall code, the
//! `RateLimit` headers Envoy adds to the client's response, and the call's metrics.

use http::HeaderMap;

use super::pb::rate_limit_response::{rate_limit, Code, DescriptorStatus, RateLimit};
use super::pb::RateLimitResponse;
use super::Matched;
use crate::config::settings::HeaderPolicy;
use crate::limiter::{Decision, LimitResult, Outcome};
use crate::metrics::{Metrics, RlsLabels};

/// Over this share of its limit a descriptor is `near_limit` (envoyproxy/ratelimit's 80%).
const NEAR_LIMIT: f64 = 0.8;

/// The answer to `call`, from `decision` over `matched`'s limits.
pub(super) fn response(
    matched: &Matched<'_>,
    decision: &Decision,
    policy: HeaderPolicy,
) -> RateLimitResponse {
    let statuses: Vec<DescriptorStatus> = (matched.rules.iter())
        .map(|rule| {
            let Some((rule, index)) = rule else {
                return status(None, None);
            };
            let result = index.and_then(|i| result(decision, i));
            let limited = index.is_some() || rule.refuses_all();
            status(Some(&**rule).filter(|_| limited), result)
        })
        .collect();
    let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
    let mut headers = HeaderMap::new();
    crate::response::add_headers(&mut headers, &matched.limits, &[], decision, policy);
    if over {
        if let Some(v) = decision.rejected_by().and_then(|r| r.verdict) {
            let secs = crate::response::secs_up(v.retry_after_us).max(1);
            headers.insert(http::header::RETRY_AFTER, http::HeaderValue::from(secs));
        }
    }
    RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
        statuses,
        response_headers_to_add: (headers.iter())
            .filter_map(|(k, v)| {
                Some(super::pb::envoy::config::core::v3::HeaderValue {
                    key: k.as_str().to_owned(),
                    value: v.to_str().ok()?.to_owned(),
                })
            })
            .collect(),
        request_headers_to_add: Vec::new(),
    }
}

/// The answer to a call an operator's ban holds for `left` seconds: every descriptor over,
/// the wait told as `Retry-After`.
pub(super) fn banned(call: &super::pb::RateLimitRequest, left: u64) -> RateLimitResponse {
    let over = DescriptorStatus {
        code: Code::OverLimit as i32,
        duration_until_reset: Some(prost_types::Duration {
            seconds: i64::try_from(left).unwrap_or(i64::MAX),
            nanos: 0,
        }),
        ..DescriptorStatus::default()
    };
    RateLimitResponse {
        overall_code: Code::OverLimit as i32,
        statuses: vec![over; call.descriptors.len()],
        response_headers_to_add: vec![super::pb::envoy::config::core::v3::HeaderValue {
            key: "retry-after".into(),
            value: left.to_string(),
        }],
        request_headers_to_add: Vec::new(),
    }
}

/// The result of the limit at `index` of the decision's limits.
fn result(decision: &Decision, index: usize) -> Option<&LimitResult> {
    decision.results.iter().find(|r| r.index == index)
}

/// One descriptor's status: `OK` with no limit when nothing limits it (no rule, `unlimited`,
/// replaced), else its limit's numbers, `OVER_LIMIT` when that limit refused the call (or
/// refuses every call); a limit not asked (another descriptor refused every call) is `OK`.
fn status(
    rule: Option<&crate::limiter::descriptors::Rule>,
    result: Option<&LimitResult>,
) -> DescriptorStatus {
    let Some(rule) = rule else {
        return DescriptorStatus {
            code: Code::Ok as i32,
            ..DescriptorStatus::default()
        };
    };
    let over = rule.refuses_all()
        || result.is_some_and(|r| matches!(r.outcome, Outcome::Limited | Outcome::FailedClosed));
    let v = result
        .and_then(|r| r.verdict)
        .unwrap_or(crate::limiter::Verdict {
            admitted: !over,
            remaining: 0,
            reset_us: 0.0,
            retry_after_us: 0.0,
        });
    DescriptorStatus {
        code: if over { Code::OverLimit } else { Code::Ok } as i32,
        current_limit: rule.meta.as_ref().map(|m| RateLimit {
            name: m.name.clone(),
            requests_per_unit: m.requests_per_unit,
            unit: rate_limit::Unit::try_from(m.unit as i32).unwrap_or(rate_limit::Unit::Unknown)
                as i32,
        }),
        limit_remaining: u32::try_from(v.remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(prost_types::Duration {
            seconds: i64::try_from(crate::response::secs_up(v.reset_us)).unwrap_or(i64::MAX),
            nanos: 0,
        }),
    }
}

/// Count each descriptor with a limit: within, near or over it, or over a shadow limit.
pub(super) fn count(metrics: &Metrics, domain: &str, matched: &Matched<'_>, decision: &Decision) {
    if decision.results.iter().any(|r| r.fallback) {
        metrics.without_backend.inc();
    }
    for (rule, index) in matched.rules.iter().flatten() {
        let Some(meta) = rule.meta.as_ref() else {
            continue;
        };
        let result = index.and_then(|i| result(decision, i));
        let used = result.and_then(|r| r.verdict).map_or(0.0, |v| {
            1.0 - v.remaining as f64 / f64::from(meta.requests_per_unit.max(1))
        });
        let outcome = match result.map(|r| r.outcome) {
            _ if rule.refuses_all() => "over_limit",
            None => continue,
            Some(Outcome::Limited | Outcome::FailedClosed) => "over_limit",
            Some(Outcome::ShadowLimited) => "shadow_mode",
            Some(_) if used >= NEAR_LIMIT => "near_limit",
            Some(_) => "within_limit",
        };
        let labels = RlsLabels {
            domain: domain.to_owned(),
            rule: meta.rule.clone(),
            result: outcome,
        };
        metrics.rls_descriptors.get_or_create(&labels).inc();
    }
}
