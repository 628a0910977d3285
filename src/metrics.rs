//! Prometheus metrics: what the request path counts, and what is read off the state at scrape.
//!
//! Every name but the standard `process_*` ones has the prefix `tollgate_`. `/metrics` answers
//! in the format the scraper asks for (`Format`).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::config::settings::UpstreamSpec;
use crate::limiter::redis::RedisLimiter;
use crate::limiter::Limit;
use crate::sharded;
pub use candidate::{CandidateCounters, CandidateLabels, CandidateOutcome};
pub use format::Format;
pub use route::{DecisionLabels, OutcomeLabel, RequestLabels, RouteCounters, RouteLabels};
use upstream::Targets;
pub use upstream::{AttemptResult, RetryReason, TargetSample, UpstreamHandles};

mod candidate;
mod format;
pub mod history;
mod process;
mod register;
mod route;
pub mod top;
mod upstream;

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

/// A limit of a route (the labels of the ban counters).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLimitLabels {
    pub route: String,
    pub limit: String,
}

/// One descriptor of a rate limit service call: its domain, its rule (the descriptor path the
/// rule matches, or with `detailed_metric` the call's own values) and what came of it
/// (`within_limit`, `near_limit`, `over_limit`, `shadow_mode`, as envoyproxy/ratelimit counts).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RlsLabels {
    pub domain: String,
    pub rule: String,
    pub result: &'static str,
}

/// A gRPC call's route and status (`grpc_code` named as grpc-prometheus names it).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    pub route: String,
    pub grpc_code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertLabels {
    /// The listener's configured address.
    pub listener: String,
    /// The certificate file.
    pub cert: String,
}

/// A listener certificate's expiry, as the caller read it off the live config.
#[derive(Debug, Clone)]
pub struct CertSample {
    pub listener: String,
    pub cert: String,
    /// `notAfter` of the leaf, in seconds since the Unix epoch.
    pub not_after: i64,
}

/// What `render` reads off the live runtime.
#[derive(Debug)]
pub struct Scrape<'a, L> {
    pub limits: L,
    pub redis: Option<&'a RedisLimiter>,
    pub targets: &'a [TargetSample],
    /// Each capped upstream's queue depth.
    pub queues: &'a [(Arc<str>, usize)],
    pub certs: &'a [CertSample],
}

