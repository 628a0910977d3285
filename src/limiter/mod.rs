//! Limit checks: the per-request `Decision` over the route's limits, and where each concept
//! lives: the token-bucket arithmetic (`gcra`), the limiter's time (`clock`), calendar quotas
//! and windows (`window`), escalating bans (`ban`), concurrency slots (`concurrency`), token
//! leasing from Redis (`leasing`), the in-process store (`local`) and Redis (`redis`) behind
//! one `store::Store`, the failure policy and all-or-nothing (`decide`), a read-only look
//! at one identity (`peek`), limits counted or charged by the response (`decide::counted`,
//! `decide::settled`), and Envoy rate limit service domains as limits (`descriptors`).

pub mod ban;
pub mod clock;
pub mod concurrency;
pub(crate) mod decide;
pub mod descriptors;
pub mod gcra;
pub mod leasing;
pub mod local;
pub mod peek;
pub mod redis;
pub mod store;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;
pub mod window;

pub use clock::{Clock, Moment};
pub use decide::slots::acquire as take_slots;
pub use decide::{count_known, decide, decide_checks, decide_in_process, decide_known, Tuning};
pub(crate) use gcra::CLAMP_SLACK_US;
pub use gcra::{clamped, step, Verdict};

use std::sync::Arc;

use crate::config::settings::{LimitSpec, LimiterSettings};
use crate::identity::{ClientId, KeySpec};
pub(crate) use crate::Small;

pub use crate::config::settings::{
    BanSpec, ConcurrencySpec, Counting, FailurePolicy, Period, QuotaSpec, Rate,
};

/// A limit of a route, live: its settings and its in-process buckets.
#[derive(Debug)]
pub struct Limit {
    pub(crate) name: Arc<str>,
    pub(crate) rate: Rate,
    pub(crate) cost: u32,
    pub(crate) shadow: bool,
    pub(crate) key: KeySpec,
    pub(crate) exempt: Vec<crate::identity::Exemption>,
    pub(crate) on_failure: FailurePolicy,
    /// In-process buckets of this limit (the store for `backend: local`, the fallback for Redis).
    pub(crate) local: Arc<local::Buckets>,
    /// The stricter per-replica rate the `local` failure policy enforces without Redis.
    pub(crate) fallback: Rate,
    /// A calendar quota instead of a token bucket (see `window`).
    pub(crate) quota: Option<QuotaSpec>,
    /// `ban:` in microseconds, as both stores take it.
    pub(crate) ban: Option<ban::BanArgs>,
    /// The in-process bans (the store for `backend: local`; Redis keeps its own).
    pub(crate) bans: Option<Arc<ban::Bans>>,
    /// `concurrency: N`: a cap on requests in flight, not a token bucket (see `concurrency`).
    pub(crate) concurrency: Option<ConcurrencySpec>,
    /// The in-process counts and Redis leases of a concurrency limit.
    pub(crate) slots: Option<Arc<concurrency::Slots>>,
    /// The tokens this replica holds of busy identities' Redis buckets (`leasing:`).
    pub(crate) leases: Option<Arc<leasing::Leases>>,
    /// `count_when:`: checked at admission, counted once a response of these statuses comes
    /// (see `decide::counted`).
    pub(crate) count_when: Option<crate::config::settings::StatusSet>,
    /// `cost: { reserve, from_response }`: the header a response settles the cost with (see
    /// `decide::settled`).
    pub(crate) settle: Option<http::HeaderName>,
}

impl Limit {
    /// The live limit of `spec`, keeping `old`'s buckets, bans and slots where their spec is
    /// the same (`old`: the limit of that name in the config being replaced).
    pub fn build(spec: &LimitSpec, old: Option<&Limit>, limiter: &LimiterSettings) -> Arc<Self> {
        let (max_buckets, per_peer) = (limiter.max_buckets, limiter.max_buckets_per_peer);
        // The exhaustion policy's per-address cap, where one address can mint identities (see
        // `local`).
        let capped = (!spec.key.one_per_address()).then_some(per_peer);
        let local = match old {
            Some(old)
                if old.rate == spec.rate
                    && old.local.quota() == spec.quota.as_ref()
                    && old.local.is_owing() == spec.settle.is_some()
                    && old.local.has_caps(max_buckets, capped) =>
            {
                old.local.clone()
            }
            _ => Arc::new(
                match capped {
                    Some(n) => local::Buckets::capped_per_peer(max_buckets, n),
                    None => local::Buckets::new(max_buckets),
                }
                .with_quota(spec.quota.clone())
                .owing(spec.settle.is_some()),
            ),
        };
        Arc::new(
            Self::new(spec, local)
                .with_bans(spec, old, max_buckets)
                .with_slots(old)
                .with_leases(old),
        )
    }

