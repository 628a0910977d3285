//! Prometheus metrics: what the request path counts, and what is read off the state at scrape.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::registry::Registry;
use std::sync::Arc;

use crate::config::settings::UpstreamSpec;
use crate::limiter::redis::RedisLimiter;
use crate::limiter::{Limit, Outcome};
use crate::sharded;
use upstream::Targets;
pub use upstream::{RetryReason, TargetSample, UpstreamHandles};

mod upstream;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: String,
    pub class: StatusClass,
}

/// The status class label: `2xx`, `4xx`, ...
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub struct StatusClass(pub &'static str);

impl prometheus_client::encoding::EncodeLabelValue for StatusClass {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }
}

impl StatusClass {
    pub fn of(status: http::StatusCode) -> Self {
        Self(CLASSES[Self::index(status)])
    }

    /// 0 for 1xx .. 4 for 5xx.
    pub fn index(status: http::StatusCode) -> usize {
        (usize::from(status.as_u16() / 100)).clamp(1, 5) - 1
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub route: String,
    pub limit: String,
    pub outcome: OutcomeLabel,
}

#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum OutcomeLabel {
    admitted,
    limited,
    shadow_limited,
    exempt,
    /// Decided without the shared store (open, closed or local fallback).
    without_backend,
}

impl OutcomeLabel {
    pub fn of(outcome: Outcome, fallback: bool) -> Self {
        if fallback {
            return Self::without_backend;
        }
        match outcome {
            Outcome::Admitted => Self::admitted,
            Outcome::Limited => Self::limited,
            Outcome::ShadowLimited => Self::shadow_limited,
            Outcome::Exempt => Self::exempt,
            Outcome::FailedOpen | Outcome::FailedClosed => Self::without_backend,
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabels {
    pub upstream: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamErrorLabels {
    pub upstream: String,
    pub kind: UpstreamErrorKind,
}

#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum UpstreamErrorKind {
    unreachable,
    timeout,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    pub result: ReloadResult,
}

#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ReloadResult {
    ok,
    failed,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    pub worker: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabels {
    pub limit: String,
}

/// One route's counters, fetched from the families once per route and snapshot, so the
/// request path does no label hashing or allocation to count.
#[derive(Debug)]
pub struct RouteCounters {
    /// By status class: 1xx .. 5xx.
    pub requests: [sharded::Counter; 5],
    /// By limit (route order), then by outcome (`OutcomeLabel` order).
    pub decisions: Vec<[sharded::Counter; 5]>,
}

const OUTCOMES: [OutcomeLabel; 5] = [
    OutcomeLabel::admitted,
    OutcomeLabel::limited,
    OutcomeLabel::shadow_limited,
    OutcomeLabel::exempt,
    OutcomeLabel::without_backend,
];
const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

impl OutcomeLabel {
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Every metric tollgate exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    // Written by every request: per thread (see `sharded`).
    pub requests: Family<RequestLabels, sharded::Counter>,
    pub decisions: Family<DecisionLabels, sharded::Counter>,
    pub backend_seconds: sharded::Histogram,
    pub upstream_seconds: Family<UpstreamLabels, sharded::Histogram>,
    pub upstream_errors: Family<UpstreamErrorLabels, Counter>,
    /// Retries, ejections and the targets' health.
    targets: Targets,
    pub open_connections: Gauge,
    /// Open downstream connections by the worker thread serving them.
    pub worker_connections: Family<WorkerLabels, Gauge>,
    pub connections_refused: Counter,
    pub overloaded: Counter,
    /// Requests whose limits were decided without the shared store.
    pub without_backend: Counter,
    reloads: Family<ReloadLabels, Counter>,
    generation: Gauge,
    // Read off the live runtime at scrape time.
    buckets: Family<LimitLabels, Gauge>,
    overflowed: Family<LimitLabels, Counter>,
    peer_overflowed: Family<LimitLabels, Counter>,
    redis_errors: Counter,
    redis_timeouts: Counter,
    redis_calls: Counter,
    negative_hits: Counter,
    redis_reconnects: Counter,
    breaker_open: Gauge,
}

fn latency_histogram() -> sharded::Histogram {
    // 50 µs .. ~26 s
    sharded::Histogram::new(exponential_buckets(0.000_05, 2.0, 20))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("tollgate"),
            requests: Family::default(),
            decisions: Family::default(),
            backend_seconds: latency_histogram(),
            upstream_seconds: Family::new_with_constructor(latency_histogram),
            upstream_errors: Family::default(),
            targets: Targets::default(),
            open_connections: Gauge::default(),
            worker_connections: Family::default(),
            connections_refused: Counter::default(),
            overloaded: Counter::default(),
            reloads: Family::default(),
            generation: Gauge::default(),
            buckets: Family::default(),
            overflowed: Family::default(),
            peer_overflowed: Family::default(),
            without_backend: Counter::default(),
            redis_errors: Counter::default(),
            redis_timeouts: Counter::default(),
            redis_calls: Counter::default(),
            negative_hits: Counter::default(),
            redis_reconnects: Counter::default(),
            breaker_open: Gauge::default(),
        };
        m.register();
        m.targets.register(&mut m.registry);
        // Both series exist from the start, at 0, and generation 1 is the config started with.
        for result in [ReloadResult::ok, ReloadResult::failed] {
            let _ = m.reloads.get_or_create(&ReloadLabels { result });
        }
        m.generation.set(1);
        m
    }

    fn register(&mut self) {
        let r = &mut self.registry;
        r.register(
            "requests",
            "Requests by route and status class",
            self.requests.clone(),
        );
        r.register(
            "limit_decisions",
            "Limit decisions by route, limit and outcome",
            self.decisions.clone(),
        );
        r.register(
            "limiter_backend_seconds",
            "Latency of shared-store (Redis) checks",
            self.backend_seconds.clone(),
        );
        r.register(
            "upstream_seconds",
            "Time to the upstream's response head",
            self.upstream_seconds.clone(),
        );
        r.register(
            "upstream_errors",
            "Upstream failures by kind",
            self.upstream_errors.clone(),
        );
        r.register(
            "open_connections",
            "Open downstream connections",
            self.open_connections.clone(),
        );
        r.register(
            "worker_connections",
            "Open downstream connections by the worker thread serving them",
            self.worker_connections.clone(),
        );
        r.register(
            "connections_refused",
            "Connections closed at once because a listener was at max_connections",
            self.connections_refused.clone(),
        );
        r.register(
            "overloaded",
            "Requests answered 503 because max_inflight requests were in flight",
            self.overloaded.clone(),
        );
        r.register(
            "access_log_dropped_lines",
            "Access-log lines dropped because the writer could not keep up",
            crate::access_log::dropped_lines(),
        );
        r.register(
            "config_reloads",
            "Config reloads by result",
            self.reloads.clone(),
        );
        r.register(
            "config_generation",
            "Generation of the live config (1 = as started)",
            self.generation.clone(),
        );
        r.register(
            "local_buckets",
            "In-process buckets held, by limit",
            self.buckets.clone(),
        );
        r.register(
            "local_bucket_overflows",
            "Checks counted in a limit's overflow bucket because its map was full",
            self.overflowed.clone(),
        );
        r.register(
            "local_bucket_peer_overflows",
            "New identities counted in their address's overflow bucket (at its cap, or the map full)",
            self.peer_overflowed.clone(),
        );
        r.register(
            "decided_without_backend",
            "Requests whose limits were decided without the shared store",
            self.without_backend.clone(),
        );
        self.register_redis();
    }

    /// The Redis client's series.
    fn register_redis(&mut self) {
        let r = &mut self.registry;
        r.register(
            "redis_errors",
            "Redis checks that failed (errors, timeouts, breaker open)",
            self.redis_errors.clone(),
        );
        r.register(
            "redis_timeouts",
            "Redis checks that hit the timeout",
            self.redis_timeouts.clone(),
        );
        r.register(
            "redis_calls",
            "Script calls sent to Redis",
            self.redis_calls.clone(),
        );
        r.register(
            "redis_negative_cache_hits",
            "Rejections answered from the negative cache without Redis",
            self.negative_hits.clone(),
        );
        r.register(
            "redis_reconnects",
            "Redis connections replaced because their calls kept timing out or went out of step",
            self.redis_reconnects.clone(),
        );
        r.register(
            "redis_breaker_open",
            "1 while the Redis circuit breaker is open",
            self.breaker_open.clone(),
        );
    }

    /// The counters of one route (`route` is its name, `limits` its limit names in order).
    pub fn route_counters<'a>(
        &self,
        route: &str,
        limits: impl Iterator<Item = &'a str>,
    ) -> RouteCounters {
        let requests = CLASSES.map(|class| {
            self.requests
                .get_or_create(&RequestLabels {
                    route: route.to_owned(),
                    class: StatusClass(class),
                })
                .clone()
        });
        let decisions = limits
            .map(|limit| {
                OUTCOMES.map(|outcome| {
                    self.decisions
                        .get_or_create(&DecisionLabels {
                            route: route.to_owned(),
                            limit: limit.to_owned(),
                            outcome,
                        })
                        .clone()
                })
            })
            .collect();
        RouteCounters {
            requests,
            decisions,
        }
    }

