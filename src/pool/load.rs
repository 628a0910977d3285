//! Requests in flight per target, all workers together: what `least_request` compares. A
//! request counts from its attempt until its response body ends (or it fails).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One upstream's counts, by target. Each has a cache line of its own: every worker writes
/// them, and a write to one target's count must not take the others' line away.
#[derive(Debug)]
pub struct Loads(Box<[Load]>);

#[derive(Debug, Default)]
#[repr(align(64))]
struct Load(AtomicUsize);

impl Loads {
    pub fn new(targets: usize) -> Arc<Self> {
        Arc::new(Self((0..targets).map(|_| Load::default()).collect()))
    }

    /// Requests in flight to `target` now.
    pub fn get(&self, target: usize) -> usize {
        self.0
            .get(target)
            .map_or(0, |l| l.0.load(Ordering::Relaxed))
    }

    /// Count one more request to `target` until the guard is dropped.
    pub fn enter(self: &Arc<Self>, target: usize) -> InFlight {
        if let Some(l) = self.0.get(target) {
            l.0.fetch_add(1, Ordering::Relaxed);
        }
        InFlight {
            loads: self.clone(),
            target,
        }
    }
}

/// One request counted in its target's `Loads` while it lives.
#[derive(Debug)]
pub struct InFlight {
    loads: Arc<Loads>,
    target: usize,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(l) = self.loads.0.get(self.target) {
            l.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
