//! The Redis limiter's counters since start, for `/metrics`.

use std::sync::atomic::{AtomicU64, Ordering};

use super::RedisLimiter;

/// Counters since start, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedisStats {
    /// Calls to `check`.
    pub checks: u64,
    /// Script calls sent to Redis (checks and cluster refunds).
    pub redis_calls: u64,
    /// Checks answered `Unavailable`, whatever the reason.
    pub errors: u64,
    /// ... of which because the deadline passed.
    pub timeouts: u64,
    /// ... of which because the breaker was open (Redis was not asked).
    pub breaker_rejections: u64,
    /// Checks answered from the negative cache (Redis was not asked).
    pub negative_hits: u64,
    /// Connections replaced because they went out of step or stalled (see `link`).
    pub reconnects: u64,
    /// Connections that followed a Sentinel failover to another master (each worker's
    /// connection counts its own).
    pub failovers: u64,
    /// Cluster refunds sent (a slot rejected what another slot's check charged).
    pub refunds: u64,
    /// Refunds that did not make it: those tokens come back only by refill.
    pub refund_failures: u64,
    /// Buckets the negative cache holds now (a gauge).
    pub negative_cache_entries: u64,
    /// Checks admitted from a lease this replica holds (Redis was not asked for them).
    pub leased: u64,
    /// Leased tokens handed back to Redis unused (their hold ended, or the lease was revoked).
    pub lease_tokens_returned: u64,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) checks: AtomicU64,
    pub(super) redis_calls: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) timeouts: AtomicU64,
    pub(super) breaker_rejections: AtomicU64,
    pub(super) negative_hits: AtomicU64,
    pub(super) refunds: AtomicU64,
    pub(super) refund_failures: AtomicU64,
    pub(super) leased: AtomicU64,
    pub(super) lease_tokens_returned: AtomicU64,
}

pub(super) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl RedisLimiter {
    /// Connections replaced since start, all workers' and the shared one's.
    pub(super) fn reconnects(&self) -> u64 {
        let workers = self.per_worker.iter().filter_map(|w| w.get());
        self.shared.replaced() + workers.map(|w| w.link.replaced()).sum::<u64>()
    }

    /// The counters now (the negative cache's size read now).
    pub fn stats(&self) -> RedisStats {
        let c = &*self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RedisStats {
            checks: get(&c.checks),
            redis_calls: get(&c.redis_calls),
            errors: get(&c.errors),
            timeouts: get(&c.timeouts),
            breaker_rejections: get(&c.breaker_rejections),
            negative_hits: get(&c.negative_hits),
            reconnects: self.reconnects(),
            failovers: self.shared.failovers()
                + self
                    .per_worker
                    .iter()
                    .filter_map(|w| w.get())
                    .map(|w| w.link.failovers())
                    .sum::<u64>(),
            refunds: get(&c.refunds),
            refund_failures: get(&c.refund_failures),
            negative_cache_entries: self.negative.len() as u64,
            leased: get(&c.leased),
            lease_tokens_returned: get(&c.lease_tokens_returned),
        }
    }

    /// Count a check admitted from a lease.
    pub fn count_leased(&self) {
        bump(&self.counters.leased);
    }
}