    /// The live limit of `spec`, counting in `local`.
    pub fn new(spec: &LimitSpec, local: Arc<local::Buckets>) -> Self {
        Self {
            name: spec.name.clone(),
            rate: spec.rate.clone(),
            cost: spec.cost,
            shadow: spec.shadow,
            key: spec.key.clone(),
            exempt: spec.exempt.clone(),
            on_failure: spec.on_failure,
            local,
            fallback: spec.fallback.clone(),
            quota: spec.quota.clone(),
            ban: spec.ban.as_ref().map(ban::BanArgs::of),
            bans: None,
            concurrency: spec.concurrency,
            slots: spec.concurrency.map(|_| concurrency::Slots::new()),
            leases: spec.leasing.map(|l| Arc::new(leasing::Leases::new(l))),
            count_when: spec.count_when,
            settle: spec.settle.clone(),
        }
    }

    /// With its in-process bans: `previous`'s when they have the same numbers (a reload keeps
    /// who is banned), else new ones for at most `max_identities`.
    #[must_use]
    pub fn with_bans(mut self, spec: &LimitSpec, previous: Option<&Limit>, max: usize) -> Self {
        self.bans = spec.ban.as_ref().map(|b| {
            let args = ban::BanArgs::of(b);
            previous
                .and_then(|p| p.bans.clone())
                .filter(|p| p.args() == args)
                .unwrap_or_else(|| Arc::new(ban::Bans::new(b, max)))
        });
        self
    }

    /// With `previous`'s slots when it is the same concurrency limit: a reload keeps counting
    /// the requests in flight.
    #[must_use]
    pub fn with_slots(mut self, previous: Option<&Limit>) -> Self {
        if let Some(p) = previous.filter(|p| p.concurrency == self.concurrency) {
            if p.slots.is_some() {
                self.slots.clone_from(&p.slots);
            }
        }
        self
    }
}

impl Limit {
    /// With `previous`'s leases when it leases the same bucket the same way: a reload keeps
    /// the tokens this replica holds. Otherwise they are dropped with the old limit (at most
    /// one lease's tokens per identity, which the bucket then misses once).
    #[must_use]
    pub fn with_leases(mut self, previous: Option<&Limit>) -> Self {
        if let Some(p) = previous.filter(|p| p.rate == self.rate && p.cost == self.cost) {
            if let (Some(old), Some(_)) = (&p.leases, &self.leases) {
                if Some(old.spec()) == self.leases.as_ref().map(|l| l.spec()) {
                    self.leases = Some(old.clone());
                }
            }
        }
        self
    }

    /// This limit's in-process buckets (the store for `backend: local`, the fallback for Redis).
    pub fn in_process(&self) -> &local::Buckets {
        &self.local
    }
}

/// One bucket to check for one request: a limit and the identity it is counted under.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    pub limit: &'a Limit,
    pub client: ClientId,
}

/// How one limit came out for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    /// Counted and within the limit.
    Admitted,
    /// Over the limit: the request is rejected.
    Limited,
    /// Over a `shadow: true` limit: reported, not enforced.
    ShadowLimited,
    /// The client is on the limit's `exempt` list: not counted.
    Exempt,
    /// The shared store failed and the `open` policy admitted without counting.
    FailedOpen,
    /// The shared store failed and the `closed` policy rejected.
    FailedClosed,
}

