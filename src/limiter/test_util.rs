//! Limits built for tests and benchmarks that drive the limiter directly, without a config
//! (`cfg(test)`, or the `test-util` feature the integration tests and benchmarks turn on).

use std::sync::Arc;

use super::local::Buckets;
use super::{FailurePolicy, Limit, QuotaSpec, Rate};
use crate::identity::KeySpec;

/// A token bucket of `burst` at `per_sec`, taking `cost` a request, keyed by `key`, failing
/// open, with 1,000 in-process buckets at most.
pub fn limit(name: &str, (per_sec, burst): (f64, u32), cost: u32, key: KeySpec) -> Limit {
    Limit {
        name: name.into(),
        rate: Rate { per_sec, burst },
        cost,
        shadow: false,
        key,
        exempt: Vec::new(),
        on_failure: FailurePolicy::Open,
        local: Arc::new(Buckets::new(1000)),
        fallback: Rate {
            per_sec: 1.0,
            burst: 1,
        },
        quota: None,
        ban: None,
        bans: None,
        concurrency: None,
        slots: None,
        leases: None,
        count_when: None,
        settle: None,
    }
}

impl Limit {
    /// The same limit counting a calendar quota or window (`quota`) instead of its bucket.
    #[must_use]
    pub fn with_quota(mut self, quota: QuotaSpec) -> Self {
        self.local = Arc::new(Buckets::new(1000).with_quota(Some(quota.clone())));
        self.quota = Some(quota);
        self
    }

    /// The same limit with its in-process fallback (the `local` failure policy's rate).
    #[must_use]
    pub fn with_fallback(mut self, fallback: Rate) -> Self {
        self.fallback = fallback;
        self
    }
}

/// One request of `client` against `lim`'s in-process bucket at `now_us` on the limiter's
/// clock, as the in-process store checks it (for tests comparing the stores).
pub fn check_in_process(lim: &Limit, client: u128, now_us: f64) -> super::Verdict {
    let item = super::local::Item {
        buckets: &lim.local,
        client: crate::identity::ClientId(client),
        peer: super::local::Peer::default(),
        rate: &lim.rate,
        cost: lim.cost,
        window: None,
    };
    super::local::check(&[item], &[true], now_us)[0]
}
