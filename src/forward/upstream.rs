//! An upstream, live: its targets, their health and the choice among them, the retry budget,
//! and one connection pool per worker.

use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{StatusCode, Uri};
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::connect::HttpConnector;
use prometheus_client::metrics::counter::Counter;
use tokio::time::Instant;

use super::balance::Balancer;
use super::check::{self, Checker, Probe};
use super::health::Health;
use crate::capacity::Gate;
use crate::config::settings::{Protocol, UpstreamSpec};
use crate::log_gate::LogGate;
use crate::metrics::{AttemptResult, RetryReason, UpstreamHandles};
use crate::pool::{Connector, InFlight, Pool};

/// A named group of targets with their health, and its own connection pools.
#[derive(Debug)]
pub struct Upstream {
    pub name: Arc<str>,
    pub scheme: Scheme,
    /// The HTTP version requests go in (`protocol`).
    pub protocol: Protocol,
    pub targets: Vec<Authority>,
    pub connect_timeout: Duration,
    pub timeout: Duration,
    /// Identifies the settings it was built from: a reload keeps an upstream (and its warm
    /// connections) whose fingerprint did not change.
    pub fingerprint: [u8; 32],
    /// The upstream's response-time histogram.
    pub seconds: crate::sharded::Histogram,
    /// `scheme://target/` of each target, for the connector.
    pub(super) target_uris: Vec<Uri>,
    /// One pool per worker thread: a worker reuses connections whose tasks run on its own
    /// thread, so a request never wakes another core. A capped upstream has one, shared, so
    /// that its cap bounds its connections.
    pools: Vec<Arc<Pool>>,
    pub(super) health: Arc<Health>,
    pub(super) balancer: Balancer,
    /// Extra attempts per request; 0 with one target (there is no other to try).
    pub(super) retries: u32,
    /// `tollgate_upstream_retries_total` by reason (`RetryReason` order).
    retried: [Counter; 2],
    /// `tollgate_upstream_target_attempts_total` by target, then by result.
    attempts: Vec<[crate::sharded::Counter; 4]>,
    /// Keeps the warnings of a dead upstream to one a second.
    pub(super) log_gate: LogGate,
    /// `max_in_flight`: the slots and queue, when capped.
    pub gate: Option<Arc<Gate>>,
    /// `queue.key`: the identity the queue is fair across, when not the route's limit's.
    pub queue_key: Option<crate::identity::KeySpec>,
    /// The HTTP version its targets answer in (`HEARD_*`): an upload of unknown length is
    /// streamed chunked only once every answer so far was HTTP/1.1.
    heard: std::sync::atomic::AtomicU8,
    /// The active health check, stopped with the upstream.
    _checker: Option<Checker>,
}

/// No answer yet; only HTTP/1.1 answers; an HTTP/1.0 answer (sticky: such a server cannot
/// read a chunked body, RFC 9112 6.1).
const HEARD_NOTHING: u8 = 0;
const HEARD_HTTP11: u8 = 1;
const HEARD_HTTP10: u8 = 2;

/// Idle connections each worker keeps per target when `keepalive.max_idle` is not set. A cap
/// below the requests in flight to a target at the peaks of normal load makes its connections
/// close and reopen all the time (a returned connection finds the pool full), so the default
/// only bounds what a burst leaves behind (docs/performance.md has the measurement).
pub const DEFAULT_MAX_IDLE_PER_WORKER: usize = 1024;

/// How new connections to `spec`'s targets are made: plain sockets for `http://` (no
/// TLS-or-not wrapper on every read), TLS offering by ALPN what the protocol may speak.
fn connector(spec: &UpstreamSpec) -> Connector {
    let mut tcp = HttpConnector::new();
    tcp.set_connect_timeout(Some(spec.connect_timeout));
    tcp.set_nodelay(true);
    tcp.enforce_http(false);
    if spec.scheme == Scheme::HTTPS {
        let tls = HttpsConnectorBuilder::new()
            .with_tls_config((*spec.tls).clone())
            .https_only();
        // ALPN offers what the protocol may speak: `h2` alone, both, or HTTP/1.1.
        Connector::Tls(match spec.protocol {
            Protocol::H2 => tls.enable_http2().wrap_connector(tcp),
            Protocol::Auto => tls.enable_all_versions().wrap_connector(tcp),
            Protocol::Http1 | Protocol::H2c => tls.enable_http1().wrap_connector(tcp),
        })
    } else {
        Connector::Plain(tcp)
    }
}

