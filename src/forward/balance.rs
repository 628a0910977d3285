//! Which target a request goes to: round robin or least request (power of two choices) over
//! the healthy targets not yet tried, and never "none": with every target out, the one that
//! comes back first.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use smallvec::SmallVec;

use super::health::Health;
use crate::config::settings::LoadBalancing;
use crate::pool::{InFlight, Loads};

/// One upstream's target choice.
#[derive(Debug)]
pub struct Balancer {
    next: AtomicUsize,
    /// Requests in flight per target: kept for `least_request` only (every request writes
    /// them, from every worker).
    loads: Option<Arc<Loads>>,
}

impl Balancer {
    pub fn new(policy: LoadBalancing, targets: usize) -> Self {
        Self {
            next: AtomicUsize::new(0),
            loads: (policy == LoadBalancing::LeastRequest && targets > 1)
                .then(|| Loads::new(targets)),
        }
    }

    /// Count a request in flight to `target` (least request only).
    pub fn enter(&self, target: usize) -> Option<InFlight> {
        self.loads.as_ref().map(|l| l.enter(target))
    }

    /// Requests in flight to `target`, when they are counted.
    pub fn in_flight(&self, target: usize) -> Option<usize> {
        self.loads.as_ref().map(|l| l.get(target))
    }

    /// The target for the next attempt, given the ones `tried` (in order; the last one has
    /// just failed). Of the healthy targets not tried, by the policy; else, "then any": a
    /// healthy one tried before, then the one whose ejection ends first.
    pub fn pick(&self, health: &Health, now_ms: u64, tried: &[usize]) -> usize {
        let n = health.len();
        let fresh = |t: usize| !tried.contains(&t) && health.is_healthy(t, now_ms);
        let start = match &self.loads {
            None => {
                let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
                if let Some(t) = (0..n).map(|i| (start + i) % n).find(|&t| fresh(t)) {
                    return t;
                }
                start
            }
            Some(loads) => {
                let candidates: SmallVec<[usize; 8]> = (0..n).filter(|&t| fresh(t)).collect();
                match candidates.len() {
                    0 => {}
                    1 => return candidates[0],
                    len => {
                        let a = random_below(len);
                        let mut b = random_below(len - 1);
                        if b >= a {
                            b += 1;
                        }
                        let (a, b) = (candidates[a], candidates[b]);
                        return if loads.get(b) < loads.get(a) { b } else { a };
                    }
                }
                random_below(n)
            }
        };
        fallback(health, now_ms, tried, start)
    }
}

/// No healthy target is left untried: the best of the rest, ties going to the first from
/// `start` (so round robin still rotates among them).
fn fallback(health: &Health, now_ms: u64, tried: &[usize], start: usize) -> usize {
    let n = health.len();
    let last = tried.last().copied();
    let rank = |t: usize| {
        let at = health.available_at(t, now_ms);
        if Some(t) == last {
            (2, at)
        } else if at == 0 {
            (0, 0)
        } else {
            (1, at)
        }
    };
    (0..n)
        .map(|i| (start + i) % n)
        .min_by_key(|&t| rank(t))
        .unwrap_or(0)
}

/// A number below `n` (> 0) from this thread's xorshift generator: random enough to spread
/// two choices, and no lock or shared write.
fn random_below(n: usize) -> usize {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(seed());
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        // The high bits are the better ones.
        ((u128::from(x) * n as u128) >> 64) as usize
    })
}

/// A seed that differs per thread and per process (std's hasher keys are random), never 0.
fn seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(0);
    h.finish() | 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::settings::HealthSpec;
    use prometheus_client::metrics::counter::Counter;
    use std::time::Duration;

    fn health(targets: usize) -> Health {
        let spec = HealthSpec {
            max_fails: 1,
            fail_timeout: Duration::from_secs(10),
            max_ejection: Duration::from_mins(1),
            failure_statuses: Vec::new(),
            check: None,
        };
        let counters = (0..targets).map(|_| Counter::default()).collect();
        Health::new(&spec, counters, tokio::time::Instant::now())
    }

    #[test]
    fn round_robin_skips_ejected_targets() {
        let (h, b) = (health(3), Balancer::new(LoadBalancing::RoundRobin, 3));
        h.failed(1, 0);
        let picks: Vec<usize> = (0..6).map(|_| b.pick(&h, 0, &[])).collect();
        assert_eq!(picks, [0, 2, 2, 0, 2, 2]);
    }

    #[test]
    fn a_retry_goes_to_a_target_not_tried() {
        let (h, b) = (health(3), Balancer::new(LoadBalancing::RoundRobin, 3));
        for _ in 0..3 {
            let second = b.pick(&h, 0, &[0]);
            assert_ne!(second, 0);
            let third = b.pick(&h, 0, &[0, second]);
            assert_eq!(third, 3 - second, "the one left");
            let fourth = b.pick(&h, 0, &[0, second, third]);
            assert_ne!(fourth, third, "then any but the one that just failed");
        }
    }

    #[test]
    fn with_every_target_out_the_first_back_is_picked() {
        let (h, b) = (health(3), Balancer::new(LoadBalancing::RoundRobin, 3));
        h.failed(0, 0);
        h.failed(1, 5_000);
        h.failed(2, 2_000);
        for _ in 0..3 {
            assert_eq!(
                b.pick(&h, 6_000, &[]),
                0,
                "ejected until 10 s, before the others"
            );
        }
        h.set_down(0, true);
        assert_eq!(
            b.pick(&h, 6_000, &[]),
            2,
            "a failed check outweighs an ejection"
        );
        assert!(h.is_healthy(2, 13_000));
        assert_eq!(b.pick(&h, 13_000, &[]), 2, "back first, and healthy");
    }

    #[test]
    fn least_request_takes_the_less_loaded_of_two() {
        let (h, b) = (health(2), Balancer::new(LoadBalancing::LeastRequest, 2));
        let busy: Vec<InFlight> = (0..5).map(|_| b.enter(0).expect("counted")).collect();
        assert_eq!(b.in_flight(0), Some(5));
        for _ in 0..20 {
            assert_eq!(b.pick(&h, 0, &[]), 1);
        }
        drop(busy);
        assert_eq!(b.in_flight(0), Some(0));
        let picks: Vec<usize> = (0..200).map(|_| b.pick(&h, 0, &[])).collect();
        assert!(picks.contains(&0) && picks.contains(&1), "ties spread");
    }

    #[test]
    fn round_robin_counts_nothing_in_flight() {
        let b = Balancer::new(LoadBalancing::RoundRobin, 2);
        assert!(b.enter(0).is_none());
        assert!(Balancer::new(LoadBalancing::LeastRequest, 1)
            .enter(0)
            .is_none());
    }

    #[test]
    fn random_numbers_stay_below_the_bound() {
        for n in 1..50 {
            assert!((0..100).all(|_| random_below(n) < n));
        }
    }
}
