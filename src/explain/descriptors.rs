//! A rate limit service call explained (`domain=` and `descriptor=` instead of a request):
//! the rule each descriptor matches and its limit's state now, read and never charged, with
//! the operators' ban and overrides, as `rls` would decide the call.

use serde::{Deserialize, Serialize};

use super::decision::{decide, Decision, Verdict};
use super::limit::{self, At};
use super::{Asked, Explanation};
use crate::identity::ClientId;
use crate::rls::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use crate::rls::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::rls::pb::RateLimitRequest;
use crate::runtime::Runtime;

/// One descriptor of the call, and what applies to it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DescriptorExplained {
    /// Its entries, as given (`tenant=acme,path=/search`).
    pub entries: String,
    /// `limited` (its limit is among the explanation's `limits`), `not limited` (no rule
    /// matches), `unlimited`, `replaced` (by another descriptor's limit) or `refuses every
    /// call` (`requests_per_unit: 0`).
    pub applies: String,
    /// The name of the limit that counts it, when one does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
}

/// Explain the call of `domain` with `descriptors` (each `KEY=VALUE,KEY=VALUE`) against `rt`.
pub(super) async fn explain(
    rt: &Runtime,
    control: Option<&crate::control::InForce>,
    (domain, descriptors): (&str, &[String]),
    now: crate::limiter::Moment,
    source: String,
) -> Result<Explanation, String> {
    let Some(domains) = &rt.rls else {
        return Err("the config has no `rls`: there is no rate limit service to explain".into());
    };
    let call = call_of(domain, descriptors)?;
    let matched = crate::rls::Matched::of(domains, &call);
    let (req, ip) = crate::rls::operators::request_of(&call);
    let arrival = crate::identity::Arrival::of(&req, ip);
    let view = arrival.view(false, None);
    let now_ms = crate::control::entry::now_ms();
    let route = format!("rls:{domain}");
    let ban = control.and_then(|c| c.ban_for(&view, &route, now_ms).map(|b| b.view(now_ms)));
    let at = At {
        redis: rt.redis.as_deref(),
        now_us: now.us(),
        peer: crate::limiter::local::Peer::of(ip),
    };
    let mut limits = Vec::with_capacity(matched.limits.len());
    for (i, l) in matched.limits.iter().enumerate() {
        let tuned = control.and_then(|c| {
            let o = c.override_for(&l.name, &view, now_ms)?;
            let t = c.tuning(l, &view, now_ms)?;
            Some((t, serde_json::to_value(o.view(now_ms)).ok()?))
        });
        let client = matched.clients[i].unwrap_or(ClientId(0));
        let (_, given) = given(&matched, descriptors, i);
        limits.push(limit::for_descriptor(l, (client, given), &at, tuned).await);
    }
    let explained = explained(&matched, descriptors);
    let decision = match (&ban, explained.iter().find(|d| d.applies == REFUSES)) {
        (Some(ban), _) => Decision::operator_ban(ban),
        (None, Some(d)) => Decision::refuses_every_call(&d.entries),
        (None, None) => decide(&limits),
    };
    Ok(Explanation {
        source,
        backend: if rt.redis.is_some() { "redis" } else { "local" }.to_owned(),
        request: Asked {
            method: "ShouldRateLimit".into(),
            host: domain.to_owned(),
            path: descriptors.join(" | "),
            peer: ip.to_string(),
            client_ip: Some(ip.to_string()),
            headers: Vec::new(),
        },
        route: Some(route),
        decision: Decision {
            status: (decision.outcome != Verdict::Admitted).then_some(429),
            ..decision
        },
        operator_ban: ban.and_then(|b| serde_json::to_value(b).ok()),
        limits,
        capacity: None,
        descriptors: explained,
    })
}

const REFUSES: &str = "refuses every call";

/// The call `descriptors` describe in `domain`.
fn call_of(domain: &str, descriptors: &[String]) -> Result<RateLimitRequest, String> {
    if domain.is_empty() {
        return Err("`domain=` must name a domain".into());
    }
    if descriptors.is_empty() {
        return Err("give at least one `descriptor=KEY=VALUE,KEY=VALUE`".into());
    }
    let mut call = RateLimitRequest {
        domain: domain.to_owned(),
        ..RateLimitRequest::default()
    };
    for d in descriptors {
        let entries = (d.split(','))
            .map(|e| {
                let (key, value) = e.split_once('=').ok_or_else(|| {
                    format!("descriptor entry `{e}` is not KEY=VALUE (entries are joined by `,`)")
                })?;
                Ok(Entry {
                    key: key.trim().to_owned(),
                    value: value.trim().to_owned(),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        call.descriptors.push(RateLimitDescriptor {
            entries,
            ..RateLimitDescriptor::default()
        });
    }
    Ok(call)
}

/// The descriptor whose limit is `matched.limits[index]`: its position and its entries.
fn given(
    matched: &crate::rls::Matched<'_>,
    descriptors: &[String],
    index: usize,
) -> (usize, String) {
    let at = (matched.rules.iter())
        .position(|r| matches!(r, Some((_, Some(i))) if *i == index))
        .unwrap_or(0);
    (at, descriptors.get(at).cloned().unwrap_or_default())
}

/// What applies to each descriptor.
fn explained(
    matched: &crate::rls::Matched<'_>,
    descriptors: &[String],
) -> Vec<DescriptorExplained> {
    (matched.rules.iter().zip(descriptors))
        .map(|(rule, entries)| {
            let (applies, limit) = match rule {
                None => ("not limited", None),
                Some((r, _)) if r.unlimited => ("unlimited", None),
                Some((r, _)) if r.refuses_all() => (REFUSES, None),
                Some((_, Some(i))) => ("limited", Some(matched.limits[*i].name.to_string())),
                Some((_, None)) => ("replaced", None),
            };
            DescriptorExplained {
                entries: entries.clone(),
                applies: applies.to_owned(),
                limit,
            }
        })
        .collect()
}
