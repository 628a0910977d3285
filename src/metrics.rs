//! Prometheus metrics: what the request path counts, and what is read off the state at scrape.
//!
//! Every name but the standard `process_*` ones has the prefix `tollgate_`. `/metrics` answers
//! in the format the scraper asks for (`Format`).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::metrics::info::Info;
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
    redis_reconnects: Counter,
    redis_failovers: Counter,
    breaker_open: Gauge,
    /// Requests refused by an operator's ban (`control`), by route.
    pub admin_banned_requests: Family<RouteLabels, Counter>,
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
            redis_reconnects: Counter::default(),
            redis_failovers: Counter::default(),
            breaker_open: Gauge::default(),
            admin_banned_requests: Family::default(),
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

    fn register(&mut self) {
        let r = self.registry.sub_registry_with_prefix("tollgate");
        r.register(
            "requests",
            "Requests by route and status code",
            self.requests.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Time from a request's arrival to its response head, by route",
            self.durations.clone(),
        );
        r.register(
            "limit_decisions",
            "Limit decisions by route, limit and outcome",
            self.decisions.clone(),
        );
        r.register(
            "limiter_backend_seconds",
            "Time requests spent in the limit decision with the Redis backend (negative-cache answers included)",
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
        self.targets.register(r);
        self.register_redis();
        self.register_config();
    }

    /// The Redis client's series.
    fn register_bans(&mut self) {
        let r = self.registry.sub_registry_with_prefix("tollgate");
        r.register(
            "bans",
            "Bans begun (an identity's last strike), by route and limit",
            self.bans.clone(),
        );
        r.register(
            "banned_requests",
            "Requests refused by a ban, by route and limit",
            self.banned_requests.clone(),
        );
        r.register(
            "ban_lifts",
            "Bans seen lifted (the identity's first request after its ban), by route and limit",
            self.ban_lifts.clone(),
        );
        r.register(
            "admin_banned_requests",
            "Requests refused by an operator's ban (admin API), by route",
            self.admin_banned_requests.clone(),
        );
    }

    fn register_redis(&mut self) {
        let r = self.registry.sub_registry_with_prefix("tollgate");
        r.register(
            "redis_check_duration_seconds",
            "Time of limit checks sent to Redis, until answered or failed",
            self.redis_check_seconds.clone(),
        );
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
            "redis_failovers",
            "Redis connections that followed a Sentinel failover to another master",
            self.redis_failovers.clone(),
        );
        r.register(
            "redis_breaker_open",
            "1 while the Redis circuit breaker is open",
            self.breaker_open.clone(),
        );
    }

    /// The build's and the live config's series.
    fn register_config(&mut self) {
        let r = self.registry.sub_registry_with_prefix("tollgate");
        let version = env!("CARGO_PKG_VERSION").to_owned();
        let commit = env!("TOLLGATE_COMMIT").to_owned();
        r.register(
            "build",
            "The version and commit of this tollgate binary",
            Info::new(vec![("version", version), ("commit", commit)]),
        );
        r.register(
            "config_hash",
            "Hash of the live config file (the first 48 bits of its BLAKE3 digest)",
            self.config_hash.clone(),
        );
        r.register(
            "config_last_reload_successful",
            "1 if the last config load (start or reload) succeeded, 0 if it failed",
            self.config_ok.clone(),
        );
        r.register(
            "config_last_reload_success_timestamp_seconds",
            "When the live config was loaded (at start or by the last successful reload)",
            self.config_loaded_at.clone(),
        );
        r.register(
            "tls_certificate_expiry_timestamp_seconds",
            "When a listener certificate expires (its notAfter), by listener and file",
            self.certificates.clone(),
        );
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
        self.targets.read(scrape.targets);
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
