//! The metrics of upstream targets: retries and ejections (counted as they happen, through
//! handles each upstream gets when it is built), and each target's health and load (read off
//! the live upstreams at scrape time).

use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::UpstreamLabels;
use crate::config::settings::UpstreamSpec;
use crate::sharded;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    pub upstream: String,
    pub target: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    pub upstream: String,
    pub reason: RetryReason,
}

/// Why a request went to another target.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum RetryReason {
    /// None of it had reached the target.
    unreached,
    /// It had, and was idempotent on a route with `retry_idempotent`.
    idempotent,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AttemptLabels {
    pub upstream: String,
    pub target: String,
    pub result: AttemptResult,
}

/// How one attempt on one target ended.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum AttemptResult {
    /// A response head came back, and its status is not one of `failure_statuses`.
    response,
    /// A response head with one of the upstream's `failure_statuses`.
    failure_status,
    /// No connection within `connect_timeout`, or no response head within `timeout`.
    timeout,
    /// Refused, reset or broken connection, or a malformed response.
    unreachable,
}

const RESULTS: [AttemptResult; 4] = [
    AttemptResult::response,
    AttemptResult::failure_status,
    AttemptResult::timeout,
    AttemptResult::unreachable,
];

/// One upstream's metric handles, fetched from the families once per upstream built.
#[derive(Debug)]
pub struct UpstreamHandles {
    pub seconds: sharded::Histogram,
    /// By reason, in `RetryReason` order.
    pub retries: [Counter; 2],
    /// By target, in order.
    pub ejections: Vec<Counter>,
    /// By target, in order, then by result (`AttemptResult` order).
    pub attempts: Vec<[sharded::Counter; 4]>,
    /// The queue's wait and refusals.
    pub capacity: crate::capacity::Handles,
}

/// The families of the targets' metrics.
#[derive(Debug)]
pub(super) struct Targets {
    retries: Family<RetryLabels, Counter>,
    ejections: Family<TargetLabels, Counter>,
    attempts: Family<AttemptLabels, sharded::Counter>,
    healthy: Family<TargetLabels, Gauge>,
    in_flight: Family<TargetLabels, Gauge>,
    /// A capped target's cap (fixed, or learned now).
    cap: Family<TargetLabels, Gauge>,
    queued: Family<UpstreamLabels, Gauge>,
    queue_wait: Family<UpstreamLabels, Histogram, fn() -> Histogram>,
    refused: Family<RefusedLabels, Counter>,
}

impl Default for Targets {
    fn default() -> Self {
        Self {
            retries: Family::default(),
            ejections: Family::default(),
            attempts: Family::default(),
            healthy: Family::default(),
            in_flight: Family::default(),
            cap: Family::default(),
            queued: Family::default(),
            queue_wait: Family::new_with_constructor(|| {
                Histogram::new(QUEUE_WAIT_BUCKETS.iter().copied())
            }),
            refused: Family::default(),
        }
    }
}

/// Seconds waited in a capped upstream's queue: from a free slot (0) up to long timeouts.
const QUEUE_WAIT_BUCKETS: [f64; 12] = [
    0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    pub upstream: String,
    pub reason: String,
}

impl Targets {
    pub(super) fn register(&self, r: &mut Registry) {
        r.register(
            "upstream_retries",
            "Requests sent to another target after one failed, by reason",
            self.retries.clone(),
        );
        r.register(
            "upstream_ejections",
            "Times a target was taken out of rotation after failing requests in a row",
            self.ejections.clone(),
        );
        r.register(
            "upstream_target_attempts",
            "Attempts sent to a target (retries included), by how they ended",
            self.attempts.clone(),
        );
        r.register(
            "upstream_target_healthy",
            "1 while a target takes traffic (not ejected, passing its health check), else 0",
            self.healthy.clone(),
        );
        r.register(
            "upstream_target_requests_in_flight",
            "Requests in flight to a target of a least_request or capped upstream",
            self.in_flight.clone(),
        );
        r.register(
            "upstream_target_max_in_flight",
            "A capped target's max_in_flight now (fixed, or learned from latency)",
            self.cap.clone(),
        );
        r.register(
            "upstream_queue_depth",
            "Requests waiting for a slot of a capped upstream",
            self.queued.clone(),
        );
        r.register(
            "upstream_queue_wait_seconds",
            "Time requests to a capped upstream waited for a slot (0: one was free)",
            self.queue_wait.clone(),
        );
        r.register(
            "upstream_capacity_rejections",
            "Requests answered 503 because a capped upstream's queue was full or the wait too long",
            self.refused.clone(),
        );
    }