/// The upstream's connection pools: one per worker, each keeping its share of the idle
/// connections (rounded up); a capped upstream's one, shared by every worker, whose
/// connections are counted against its cap.
fn pools(
    spec: &UpstreamSpec,
    connector: &Connector,
    gate: Option<&Arc<Gate>>,
    workers: usize,
) -> Vec<Arc<Pool>> {
    let (pools, max_idle) = if gate.is_some() {
        (1, spec.max_idle.unwrap_or(DEFAULT_MAX_IDLE_PER_WORKER))
    } else {
        let share = spec
            .max_idle
            .map_or(DEFAULT_MAX_IDLE_PER_WORKER, |n| n.div_ceil(workers));
        (workers, share)
    };
    (0..pools)
        .map(|_| {
            Arc::new(Pool::new(
                connector.clone(),
                spec.targets.len(),
                max_idle,
                spec.idle_timeout,
                gate.cloned(),
                spec.protocol,
                spec.max_streams,
            ))
        })
        .collect()
}

impl Upstream {
    /// The live upstream of `spec`: one connection pool per worker of `workers`, counting in
    /// `metrics`; its active health check (if any) starts on the current tokio runtime.
    pub fn new(spec: &UpstreamSpec, workers: usize, metrics: UpstreamHandles) -> Self {
        let connector = connector(spec);
        let workers = workers.max(1);
        let health = Arc::new(Health::new(&spec.health, metrics.ejections, Instant::now()));
        let gate = spec.capacity.as_ref().map(|c| {
            let health = Arc::clone(&health);
            let healthy = Box::new(move |t| health.is_healthy(t, health.ms(Instant::now())));
            Gate::new(c, spec.targets.len(), healthy, metrics.capacity)
        });
        let pools = pools(spec, &connector, gate.as_ref(), workers);
        let target_uris = spec
            .targets
            .iter()
            .map(|t| {
                Uri::builder()
                    .scheme(spec.scheme.clone())
                    .authority(t.clone())
                    .path_and_query("/")
                    .build()
                    .unwrap_or_default()
            })
            .collect::<Vec<Uri>>();
        let checker = spec.health.check.clone().and_then(|check| {
            let probe = Probe {
                upstream: spec.name.clone(),
                spec: check,
                connector: connector.clone(),
                protocol: spec.protocol,
                targets: spec
                    .targets
                    .iter()
                    .cloned()
                    .zip(target_uris.clone())
                    .collect(),
            };
            check::start(probe, &health)
        });
        let several = spec.targets.len() > 1;
        Self {
            name: spec.name.clone(),
            scheme: spec.scheme.clone(),
            protocol: spec.protocol,
            targets: spec.targets.clone(),
            connect_timeout: spec.connect_timeout,
            timeout: spec.timeout,
            fingerprint: spec.fingerprint,
            seconds: metrics.seconds,
            target_uris,
            pools,
            health,
            balancer: Balancer::new(spec.balance, spec.targets.len()),
            retries: if several { spec.retries } else { 0 },
            retried: metrics.retries,
            attempts: metrics.attempts,
            log_gate: LogGate::new(Duration::from_secs(1)),
            gate,
            queue_key: spec.queue_key.clone(),
            heard: std::sync::atomic::AtomicU8::new(HEARD_NOTHING),
            _checker: checker,
        }
    }

    /// A reload kept this upstream: its caps and queue bounds become `spec`'s.
    pub fn respec(&self, spec: &UpstreamSpec) {
        if let (Some(gate), Some(c)) = (&self.gate, &spec.capacity) {
            gate.respec(c);
        }
    }

    /// The caps and the queue now, when capped.
    pub fn capacity(&self) -> Option<crate::capacity::Stats> {
        self.gate.as_ref().map(|g| g.stats())
    }

