//! The health of an upstream's targets: passive ejection after consecutive failures of real
//! requests (with its doubling arithmetic), and the verdict of the active check.
//!
//! Every worker reads this on every pick and writes it only when something changes: a
//! failure, an ejection, a success after failures, a check's verdict. A pick is a few plain
//! atomic loads; a success with no failure before it writes nothing.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use http::StatusCode;
use prometheus_client::metrics::counter::Counter;
use tokio::time::Instant;

use crate::config::settings::HealthSpec;

/// The health of every target of one upstream.
#[derive(Debug)]
pub struct Health {
    /// Time zero of the millisecond clock the ejections are kept on.
    origin: Instant,
    max_fails: u32,
    fail_timeout_ms: u64,
    max_ejection_ms: u64,
    /// Ascending, for a binary search (usually empty: no search at all).
    failure_statuses: Box<[StatusCode]>,
    targets: Box<[Target]>,
}

/// One target's state, on a cache line of its own: a failure on one target does not make
/// every worker fetch the line of the others.
#[derive(Debug)]
#[repr(align(64))]
struct Target {
    /// Failures in a row since the last success or ejection.
    fails: AtomicU32,
    /// Ejections in a row: the next one lasts `fail_timeout * 2^ejections`.
    ejections: AtomicU32,
    /// Ejected until then (ms on the clock); 0: never ejected.
    until_ms: AtomicU64,
    /// Failing its active health check.
    down: AtomicBool,
    /// `tollgate_upstream_ejections_total` of this target.
    ejected_total: Counter,
}

