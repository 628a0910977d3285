//! What a capacity gate is built from and reports: its spec, the refusals, the metric
//! handles it counts into, and its state for metrics, the dashboard and `explain`.

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

use super::AdaptiveSpec;

/// `upstreams.NAME.max_in_flight` and `queue`, as compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub cap: Cap,
    /// Requests that may wait at once (0: refused as soon as every target is at its cap).
    pub queue_size: usize,
    /// The longest a request waits for a slot.
    pub timeout: Duration,
}

/// Requests in flight to one target at most.
#[derive(Debug, Clone, PartialEq)]
pub enum Cap {
    Fixed(usize),
    Adaptive(AdaptiveSpec),
}

/// Why a request got no slot: it is answered `503` and nothing reaches the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The queue was full when it came.
    QueueFull,
    /// It waited `timeout` in the queue.
    QueueTimeout,
    /// The proxy is shutting down and the drain would end before its turn came.
    ShuttingDown,
}

impl Refused {
    pub const ALL: [Refused; 3] = [
        Refused::QueueFull,
        Refused::QueueTimeout,
        Refused::ShuttingDown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refused::QueueFull => "queue_full",
            Refused::QueueTimeout => "queue_timeout",
            Refused::ShuttingDown => "shutting_down",
        }
    }
}

/// The metric handles a gate counts into.
#[derive(Debug, Clone)]
pub struct Handles {
    /// Seconds each admitted request waited (0 for one that found a free slot).
    pub wait: Histogram,
    /// By reason, in `Refused::ALL` order.
    pub refused: [Counter; 3],
}

/// The answer to a request that got no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub why: Refused,
    /// Seconds until a slot is likely free.
    pub retry_after: u64,
    /// How long the request waited in the queue before it was refused.
    pub waited: std::time::Duration,
}

/// A gate's state, for metrics, the dashboard and `explain`.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// By target: (in flight, cap).
    pub targets: Vec<(usize, usize)>,
    pub queued: usize,
    /// Queued by class, in `Priority::ALL` order.
    pub queued_by_class: [usize; 3],
    pub identities_queued: usize,
    pub queue_size: usize,
    pub timeout: Duration,
    /// The adaptive caps' measured no-load latency, by target.
    pub min_rtt: Vec<Option<Duration>>,
}

impl Stats {
    pub fn in_flight(&self) -> usize {
        self.targets.iter().map(|t| t.0).sum()
    }

    pub fn cap(&self) -> usize {
        self.targets.iter().map(|t| t.1).sum()
    }
}
