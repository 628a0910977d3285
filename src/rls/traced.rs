//! A rate limit service call as a SERVER span of its caller's trace (Envoy's `traceparent` in
//! the call's metadata): `rpc.*`, the domain, the overall answer, and one `tollgate.limit` event
//! per descriptor limit decided.

use super::pb::rate_limit_response::Code;
use super::pb::{RateLimitRequest, RateLimitResponse};
use crate::limiter::{Decision, Limit};
use crate::telemetry::RequestSpan;
use opentelemetry::KeyValue;

/// Export `span` for `call`, answered `response` after `decision` over `limits`, if its trace is
/// exported (sampled, or over the limit with `sample_refused`).
pub(super) fn export(
    mut span: Box<RequestSpan>,
    call: &RateLimitRequest,
    (limits, decision): (&[std::sync::Arc<Limit>], &Decision),
    response: &RateLimitResponse,
    peer: std::net::IpAddr,
) {
    let over = response.overall_code == Code::OverLimit as i32;
    span.notes.refused = over;
    if !span.exported() {
        return;
    }
    span.notes.limits = decision.notes(limits);
    let attributes = vec![
        KeyValue::new("rpc.system", "grpc"),
        KeyValue::new("rpc.service", "envoy.service.ratelimit.v3.RateLimitService"),
        KeyValue::new("rpc.method", "ShouldRateLimit"),
        KeyValue::new("rpc.grpc.status_code", 0_i64),
        KeyValue::new("client.address", peer.to_string()),
        KeyValue::new("tollgate.rls.domain", call.domain.clone()),
        KeyValue::new(
            "tollgate.rls.descriptors",
            i64::try_from(call.descriptors.len()).unwrap_or(i64::MAX),
        ),
        KeyValue::new("tollgate.outcome", if over { "over_limit" } else { "ok" }),
    ];
    let name = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit".to_owned();
    let data = span.server_span(name, attributes, None, std::time::SystemTime::now());
    span.export([data]);
}