/// How long the `n`th ejection in a row lasts: `fail_timeout * 2^(n-1)`, at most `max`.
pub fn ejection_ms(fail_timeout_ms: u64, max_ms: u64, n: u32) -> u64 {
    let factor = 1u64.checked_shl(n.saturating_sub(1)).unwrap_or(u64::MAX);
    fail_timeout_ms.saturating_mul(factor).min(max_ms)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Health {
    /// Every target healthy; `ejected_total`: each target's ejection counter, in order.
    pub fn new(spec: &HealthSpec, ejected_total: Vec<Counter>, origin: Instant) -> Self {
        let targets = ejected_total
            .into_iter()
            .map(|ejected_total| Target {
                fails: AtomicU32::new(0),
                ejections: AtomicU32::new(0),
                until_ms: AtomicU64::new(0),
                down: AtomicBool::new(false),
                ejected_total,
            })
            .collect();
        Self {
            origin,
            max_fails: spec.max_fails,
            fail_timeout_ms: ms(spec.fail_timeout),
            max_ejection_ms: ms(spec.max_ejection),
            failure_statuses: spec.failure_statuses.clone().into_boxed_slice(),
            targets,
        }
    }

    /// `at` on the millisecond clock ejections are kept on.
    pub fn ms(&self, at: Instant) -> u64 {
        ms(at.saturating_duration_since(self.origin))
    }

    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// When `target` takes traffic again: 0 (now: healthy), the end of its ejection, or
    /// `u64::MAX` while it fails its active check (it comes back only by passing it).
    pub fn available_at(&self, target: usize, now_ms: u64) -> u64 {
        let t = &self.targets[target];
        if t.down.load(Ordering::Relaxed) {
            return u64::MAX;
        }
        let until = t.until_ms.load(Ordering::Relaxed);
        if now_ms < until {
            until
        } else {
            0
        }
    }

    pub fn is_healthy(&self, target: usize, now_ms: u64) -> bool {
        self.available_at(target, now_ms) == 0
    }

    /// An upstream status that counts as a failure of the target.
    pub fn is_failure(&self, status: StatusCode) -> bool {
        !self.failure_statuses.is_empty() && self.failure_statuses.binary_search(&status).is_ok()
    }

    /// `target` answered.
    pub fn succeeded(&self, target: usize) {
        let fails = &self.targets[target].fails;
        // Read first: every answered request lands here, from every worker, and a store to a
        // line all workers read would bounce it between the cores on each request.
        if fails.load(Ordering::Relaxed) != 0 {
            fails.store(0, Ordering::Relaxed);
        }
    }

    /// `target` failed at `now_ms`; the length of the ejection this failure started, if it
    /// started one.
    ///
    /// The `max_fails`th failure in a row ejects the target, unless it is ejected already:
    /// requests that were in flight, or that went to it because every target was out, do not
    /// stretch an ejection. The `n`th ejection in a row lasts `ejection_ms(n)`; a target that
    /// went `max_ejection` without one since its last ended starts again at `n = 1`.
    pub fn failed(&self, target: usize, now_ms: u64) -> Option<u64> {
        if self.max_fails == 0 {
            return None;
        }
        let t = &self.targets[target];
        let fails = t.fails.fetch_add(1, Ordering::AcqRel).saturating_add(1);
        if fails < self.max_fails {
            return None;
        }
        let until = t.until_ms.load(Ordering::Acquire);
        if now_ms < until {
            return None;
        }
        let quiet = until != 0 && now_ms >= until.saturating_add(self.max_ejection_ms);
        let n = if quiet {
            1
        } else {
            t.ejections.load(Ordering::Acquire).saturating_add(1)
        };
        let length = ejection_ms(self.fail_timeout_ms, self.max_ejection_ms, n);
        // One of the workers failing at once ejects; the others see it ejected.
        let ejected = t
            .until_ms
            .compare_exchange(
                until,
                now_ms.saturating_add(length).max(1),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        if !ejected {
            return None;
        }
        t.ejections.store(n, Ordering::Release);
        t.fails.store(0, Ordering::Release);
        t.ejected_total.inc();
        Some(length)
    }

    /// The active check's verdict on `target`.
    pub fn set_down(&self, target: usize, down: bool) {
        self.targets[target].down.store(down, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(max_fails: u32, targets: usize) -> Health {
        let spec = HealthSpec {
            max_fails,
            fail_timeout: Duration::from_secs(10),
            max_ejection: Duration::from_mins(1),
            failure_statuses: vec![StatusCode::BAD_GATEWAY, StatusCode::SERVICE_UNAVAILABLE],
            check: None,
        };
        let counters = (0..targets).map(|_| Counter::default()).collect();
        Health::new(&spec, counters, Instant::now())
    }

    #[test]
    fn ejection_lengths_double_up_to_the_cap() {
        let lengths: Vec<u64> = (1..=5).map(|n| ejection_ms(10, 60, n)).collect();
        assert_eq!(lengths, [10, 20, 40, 60, 60]);
        assert_eq!(ejection_ms(10, 60, 0), 10, "n = 0 reads as the first");
        assert_eq!(ejection_ms(u64::MAX / 2, u64::MAX, 40), u64::MAX);
        assert_eq!(ejection_ms(1, u64::MAX, 200), u64::MAX, "no overflow");
    }

    #[test]
    fn max_fails_in_a_row_eject_and_a_success_resets_the_count() {
        let h = health(3, 2);
        assert_eq!(h.failed(0, 1_000), None);
        assert_eq!(h.failed(0, 1_000), None);
        h.succeeded(0);
        assert_eq!(h.failed(0, 1_000), None);
        assert_eq!(h.failed(0, 1_000), None);
        assert!(h.is_healthy(0, 1_000));
        assert_eq!(h.failed(0, 1_000), Some(10_000));
        assert!(!h.is_healthy(0, 1_000));
        assert_eq!(h.available_at(0, 5_000), 11_000);
        assert!(h.is_healthy(0, 11_000), "back when the ejection ends");
        assert!(h.is_healthy(1, 1_000), "the other target is not touched");
        assert_eq!(h.targets[0].ejected_total.get(), 1);
    }

    #[test]
    fn repeat_ejections_double_and_a_quiet_target_starts_over() {
        let h = health(1, 2);
        let mut now = 0;
        let mut lengths = Vec::new();
        for _ in 0..5 {
            lengths.push(h.failed(0, now).expect("ejected"));
            now = h.available_at(0, now);
        }
        assert_eq!(lengths, [10_000, 20_000, 40_000, 60_000, 60_000]);
        // Back, and not ejected for a whole max_ejection: the next ejection is short again.
        assert_eq!(h.failed(0, now + 60_000), Some(10_000));
    }

    #[test]
    fn failures_while_ejected_do_not_stretch_the_ejection() {
        let h = health(2, 2);
        h.failed(0, 0);
        assert_eq!(h.failed(0, 0), Some(10_000));
        for at in [1, 2, 3, 9_999] {
            assert_eq!(h.failed(0, at), None);
        }
        assert_eq!(h.available_at(0, 5_000), 10_000);
        // Its failures while out count: still failing once back, it goes out again at once,
        // for twice as long.
        assert_eq!(h.failed(0, 10_000), Some(20_000));
    }

    #[test]
    fn max_fails_zero_never_ejects() {
        let h = health(0, 2);
        for at in 0..100 {
            assert_eq!(h.failed(0, at), None);
        }
        assert!(h.is_healthy(0, 100));
    }

    #[test]
    fn a_failed_check_outweighs_any_ejection() {
        let h = health(1, 2);
        h.set_down(1, true);
        assert_eq!(h.available_at(1, 0), u64::MAX);
        h.failed(0, 0);
        assert!(h.available_at(0, 0) < h.available_at(1, 0));
        h.set_down(1, false);
        assert!(h.is_healthy(1, 0));
    }

    #[test]
    fn failure_statuses_are_looked_up() {
        let h = health(1, 1);
        assert!(h.is_failure(StatusCode::SERVICE_UNAVAILABLE));
        assert!(!h.is_failure(StatusCode::GATEWAY_TIMEOUT));
        assert!(!h.is_failure(StatusCode::OK));
    }
}
