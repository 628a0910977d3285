//! Limit checks: the token-bucket arithmetic, the per-request `Decision`, and the backends.
//!
//! Both backends run the same arithmetic, written as GCRA on a single number per bucket: the
//! *theoretical arrival time* (`tat`, microseconds as `f64`), the instant at which the bucket
//! would be full again. With `tok` = microseconds per token and `tau` = `burst * tok`:
//!
//! ```text
//! tat     = min(tat, now + tau)            (only after a clock step back: see `step`)
//! base    = max(tat, now)                  (a bucket never holds more than `burst`)
//! new_tat = base + cost * tok
//! admit   = new_tat - now <= tau           (enough tokens for `cost`)
//! tokens left after the request = (tau - (tat' - now)) / tok
//! ```
//!
//! This is exactly a token bucket with continuous refill (rate = 1/tok, capacity = burst), but
//! its state is one number, so Redis stores one string per bucket and can expire the key at
//! `tat`, the moment the bucket is full again and forgetting it grants nothing.

pub mod ban;
pub mod clock;
pub mod concurrency;
pub(crate) mod decide;
pub mod leasing;
pub mod local;
pub mod peek;
pub mod redis;
pub mod store;
pub mod window;

pub use clock::{Clock, Moment};
pub use decide::{decide, decide_in_process, decide_known, decide_tuned, Tuning};

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
    pub name: Arc<str>,
    pub rate: Rate,
    pub cost: u32,
    pub shadow: bool,
    pub key: KeySpec,
    pub exempt: Vec<crate::identity::Exemption>,
    pub on_failure: FailurePolicy,
    /// In-process buckets of this limit (the store for `backend: local`, the fallback for Redis).
    pub local: Arc<local::Buckets>,
    /// The stricter per-replica rate the `local` failure policy enforces without Redis.
    pub fallback: Rate,
    /// A calendar quota instead of a token bucket (see `window`).
    pub quota: Option<QuotaSpec>,
    /// `ban:` in microseconds, as both stores take it.
    pub ban: Option<ban::BanArgs>,
    /// The in-process bans (the store for `backend: local`; Redis keeps its own).
    pub bans: Option<Arc<ban::Bans>>,
    /// `concurrency: N`: a cap on requests in flight, not a token bucket (see `concurrency`).
    pub concurrency: Option<ConcurrencySpec>,
    /// The in-process counts and Redis leases of a concurrency limit.
    pub slots: Option<Arc<concurrency::Slots>>,
    /// The tokens this replica holds of busy identities' Redis buckets (`leasing:`).
    pub leases: Option<Arc<leasing::Leases>>,
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
                    && old.local.has_caps(max_buckets, capped) =>
            {
                old.local.clone()
            }
            _ => Arc::new(
                match capped {
                    Some(n) => local::Buckets::capped_per_peer(max_buckets, n),
                    None => local::Buckets::new(max_buckets),
                }
                .with_quota(spec.quota.clone()),
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
}

/// One bucket to check for one request: a limit and the identity it is counted under.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    pub limit: &'a Limit,
    pub client: ClientId,
}

/// What one bucket says about one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    /// The bucket holds at least `cost` tokens.
    pub admitted: bool,
    /// Whole tokens left once this request is counted (if it is admitted and everything else
    /// admits it too), or left now if it is not.
    pub remaining: u64,
    /// Microseconds until the bucket is full again.
    pub reset_us: f64,
    /// Microseconds until `cost` tokens are available; 0 when admitted.
    pub retry_after_us: f64,
}

/// How far (µs) past `now + tau` a `tat` must be before `step` takes it for a clock step: the
/// float slack of a `tat` the arithmetic itself wrote (`bucket.lua` uses the same number).
pub(crate) const CLAMP_SLACK_US: f64 = 1.0;

/// Apply the GCRA step to one bucket. Returns the verdict and the new `tat` to store when the
/// request is admitted (the caller commits it only if every limit admits).
///
/// A `tat` more than `tau` ahead of `now` is clamped to `now + tau`, an empty bucket: no
/// admission ever leaves one there, so it means the clock that `now` is read from stepped back
/// (Redis's wall clock; this process's clock is monotonic), and taken as is it would withhold
/// tokens for as long as the step. Clamped, a rejection waits at most `cost` tokens' time, and
/// the bucket is full again within `tau`. Forward steps need nothing: `max(tat, now)` is a full
/// bucket, `burst` tokens and no more.
/// A `tat` further ahead than `rate` ever writes (an operator's override raised the limit of
/// a client the old rate had emptied, or the clock stepped back) is clamped to a bucket with
/// one token left: the raised limit admits the next request at once, rather than refusing it
/// for the one token's time with a `Retry-After: 1`. `bucket.lua` clamps alike.
pub fn clamped(now: f64, rate: &Rate) -> f64 {
    now + (rate.window_us() - rate.token_us()).max(0.0)
}