impl Outcome {
    /// The outcome's name in traces.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admitted => "admitted",
            Self::Limited => "limited",
            Self::ShadowLimited => "shadow_limited",
            Self::Exempt => "exempt",
            Self::FailedOpen => "failed_open",
            Self::FailedClosed => "failed_closed",
        }
    }
}

/// One limit's line in a decision.
#[derive(Debug, Clone, Copy)]
pub struct LimitResult {
    /// Index of the limit in the route's `limits`.
    pub index: usize,
    pub outcome: Outcome,
    /// The bucket's numbers, when a bucket was consulted.
    pub verdict: Option<Verdict>,
    /// Decided in process because the shared store was unavailable.
    pub fallback: bool,
    /// The limit is a dry run (`shadow: true`): reported in logs and metrics, never to clients.
    pub shadow: bool,
    /// The identity the request was counted under (`None` when exempt).
    pub client: Option<ClientId>,
    /// What this limit's ban did to the request.
    pub ban: ban::BanEvent,
}

/// The whole answer for one request, carrying the numbers headers, logs and metrics use.
#[derive(Debug, Clone, Default)]
pub struct Decision {
    /// Inline for routes of up to two limits (most): no allocation per request.
    pub results: smallvec::SmallVec<[LimitResult; 2]>,
}

impl Decision {
    /// Decided without the shared store (it was unavailable): open, closed or local fallback.
    pub fn without_backend(&self) -> bool {
        self.results.iter().any(|r| r.fallback)
    }

    /// The request may go on: no limit rejected it.
    pub fn admitted(&self) -> bool {
        !self
            .results
            .iter()
            .any(|r| matches!(r.outcome, Outcome::Limited | Outcome::FailedClosed))
    }

    /// How the access log words the decision: its outcome, the first 64 bits of the digest
    /// the closest limit counted the request under (never the raw identity), and the index of
    /// the limit that refused it.
    pub fn logged(&self) -> (&'static str, Option<u64>, Option<usize>) {
        let closest = self
            .rejected_by()
            .or_else(|| self.reported().map(|(r, _)| r));
        let client = closest.and_then(|r| r.client).map(|id| (id.0 >> 64) as u64);
        let (outcome, limit) = match self.rejected_by() {
            Some(r) if r.outcome == Outcome::FailedClosed => ("store-unavailable", Some(r.index)),
            Some(r) if r.fallback => ("limited-without-store", Some(r.index)),
            Some(r) => ("limited", Some(r.index)),
            None if self.without_backend() => ("admitted-without-store", None),
            None => ("admitted", None),
        };
        (outcome, client, limit)
    }

    /// Each limit of `limits` (the decided route's, or call's) and how it came out, for the
    /// request's trace.
    pub fn notes(&self, limits: &[Arc<Limit>]) -> Vec<crate::telemetry::LimitNote> {
        (self.results.iter())
            .filter_map(|r| {
                Some(crate::telemetry::LimitNote {
                    name: limits.get(r.index)?.name.clone(),
                    outcome: r.outcome.as_str(),
                    without_store: r.fallback,
                    remaining: r.verdict.map(|v| v.remaining),
                    ban: r.ban.as_str(),
                })
            })
            .collect()
    }

    /// The limit that rejected the request, if any (the first one in route order).
    pub fn rejected_by(&self) -> Option<&LimitResult> {
        self.results
            .iter()
            .find(|r| matches!(r.outcome, Outcome::Limited | Outcome::FailedClosed))
    }

    /// The limit whose numbers go into the response headers: the one that rejected the request,
    /// else the enforced limit with the fewest tokens left (first one on a tie). Shadow limits
    /// are never shown to clients: a dry run must not change what they see.
    pub fn reported(&self) -> Option<(&LimitResult, Verdict)> {
        if let Some(r) = self.rejected_by() {
            return r.verdict.map(|v| (r, v));
        }
        let mut best: Option<(&LimitResult, Verdict)> = None;
        for r in &self.results {
            if r.outcome != Outcome::Admitted || r.shadow {
                continue;
            }
            if let Some(v) = r.verdict {
                if best.is_none_or(|(_, b)| v.remaining < b.remaining) {
                    best = Some((r, v));
                }
            }
        }
        best
    }
}
