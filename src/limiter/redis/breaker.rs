//! The circuit breaker in front of Redis.
//!
//! When Redis is down or stalled, every check would otherwise wait out its whole timeout
//! before the failure policy applies, adding `timeout` to every request. After `threshold`
//! consecutive failures the breaker opens: checks fail in microseconds without touching the
//! network, and once per `cooldown` one probe is let through to see whether Redis is back.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Closed, open or half-open, kept in atomics so a check never takes a lock to ask.
#[derive(Debug)]
pub(super) struct Breaker {
    threshold: u32,
    cooldown_us: u64,
    /// Consecutive failures; `>= threshold` means open (or half-open once the cooldown is over).
    failures: AtomicU32,
    /// When the breaker may let the next probe through, on the limiter's clock (µs).
    retry_at_us: AtomicU64,
}

impl Breaker {
    pub(super) fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            cooldown_us: u64::try_from(cooldown.as_micros()).unwrap_or(u64::MAX),
            failures: AtomicU32::new(0),
            retry_at_us: AtomicU64::new(0),
        }
    }

    /// Whether a call to Redis may go out at `now_us`.
    pub(super) fn allow(&self, now_us: u64) -> bool {
        if self.failures.load(Ordering::Acquire) < self.threshold {
            return true;
        }
        let retry_at = self.retry_at_us.load(Ordering::Acquire);
        if now_us < retry_at {
            return false;
        }
        // Cooldown over: exactly one caller wins the probe, and winning re-arms the cooldown.
        // (Not a "probe in flight" flag: a probe whose request is dropped, its client gone,
        // would never report back and would keep the breaker open for good.)
        self.retry_at_us
            .compare_exchange(
                retry_at,
                now_us.saturating_add(self.cooldown_us),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// Open and still cooling down at `now_us`: `allow` would say no. Unlike `allow`, asking
    /// never takes the probe of a breaker whose cooldown is over.
    pub(super) fn cooling(&self, now_us: u64) -> bool {
        self.failures.load(Ordering::Acquire) >= self.threshold
            && now_us < self.retry_at_us.load(Ordering::Acquire)
    }

    pub(super) fn success(&self) {
        // Read first: every answered check lands here, from every worker, and a store to a
        // line all workers read would bounce it between the cores on each request.
        if self.failures.load(Ordering::Acquire) != 0 {
            self.failures.store(0, Ordering::Release);
        }
    }

    pub(super) fn failure(&self, now_us: u64) {
        let failures = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if failures >= self.threshold {
            // Also re-arms the cooldown after a failed probe.
            self.retry_at_us
                .store(now_us.saturating_add(self.cooldown_us), Ordering::Release);
        }
        // Saturate instead of wrapping back to "closed" after four billion failures.
        if failures == u32::MAX {
            self.failures.store(self.threshold, Ordering::Release);
        }
    }

    /// Open or half-open: checks are failing fast.
    pub(super) fn is_open(&self) -> bool {
        self.failures.load(Ordering::Acquire) >= self.threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_then_lets_one_probe_through_per_cooldown() {
        let b = Breaker::new(3, Duration::from_secs(1));
        for now in [0, 1, 2] {
            assert!(b.allow(now));
            b.failure(now);
        }
        assert!(b.is_open());
        assert!(!b.allow(500_000));
        assert!(b.allow(1_000_002), "cooldown over: one probe");
        assert!(!b.allow(1_000_003), "only one probe at a time");
        assert!(
            b.allow(2_000_002),
            "a probe that never reports back is not waited for"
        );
        b.failure(1_000_010);
        assert!(b.cooling(1_500_000));
        assert!(!b.allow(1_500_000), "a failed probe re-arms the cooldown");
        assert!(!b.cooling(2_000_010), "asking does not take the probe");
        assert!(b.allow(2_000_010));
        b.success();
        assert!(!b.is_open());
        assert!(b.allow(2_000_011));
    }

    #[test]
    fn a_success_resets_the_count() {
        let b = Breaker::new(3, Duration::from_secs(1));
        b.failure(0);
        b.failure(0);
        b.success();
        b.failure(0);
        b.failure(0);
        assert!(!b.is_open());
    }
}
