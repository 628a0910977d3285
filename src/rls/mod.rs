//! Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService`), answered by the
//! limiter: each descriptor of a call matched to its domain's rule, all of them decided at
//! once, all or nothing, in the same store the routes' limits use.

mod answer;
pub(crate) mod operators;
pub mod pb;
mod serve;
mod traced;

use std::sync::Arc;

use tonic::{Request, Response, Status};

pub use serve::serve;

use crate::config::settings::RlsUnit;
use crate::identity::ClientId;
use crate::limiter::descriptors::RuleRef;
use crate::limiter::{self, Limit, Tuning};
use crate::state::State;
use pb::rate_limit_service_server::RateLimitService;
use pb::{RateLimitRequest, RateLimitResponse};

/// The service, over the live runtime.
pub struct Service {
    state: Arc<State>,
}

impl Service {
    pub fn new(state: Arc<State>) -> Self {
        Self { state }
    }
}

/// The address of the peer a call came from (Envoy's), put in the request's extensions by
/// `serve`.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub std::net::IpAddr);

#[tonic::async_trait]
impl RateLimitService for Service {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let peer = (request.extensions().get::<Peer>())
            .map_or(std::net::IpAddr::from([0, 0, 0, 0]), |p| p.0);
        let runtime = self.state.runtime.load_full();
        let span = (runtime.tracer.as_ref()).map(|t| t.begin(request.metadata().as_ref()));
        let call = request.into_inner();
        if call.domain.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit domain must not be empty",
            ));
        }
        if call.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit descriptor list must not be empty",
            ));
        }
        let Some(domains) = &runtime.rls else {
            return Err(Status::unavailable("no rate limit service is configured"));
        };
        let mut matched = Matched::of(domains, &call);
        if let Some(table) = self.state.control.active() {
            if let Some(left) = operators::apply(&table, &call, &mut matched) {
                let labels = crate::metrics::RouteLabels {
                    route: format!("rls:{}", call.domain),
                };
                self.state
                    .metrics
                    .admin_banned_requests
                    .get_or_create(&labels)
                    .inc();
                return Ok(Response::new(answer::banned(&call, left)));
            }
        }
        let shared = (runtime.redis.as_deref()).map(|redis| limiter::store::Shared {
            redis,
            worker: None,
        });
        let tuned: Vec<Option<&Tuning>> = matched.tunings.iter().map(Option::as_ref).collect();
        // A descriptor at `requests_per_unit: 0` refuses the call: the others take nothing.
        let decision = if matched.refused() {
            limiter::Decision::default()
        } else {
            let (peer, now) = (limiter::local::Peer::of(peer), self.state.clock.now());
            let (limits, clients) = (&matched.limits, &matched.clients);
            limiter::decide_checks(shared.as_ref(), limits, clients, &tuned, peer, now).await
        };
        let response = answer::response(&matched, &decision, runtime.settings.headers);
        answer::count(&self.state.metrics, &call.domain, &matched, &decision);
        if let Some(span) = span {
            traced::export(span, &call, (&matched.limits, &decision), &response, peer);
        }
        Ok(Response::new(response))
    }
}

/// A call's descriptors matched to their rules: the limits to decide (one per descriptor
/// with a limit, in descriptor order) with the identity each counts under and its cost.
pub(crate) struct Matched<'r> {
    /// Per descriptor: its rule, and the index of its limit in `limits`.
    pub rules: Vec<Option<(RuleRef<'r>, Option<usize>)>>,
    pub limits: Vec<Arc<Limit>>,
    pub clients: Vec<Option<ClientId>>,
    pub tunings: Vec<Option<Tuning>>,
}

impl<'r> Matched<'r> {
    /// A matched rule refuses every call (`requests_per_unit: 0`).
    pub(crate) fn refused(&self) -> bool {
        self.rules.iter().flatten().any(|(r, _)| r.refuses_all())
    }

    pub(crate) fn of(domains: &'r limiter::descriptors::Domains, call: &RateLimitRequest) -> Self {
        let found: Vec<Option<RuleRef<'r>>> = (call.descriptors.iter())
            .map(|d| {
                // The call's own numbers first, whatever the config says, as the reference.
                let own = (d.limit.as_ref()).and_then(|o| {
                    let unit = RlsUnit::of_number(o.unit)?;
                    domains.call_rule(&call.domain, o.requests_per_unit, unit)
                });
                if let Some(rule) = own {
                    return Some(RuleRef::Call(rule));
                }
                let entries: Vec<(&str, &str)> = (d.entries.iter())
                    .map(|e| (e.key.as_str(), e.value.as_str()))
                    .collect();
                domains.find(&call.domain, &entries).map(RuleRef::Config)
            })
            .collect();
        // A limit another matched limit `replaces` does not apply to this call.
        let replaced: Vec<String> = (found.iter().flatten())
            .filter_map(|r| r.meta.as_ref())
            .flat_map(|m| m.replaces.iter().cloned())
            .collect();
        let mut m = Self {
            rules: Vec::with_capacity(found.len()),
            limits: Vec::new(),
            clients: Vec::new(),
            tunings: Vec::new(),
        };
        for (d, rule) in call.descriptors.iter().zip(found) {
            let limit = rule.as_ref().and_then(|r| {
                let name = r.meta.as_ref().map_or("", |m| m.name.as_str());
                let kept = name.is_empty() || !replaced.iter().any(|r| r == name);
                r.limit.as_ref().filter(|_| kept)
            });
            let index = limit.map(|limit| {
                let hits = d.hits_addend.unwrap_or(u64::from(call.hits_addend));
                let cost = u32::try_from(hits.max(1)).unwrap_or(u32::MAX);
                let entries = d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
                m.clients
                    .push(Some(ClientId::of_entries(&call.domain, entries)));
                m.tunings.push((cost != limit.cost).then(|| Tuning {
                    rate: limit.rate.clone(),
                    quota: None,
                    fresh: None,
                    cost: Some(cost),
                }));
                m.limits.push(limit.clone());
                m.limits.len() - 1
            });
            m.rules.push(rule.map(|r| (r, index)));
        }
        m
    }
}
