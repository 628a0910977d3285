//! An upstream, live: its targets, round-robin choice, and one connection pool per worker.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::Uri;
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::connect::HttpConnector;

use crate::config::settings::UpstreamSpec;
use crate::pool::{Connector, Pool};

/// A named group of targets with its own connection pool.
#[derive(Debug)]
pub struct Upstream {
    pub name: Arc<str>,
    pub scheme: Scheme,
    pub targets: Vec<Authority>,
    pub connect_timeout: Duration,
    pub timeout: Duration,
    /// Identifies the settings it was built from: a reload keeps an upstream (and its warm
    /// connections) whose fingerprint did not change.
    pub fingerprint: [u8; 32],
    next: AtomicUsize,
    /// The upstream's response-time histogram.
    pub seconds: crate::sharded::Histogram,
    /// `scheme://target/` of each target, for the connector.
    pub(super) target_uris: Vec<Uri>,
    /// One pool per worker thread: a worker reuses connections whose tasks run on its own
    /// thread, so a request never wakes another core.
    pools: Vec<Arc<Pool>>,
}

/// Idle connections each worker keeps per target when `keepalive.max_idle` is not set. A cap
/// below the requests in flight to a target at the peaks of normal load makes its connections
/// close and reopen all the time (a returned connection finds the pool full), so the default
/// only bounds what a burst leaves behind (docs/performance.md has the measurement).
pub const DEFAULT_MAX_IDLE_PER_WORKER: usize = 1024;

impl Upstream {
    /// The live upstream of `spec`: one connection pool per worker of `workers`, timing its
    /// responses in `seconds`.
    pub fn new(spec: &UpstreamSpec, workers: usize, seconds: crate::sharded::Histogram) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(spec.connect_timeout));
        tcp.set_nodelay(true);
        tcp.enforce_http(false);
        // A plain-text upstream gets plain sockets: no TLS-or-not wrapper on every read.
        let connector = if spec.scheme == Scheme::HTTPS {
            Connector::Tls(
                HttpsConnectorBuilder::new()
                    .with_tls_config((*spec.tls).clone())
                    .https_only()
                    .enable_http1()
                    .wrap_connector(tcp),
            )
        } else {
            Connector::Plain(tcp)
        };
        let workers = workers.max(1);
        // Each worker keeps its share of the idle connections, rounded up.
        let max_idle = spec
            .max_idle
            .map_or(DEFAULT_MAX_IDLE_PER_WORKER, |n| n.div_ceil(workers));
        let pools = (0..workers)
            .map(|_| {
                Arc::new(Pool::new(
                    connector.clone(),
                    spec.targets.len(),
                    max_idle,
                    spec.idle_timeout,
                ))
            })
            .collect();
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
            .collect();
        Self {
            name: spec.name.clone(),
            scheme: spec.scheme.clone(),
            targets: spec.targets.clone(),
            connect_timeout: spec.connect_timeout,
            timeout: spec.timeout,
            fingerprint: spec.fingerprint,
            next: AtomicUsize::new(0),
            seconds,
            target_uris,
            pools,
        }
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

    /// The next target, round robin: its index.
    pub(super) fn pick(&self) -> usize {
        // One target (the common case): no write to a counter every worker shares.
        if self.targets.len() == 1 {
            return 0;
        }
        self.next.fetch_add(1, Ordering::Relaxed) % self.targets.len()
    }
}