    /// The handles of upstream `spec`: its response-time histogram, retry and ejection
    /// counters.
    pub fn upstream(&self, spec: &UpstreamSpec) -> UpstreamHandles {
        let labels = UpstreamLabels {
            upstream: spec.name.to_string(),
        };
        self.targets
            .handles(spec, self.upstream_seconds.get_or_create(&labels).clone())
    }

    /// Count a reload attempt; a successful one made `generation` live.
    pub fn reloaded(&self, result: ReloadResult, generation: u64) {
        self.reloads.get_or_create(&ReloadLabels { result }).inc();
        self.generation
            .set(i64::try_from(generation).unwrap_or(i64::MAX));
    }

    /// The Prometheus text exposition, with the values kept elsewhere (the live limits'
    /// buckets, the Redis client's counters, the upstreams' target health) read now.
    pub fn render<'a>(
        &self,
        limits: impl Iterator<Item = &'a Arc<Limit>>,
        redis: Option<&RedisLimiter>,
        targets: &[TargetSample],
    ) -> String {
        self.targets.read(targets);
        self.buckets.clear();
        self.overflowed.clear();
        self.peer_overflowed.clear();
        for limit in limits {
            let labels = LimitLabels {
                limit: limit.name.to_string(),
            };
            self.buckets
                .get_or_create(&labels)
                .set(limit.local.len() as i64);
            set_counter(
                &self.overflowed.get_or_create(&labels),
                limit.local.overflowed(),
            );
            set_counter(
                &self.peer_overflowed.get_or_create(&labels),
                limit.local.peer_overflowed(),
            );
        }
        if let Some(redis) = redis {
            let s = redis.stats();
            set_counter(&self.redis_errors, s.errors);
            set_counter(&self.redis_timeouts, s.timeouts);
            set_counter(&self.redis_calls, s.redis_calls);
            set_counter(&self.negative_hits, s.negative_hits);
            set_counter(&self.redis_reconnects, s.reconnects);
            self.breaker_open.set(i64::from(redis.breaker_open()));
        }
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            return String::new();
        }
        out
    }
}

/// Counters only go up; bring one up to a total kept elsewhere.
fn set_counter(c: &Counter, total: u64) {
    let now = c.get();
    if total > now {
        c.inc_by(total - now);
    }
}