    /// `target`'s cap now, when capped.
    pub fn cap(&self, target: usize) -> Option<usize> {
        Some(self.capacity()?.targets.get(target)?.1)
    }

    /// Close idle connections past their timeout, in every worker's pool.
    pub fn expire_idle(&self) {
        for pool in &self.pools {
            pool.expire();
        }
    }

    /// Worker `worker`'s pool.
    pub(super) fn pool(&self, worker: usize) -> &Arc<Pool> {
        &self.pools[worker % self.pools.len()]
    }

    /// The target for the next attempt at `now`, given the targets `tried` so far: its index.
    pub(super) fn pick(&self, now: Instant, tried: &[usize]) -> usize {
        // One target (the common case): no write to a counter every worker shares, and no
        // health to read (it would be picked anyway).
        if self.targets.len() == 1 {
            return 0;
        }
        self.balancer.pick(&self.health, self.health.ms(now), tried)
    }

    /// Count a request in flight to `target`, for `least_request`.
    pub(super) fn enter(&self, target: usize) -> Option<InFlight> {
        self.balancer.enter(target)
    }

    /// Requests in flight to `target` now (counted for `least_request` and capped upstreams).
    pub fn in_flight(&self, target: usize) -> Option<usize> {
        if let Some(stats) = self.capacity() {
            return stats.targets.get(target).map(|t| t.0);
        }
        self.balancer.in_flight(target)
    }

    /// Whether `target` takes traffic at `now` (not ejected, passing its check).
    pub fn is_healthy(&self, target: usize, now: Instant) -> bool {
        self.health.is_healthy(target, self.health.ms(now))
    }

    /// `status` from `target` counts as its failure. Only judged with more than one target:
    /// a lone target is never ejected nor retried.
    pub(super) fn is_failure(&self, status: StatusCode) -> bool {
        self.targets.len() > 1 && self.health.is_failure(status)
    }

    pub(super) fn succeeded(&self, target: usize) {
        if self.targets.len() > 1 {
            self.health.succeeded(target);
        }
    }

    pub(super) fn failed(&self, target: usize, at: Instant) {
        if self.targets.len() == 1 {
            return;
        }
        let Some(ms) = self.health.failed(target, self.health.ms(at)) else {
            return;
        };
        tracing::warn!(
            upstream = &*self.name,
            target = self.targets[target].as_str(),
            ejected_for = ?Duration::from_millis(ms),
            "upstream target ejected after failing requests in a row"
        );
    }

    pub(super) fn retried(&self, why: RetryReason) {
        self.retried[why as usize].inc();
    }

    /// Count one attempt on `target`: how it ended.
    pub(super) fn attempted(&self, target: usize, result: AttemptResult) {
        if let Some(c) = self.attempts.get(target) {
            c[result as usize].inc();
        }
    }

    /// Count an attempt on `target` that got a response head with `status`: a failure if it
    /// is one of `failure_statuses`, whatever the number of targets.
    /// Whether a request body of unknown length may go chunked: every target that answered so
    /// far answered in HTTP/1.1. Otherwise (nothing heard yet, or an HTTP/1.0 server) it is
    /// received whole first and sent with its length.
    pub fn takes_chunked(&self) -> bool {
        self.protocol != Protocol::Http1
            || self.heard.load(std::sync::atomic::Ordering::Relaxed) == HEARD_HTTP11
    }

    /// An answer in `version` came.
    pub(super) fn heard(&self, version: http::Version) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = if version == http::Version::HTTP_10 {
            HEARD_HTTP10
        } else {
            HEARD_HTTP11
        };
        // Only ever up: nothing, then 1.1, then 1.0 for good. One load on the usual path.
        if self.heard.load(Relaxed) < now {
            self.heard.fetch_max(now, Relaxed);
        }
    }

    pub(super) fn answered(&self, target: usize, status: StatusCode) {
        let result = if self.health.is_failure(status) {
            AttemptResult::failure_status
        } else {
            AttemptResult::response
        };
        self.attempted(target, result);
    }
}