pub fn step(tat: Option<f64>, now: f64, rate: &Rate, cost: u32) -> (Verdict, f64) {
    let tok = rate.token_us();
    let tau = rate.window_us();
    let base = tat.map_or(now, |t| {
        if t - now > tau + CLAMP_SLACK_US {
            clamped(now, rate)
        } else {
            t.max(now)
        }
    });
    let new_tat = base + f64::from(cost) * tok;
    if new_tat - now <= tau + 1e-6 {
        let remaining = whole_tokens(tau - (new_tat - now), tok);
        let verdict = Verdict {
            admitted: true,
            remaining,
            reset_us: new_tat - now,
            retry_after_us: 0.0,
        };
        (verdict, new_tat)
    } else {
        let verdict = Verdict {
            admitted: false,
            remaining: whole_tokens(tau - (base - now), tok),
            reset_us: base - now,
            retry_after_us: new_tat - now - tau,
        };
        (verdict, base)
    }
}

/// `floor(us / tok)`, tolerant of the float error of a value that is a whole number of tokens.
fn whole_tokens(us: f64, tok: f64) -> u64 {
    let n = (us / tok + 1e-9).floor();
    if n > 0.0 {
        n as u64
    } else {
        0
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(per_sec: f64, burst: u32) -> Rate {
        Rate { per_sec, burst }
    }

    #[test]
    fn burst_then_reject_then_refill() {
        let r = rate(1.0, 3);
        let mut tat = None;
        for left in [2, 1, 0] {
            let (v, t) = step(tat, 0.0, &r, 1);
            assert!(v.admitted);
            assert_eq!(v.remaining, left);
            tat = Some(t);
        }
        let (v, _) = step(tat, 0.0, &r, 1);
        assert!(!v.admitted);
        assert!((v.retry_after_us - 1e6).abs() < 1e-3);
        assert!((v.reset_us - 3e6).abs() < 1e-3);
        // Half a second later still nothing; one second later exactly one token.
        assert!(!step(tat, 0.5e6, &r, 1).0.admitted);
        let (v, _) = step(tat, 1e6, &r, 1);
        assert!(v.admitted);
        assert_eq!(v.remaining, 0);
    }

    #[test]
    fn a_long_idle_bucket_holds_no_more_than_burst() {
        let r = rate(10.0, 5);
        let (_, t) = step(None, 0.0, &r, 1);
        let (v, _) = step(Some(t), 3_600e6, &r, 1);
        assert_eq!(v.remaining, 4);
    }

    #[test]
    fn cost_takes_several_tokens() {
        let r = rate(1.0, 10);
        let (v, t) = step(None, 0.0, &r, 4);
        assert_eq!(v.remaining, 6);
        let (v, t) = step(Some(t), 0.0, &r, 4);
        assert_eq!(v.remaining, 2);
        let (v, _) = step(Some(t), 0.0, &r, 4);
        assert!(!v.admitted);
        assert_eq!(v.remaining, 2);
        assert!((v.retry_after_us - 2e6).abs() < 1e-3);
    }

    #[test]
    fn a_tat_left_ahead_by_a_clock_step_back_withholds_one_period_at_most() {
        // 1/s, burst 3: tau = 3 s. A bucket emptied on a clock an hour ahead, read on the
        // corrected clock: its `tat` is 3603 s ahead of `now`.
        let r = rate(1.0, 3);
        let now = 10e6;
        // Clamped to one token left: that one is taken, the bucket empty.
        let (v, kept) = step(Some(now + 3_603e6), now, &r, 1);
        assert!(v.admitted, "{v:?}");
        assert!((v.reset_us - 3e6).abs() < 1e-3, "full within tau: {v:?}");
        assert!((kept - (now + 3e6)).abs() < 1e-3);
        // From there, refill runs as usual: a token a second later.
        assert!(!step(Some(kept), now, &r, 1).0.admitted);
        assert!(step(Some(kept), now + 1e6, &r, 1).0.admitted);
        // Cost never waits longer than the period either: cost 3 of burst 3 waits 2 s.
        let (v, _) = step(Some(now + 3_603e6), now, &r, 3);
        assert!((v.retry_after_us - 2e6).abs() < 1e-3, "{v:?}");
        // A `tat` the arithmetic wrote itself (at most tau ahead) is not touched.
        let (v, t) = step(Some(now + 2e6), now, &r, 1);
        assert!(v.admitted && (t - (now + 3e6)).abs() < 1e-3);
    }

    #[test]
    fn a_clock_step_forward_mints_one_bucket() {
        let r = rate(1.0, 3);
        let (_, mut tat) = step(None, 0.0, &r, 3);
        // An hour later on a clock that jumped: exactly `burst` admissions, then a rejection.
        let now = 3_600e6;
        for left in [2, 1, 0] {
            let (v, t) = step(Some(tat), now, &r, 1);
            assert!(v.admitted);
            assert_eq!(v.remaining, left);
            tat = t;
        }
        assert!(!step(Some(tat), now, &r, 1).0.admitted);
    }

    #[test]
    fn fractional_rates() {
        // 5/min: one token every 12 s.
        let r = rate(5.0 / 60.0, 5);
        let mut tat = None;
        for _ in 0..5 {
            let (v, t) = step(tat, 0.0, &r, 1);
            assert!(v.admitted);
            tat = Some(t);
        }
        let (v, _) = step(tat, 0.0, &r, 1);
        assert!((v.retry_after_us - 12e6).abs() < 1.0);
    }
}
