//! A gate that lets one log line through per period and counts the ones it held back, so a
//! failure that repeats on every request (Redis away, a dead upstream) cannot flood the log.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Lets one log line through per `every_us`, and counts what it held back. Lock-free: every
/// worker may ask at once, and exactly one of them wins each period.
#[derive(Debug)]
pub struct LogGate {
    every_us: u64,
    next_us: AtomicU64,
    held_back: AtomicU64,
}

impl LogGate {
    pub fn new(every: Duration) -> Self {
        Self {
            every_us: u64::try_from(every.as_micros()).unwrap_or(u64::MAX),
            next_us: AtomicU64::new(0),
            held_back: AtomicU64::new(0),
        }
    }

    /// `Some(lines held back since the last one)` when a line may be logged at `now_us` (any
    /// clock that only goes forward, in microseconds).
    pub fn open(&self, now_us: u64) -> Option<u64> {
        let next = self.next_us.load(Ordering::Acquire);
        if now_us >= next
            && self
                .next_us
                .compare_exchange(
                    next,
                    now_us.saturating_add(self.every_us),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
        {
            return Some(self.held_back.swap(0, Ordering::AcqRel));
        }
        self.held_back.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lets_one_line_a_second() {
        let g = LogGate::new(Duration::from_secs(1));
        assert_eq!(g.open(0), Some(0));
        assert_eq!(g.open(10), None);
        assert_eq!(g.open(999_999), None);
        assert_eq!(g.open(1_000_000), Some(2));
    }
}
