//! A request's slot on one target of a capped upstream, given back when dropped.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Gate;

/// A request's slot on one target, held until its response body ends (or it fails).
#[derive(Debug)]
pub struct Slot {
    pub(super) gate: Arc<Gate>,
    pub target: usize,
    pub(super) generation: u64,
    pub(super) sent: Instant,
    pub(super) took: Option<Duration>,
    /// How long the request waited for it.
    pub waited: Duration,
}

impl Slot {
    /// The target's response head came: the latency an adaptive cap learns from.
    pub fn answered(&mut self) {
        self.took = Some(self.sent.elapsed());
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.release(self.target, self.generation, self.took);
    }
}