/// Every metric tollgate exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    // Written by every request: per thread (see `sharded`).
    pub requests: Family<RequestLabels, sharded::Counter>,
    pub decisions: Family<DecisionLabels, sharded::Counter>,
    /// Bans begun, requests refused by a ban, bans lifted (seen lifted by a request).
    pub bans: Family<RouteLimitLabels, Counter>,
    pub banned_requests: Family<RouteLimitLabels, Counter>,
    pub ban_lifts: Family<RouteLimitLabels, Counter>,
    durations: Family<RouteLabels, sharded::Histogram>,
    pub backend_seconds: sharded::Histogram,
    /// Checks that went to Redis: sent until answered or failed (see `RedisLimiter`).
    pub redis_check_seconds: sharded::Histogram,
    pub upstream_seconds: Family<UpstreamLabels, sharded::Histogram>,
    pub upstream_errors: Family<UpstreamErrorLabels, Counter>,
    /// Retries, ejections and the targets' health.
    targets: Targets,
    pub open_connections: Gauge,
    /// Open downstream connections by the worker thread serving them.
    pub worker_connections: Family<WorkerLabels, Gauge>,
    pub connections_refused: Counter,
    pub overloaded: Counter,
    /// Requests answered 503 and connections refused because resident memory was past
    /// `max_rss`.
    pub memory_refused_requests: Counter,
    pub memory_refused_connections: Counter,
    /// 1 while resident memory is past `max_rss`.
    pub memory_over: Gauge,
    /// Redis's `evicted_keys`, as last read (every 5 s).
    pub redis_evicted_keys: Gauge,
    /// Bytes in temporary files, and responses that could not spill.
    pub spill: crate::buffer::SpillHandles,
    /// Requests whose limits were decided without the shared store.
    pub without_backend: Counter,
    reloads: Family<ReloadLabels, Counter>,
    generation: Gauge,
    config_hash: Gauge,
    config_ok: Gauge,
    config_loaded_at: Gauge<f64, AtomicU64>,
    certificates: Family<CertLabels, Gauge>,
    // Read off the live runtime at scrape time.
    buckets: Family<LimitLabels, Gauge>,
    overflowed: Family<LimitLabels, Counter>,
    peer_overflowed: Family<LimitLabels, Counter>,
    redis_errors: Counter,
    redis_timeouts: Counter,
    redis_calls: Counter,
    negative_hits: Counter,
    leased_checks: Counter,
    lease_tokens_returned: Counter,
    redis_reconnects: Counter,
    redis_failovers: Counter,
    breaker_open: Gauge,
    /// Requests refused by an operator's ban (`control`), by route.
    pub admin_banned_requests: Family<RouteLabels, Counter>,
    /// gRPC calls by route and status, counted when the status is known.
    pub grpc_calls: Family<GrpcLabels, Counter>,
    pub rls_descriptors: Family<RlsLabels, Counter>,
    /// Units settled from responses (`cost.from_response`), by route and limit.
    pub limit_units: Family<RouteLimitLabels, Counter>,
    /// The candidate config's decisions (see `candidate`): for the admin and dashboards.
    pub candidate_decisions: Family<CandidateLabels, sharded::Counter>,
    candidate_loads: Family<ReloadLabels, Counter>,
    candidate_ok: Gauge,
    /// For the dashboard: the identities each limit rejected most, and the counters' history.
    pub most_limited: top::MostLimitedByLimit,
    pub history: history::History,
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
    /// Counts one gRPC call of `route` when told its status.
    pub fn grpc_tally(&self, route: &str) -> crate::access_log::EndTally {
        let (calls, route) = (self.grpc_calls.clone(), route.to_owned());
        crate::access_log::EndTally(Box::new(Box::new(move |code, _| {
            let grpc_code = grpc_code_name(code);
            calls.get_or_create(&GrpcLabels { route, grpc_code }).inc();
            None
        })))
    }

    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::default(),
            requests: Family::default(),
            decisions: Family::default(),
            bans: Family::default(),
            banned_requests: Family::default(),
            ban_lifts: Family::default(),
            durations: Family::new_with_constructor(latency_histogram),
            backend_seconds: latency_histogram(),
            redis_check_seconds: latency_histogram(),
            upstream_seconds: Family::new_with_constructor(latency_histogram),
            upstream_errors: Family::default(),
            targets: Targets::default(),
            open_connections: Gauge::default(),
            worker_connections: Family::default(),
            connections_refused: Counter::default(),
            overloaded: Counter::default(),
            memory_refused_requests: Counter::default(),
            memory_refused_connections: Counter::default(),
            memory_over: Gauge::default(),
            redis_evicted_keys: Gauge::default(),
            spill: crate::buffer::SpillHandles::default(),
            reloads: Family::default(),
            generation: Gauge::default(),
            config_hash: Gauge::default(),
            config_ok: Gauge::default(),
            config_loaded_at: Gauge::default(),
            certificates: Family::default(),
            buckets: Family::default(),
            overflowed: Family::default(),
            peer_overflowed: Family::default(),
            without_backend: Counter::default(),
            redis_errors: Counter::default(),
            redis_timeouts: Counter::default(),
            redis_calls: Counter::default(),
            negative_hits: Counter::default(),
            leased_checks: Counter::default(),
            lease_tokens_returned: Counter::default(),
            redis_reconnects: Counter::default(),
            redis_failovers: Counter::default(),
            breaker_open: Gauge::default(),
            admin_banned_requests: Family::default(),
            grpc_calls: Family::default(),
            rls_descriptors: Family::default(),
            limit_units: Family::default(),
            candidate_decisions: Family::default(),
            candidate_loads: Family::default(),
            candidate_ok: Gauge::default(),
            most_limited: top::MostLimitedByLimit::default(),
            history: history::History::default(),
        };
        m.registry.register_collector(Box::new(process::Process));
        m.register();
        m.register_bans();
        m.register_candidate();
        // Both series exist from the start, at 0, and generation 1 is the config started with.
        for result in [ReloadResult::ok, ReloadResult::failed] {
            let _ = m.reloads.get_or_create(&ReloadLabels { result });
        }
        m.generation.set(1);
        m
    }

    /// The counters of one route (`route` is its name, `limits` its limit names in order).
    pub fn route_counters<'a>(
        &self,
        route: &str,
        limits: impl Iterator<Item = &'a str>,
    ) -> RouteCounters {
        let mut most_limited = Vec::new();
        let decisions = limits
            .map(|limit| {
                most_limited.push(self.most_limited.of(limit));
                route::OUTCOMES.map(|outcome| {
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
        let duration = self
            .durations
            .get_or_create(&RouteLabels {
                route: route.to_owned(),
            })
            .clone();
        let mut counters = RouteCounters::new(route, &self.requests, duration, decisions);
        counters.most_limited = most_limited;
        counters
    }

    /// Count a request that matched no route (answered by tollgate: 404, 400, 503).
    pub fn unrouted(&self, status: http::StatusCode) {
        self.requests
            .get_or_create(&RequestLabels::of("", status))
            .inc();
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
        if result == ReloadResult::failed {
            self.config_ok.set(0);
        }
    }

    /// Reloads attempted since start: (succeeded, failed).
    pub fn reload_counts(&self) -> (u64, u64) {
        let get = |result| self.reloads.get_or_create(&ReloadLabels { result }).get();
        (get(ReloadResult::ok), get(ReloadResult::failed))
    }

    /// The config of `source` (the file's text) went live, now.
    pub fn loaded(&self, source: &str) {
        let digest = blake3::hash(source.as_bytes());
        let mut first = [0u8; 8];
        first[2..].copy_from_slice(&digest.as_bytes()[..6]);
        // 48 bits: exact in the float Prometheus stores samples as.
        self.config_hash.set(i64::from_be_bytes(first));
        self.config_ok.set(1);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.config_loaded_at.set(now);
    }

    /// The exposition in `format`, with the values kept elsewhere (the live limits' buckets,
    /// the Redis client's counters, the upstreams' target health, the listeners'
    /// certificates) read now.
    pub fn render<'a>(
        &self,
        format: Format,
        scrape: Scrape<'a, impl Iterator<Item = &'a Arc<Limit>>>,
    ) -> String {
        self.targets.read(scrape.targets, scrape.queues);
        self.certificates.clear();
        for c in scrape.certs {
            let labels = CertLabels {
                listener: c.listener.clone(),
                cert: c.cert.clone(),
            };
            self.certificates.get_or_create(&labels).set(c.not_after);
        }
        self.buckets.clear();
        self.overflowed.clear();
        self.peer_overflowed.clear();
        for limit in scrape.limits {
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
        if let Some(redis) = scrape.redis {
            let s = redis.stats();
            set_counter(&self.redis_errors, s.errors);
            set_counter(&self.redis_timeouts, s.timeouts);
            set_counter(&self.redis_calls, s.redis_calls);
            set_counter(&self.negative_hits, s.negative_hits);
            set_counter(&self.leased_checks, s.leased);
            set_counter(&self.lease_tokens_returned, s.lease_tokens_returned);
            set_counter(&self.redis_reconnects, s.reconnects);
            set_counter(&self.redis_failovers, s.failovers);
            self.breaker_open.set(i64::from(redis.breaker_open()));
        }
        format.encode(&self.registry).unwrap_or_default()
    }
}

/// Counters only go up; bring one up to a total kept elsewhere.
fn set_counter(c: &Counter, total: u64) {
    let now = c.get();
    if total > now {
        c.inc_by(total - now);
    }
}

/// A gRPC status code's name, as grpc-prometheus labels it.
fn grpc_code_name(code: u16) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "Canceled",
        "Unknown",
        "InvalidArgument",
        "DeadlineExceeded",
        "NotFound",
        "AlreadyExists",
        "PermissionDenied",
        "ResourceExhausted",
        "FailedPrecondition",
        "Aborted",
        "OutOfRange",
        "Unimplemented",
        "Internal",
        "Unavailable",
        "DataLoss",
        "Unauthenticated",
    ];
    NAMES.get(usize::from(code)).copied().unwrap_or("Unknown")
}
