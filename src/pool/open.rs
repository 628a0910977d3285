//! A capped upstream's connections counted against its cap, from connect until closed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The connections open to each target of a capped upstream, idle ones included, and a wake
/// for the requests waiting for one to come back or close.
#[derive(Debug)]
pub(super) struct Open {
    pub(super) per_target: Vec<AtomicUsize>,
    pub(super) changed: tokio::sync::Notify,
}

/// One connection counted in `Open`, until dropped: by the connection's task when it ends,
/// or at once when the connect failed.
#[derive(Debug)]
pub(super) struct Counted {
    open: Arc<Open>,
    target: usize,
}

impl Open {
    /// Count one more connection to `target`, if fewer than `cap` are open.
    pub(super) fn take(self: &Arc<Self>, target: usize, cap: usize) -> Option<Counted> {
        let n = self.per_target.get(target)?;
        n.fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
            (open < cap).then_some(open + 1)
        })
        .ok()?;
        Some(Counted {
            open: Arc::clone(self),
            target,
        })
    }

    pub(super) fn count(&self, target: usize) -> usize {
        self.per_target
            .get(target)
            .map_or(0, |n| n.load(Ordering::Acquire))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.open.per_target[self.target].fetch_sub(1, Ordering::AcqRel);
        self.open.changed.notify_waiters();
    }
}