    /// The handles of upstream `spec`, timing its responses in `seconds`. A rebuilt upstream
    /// of the same name gets the same counters: they go on counting across reloads.
    pub(super) fn handles(
        &self,
        spec: &UpstreamSpec,
        seconds: sharded::Histogram,
    ) -> UpstreamHandles {
        let upstream = spec.name.to_string();
        let retries = [RetryReason::unreached, RetryReason::idempotent].map(|reason| {
            self.retries
                .get_or_create(&RetryLabels {
                    upstream: upstream.clone(),
                    reason,
                })
                .clone()
        });
        let ejections = spec
            .targets
            .iter()
            .map(|t| {
                self.ejections
                    .get_or_create(&TargetLabels {
                        upstream: upstream.clone(),
                        target: t.to_string(),
                    })
                    .clone()
            })
            .collect();
        let attempts = spec
            .targets
            .iter()
            .map(|t| {
                RESULTS.map(|result| {
                    self.attempts
                        .get_or_create(&AttemptLabels {
                            upstream: upstream.clone(),
                            target: t.to_string(),
                            result,
                        })
                        .clone()
                })
            })
            .collect();
        let capacity = crate::capacity::Handles {
            wait: self
                .queue_wait
                .get_or_create(&UpstreamLabels {
                    upstream: upstream.clone(),
                })
                .clone(),
            refused: crate::capacity::Refused::ALL.map(|why| {
                self.refused
                    .get_or_create(&RefusedLabels {
                        upstream: upstream.clone(),
                        reason: why.as_str().to_owned(),
                    })
                    .clone()
            }),
        };
        UpstreamHandles {
            seconds,
            retries,
            ejections,
            attempts,
            capacity,
        }
    }

    /// Each live target's health (and load, for `least_request`), read now: an ejection ends
    /// by time alone, with nothing to set a gauge when it does. Targets of upstreams no longer
    /// live leave the families.
    pub(super) fn read(&self, targets: &[TargetSample], queues: &[(Arc<str>, usize)]) {
        self.healthy.clear();
        self.in_flight.clear();
        self.cap.clear();
        self.queued.clear();
        for (upstream, depth) in queues {
            let labels = UpstreamLabels {
                upstream: upstream.to_string(),
            };
            self.queued
                .get_or_create(&labels)
                .set(i64::try_from(*depth).unwrap_or(i64::MAX));
        }
        for t in targets {
            let labels = TargetLabels {
                upstream: t.upstream.to_string(),
                target: t.target.clone(),
            };
            self.healthy
                .get_or_create(&labels)
                .set(i64::from(t.healthy));
            if let Some(n) = t.in_flight {
                let n = i64::try_from(n).unwrap_or(i64::MAX);
                self.in_flight.get_or_create(&labels).set(n);
            }
            if let Some(n) = t.cap {
                let n = i64::try_from(n).unwrap_or(i64::MAX);
                self.cap.get_or_create(&labels).set(n);
            }
        }
    }
}

/// One upstream target's state at a scrape, as the caller read it off the live upstreams.
#[derive(Debug, Clone)]
pub struct TargetSample {
    pub upstream: Arc<str>,
    pub target: String,
    pub healthy: bool,
    /// Requests in flight to it (counted for `least_request` and capped upstreams only).
    pub in_flight: Option<usize>,
    /// Its cap, on a capped upstream.
    pub cap: Option<usize>,
}
