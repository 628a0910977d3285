//! The live config: routes with their upstream pools, buckets, Redis client and metric handles,
//! built from `Settings` plus the runtime it replaces.
//!
//! Building reuses what did not change, by comparing specs: a limit with the same name and rate
//! keeps its buckets, an upstream with the same fingerprint its warm connections (and its
//! targets' health, with the task that checks it), the same Redis settings the same client
//! (connections, breaker, negative cache). The request path reads one immutable `Runtime`; a
//! reload builds a whole new one and swaps it in.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::Request;

use crate::body::BodyLimits;
use crate::buffer::{Budget, Spill, Store};
use crate::config::settings::{ActionSpec, Backend, Respond, RouteSpec, Settings};
use crate::forward::Upstream;
use crate::limiter::redis::RedisLimiter;
use crate::limiter::Limit;
use crate::metrics::{Metrics, RouteCounters};
use crate::response::Rendered;
use crate::workers::Workers;

/// Why a config that passed validation could not be made live. Each names what failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The Redis client of `limiter.redis` (a malformed address, or no tokio runtime).
    #[error("cannot set up the Redis client: {0}")]
    Redis(String),
    /// A route names an upstream the config has no spec for (validation refuses this first).
    #[error("route `{route}` forwards to upstream `{upstream}`, which was not built")]
    MissingUpstream { route: Arc<str>, upstream: Arc<str> },
    /// `telemetry.traces`: an exporter the OpenTelemetry SDK cannot build.
    #[error("cannot start the trace exporter: {0}")]
    Traces(String),
}

/// One config, live. Immutable once built.
#[derive(Debug)]
pub struct Runtime {
    pub settings: Arc<Settings>,
    /// In file order, as `settings.routes`.
    pub routes: Vec<Route>,
    /// Every upstream of the settings, once each.
    pub upstreams: Vec<Arc<Upstream>>,
    /// The shared store for `backend: redis`.
    pub redis: Option<Arc<RedisLimiter>>,
    /// Where buffered bodies go, with the proxy-wide memory budget.
    pub store: Store,
    /// The candidate config evaluated beside this one, never enforcing (`candidate:`).
    pub candidate: Option<Arc<crate::candidate::Candidate>>,
    /// The rate limit service's domains (`rls:`), their limits live.
    pub rls: Option<crate::limiter::descriptors::Domains>,
    /// `telemetry.traces`: the sampler and the exporter's queue.
    pub tracer: Option<Arc<crate::telemetry::Tracer>>,
}

/// A route, live.
// Independent per-route switches (WebSocket, buffering each way, retries, path case), not a
// state machine.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    pub action: Action,
    pub limits: Vec<Arc<Limit>>,
    /// The fixed parts of each limit's response headers, in `limits` order.
    pub rendered: Vec<Rendered>,
    /// Idle timeout, deadline and size cap of request bodies on this route.
    pub body: BodyLimits,
    /// WebSocket upgrades are proxied (limits apply to the handshake request).
    pub websocket: bool,
    /// An open tunnel with no traffic either way for this long is closed.
    pub websocket_idle: Duration,
    /// Idempotent requests that reached a failing target go to another one.
    pub retry_idempotent: bool,
    /// This route's request and decision counters.
    pub counters: RouteCounters,
    /// Receive request bodies whole before contacting the upstream.
    pub buffer_request: bool,
    /// Read upstream responses ahead, as fast as the upstream sends them.
    pub buffer_response: bool,
    /// The route compares paths without case, so its limits read the path lower-cased.
    pub fold_path: bool,
    /// A limit counts by the response's status (`count_when`) or settles its cost from it
    /// (`cost.from_response`): each response is read for them.
    pub counts_responses: bool,
    /// The identity sources its limits read that a JSON access line gives digests of.
    pub logged_keys: crate::access_log::KeySources,
    /// Its class in the upstream's queue.
    pub priority: crate::capacity::Priority,
    /// Its path as a template (`/api/*`), for traces' `http.route`.
    pub path_template: Option<Arc<str>>,
}

/// What a route does with an admitted request.
#[derive(Debug)]
pub enum Action {
    Forward(Arc<Upstream>),
    Respond(Arc<Respond>),
}

impl Runtime {
    /// The runtime of `settings`, reusing what `previous` runs for unchanged specs. Needs a
    /// tokio runtime when the limiter is Redis (its client connects in the background).
    pub fn build(
        settings: Settings,
        previous: Option<&Runtime>,
        workers: &Workers,
        metrics: &Metrics,
    ) -> Result<Self, BuildError> {
        let redis = redis(&settings, previous, workers, metrics).map_err(BuildError::Redis)?;
        let upstreams = upstreams(&settings, previous, workers, metrics);
        let by_name: HashMap<&str, &Arc<Upstream>> =
            upstreams.iter().map(|u| (&*u.name, u)).collect();
        let old_limits: HashMap<&str, &Arc<Limit>> = previous
            .map(|p| p.limits().map(|l| (&*l.name, l)).collect())
            .unwrap_or_default();
        let mut routes = Vec::with_capacity(settings.routes.len());
        for (i, spec) in settings.routes.iter().enumerate() {
            let limits: Vec<Arc<Limit>> = spec
                .limits
                .iter()
                .map(|l| {
                    Limit::build(
                        l,
                        old_limits.get(&*l.name).map(|o| &***o),
                        &settings.limiter,
                    )
                })
                .collect();
            let action = action(spec, &by_name)?;
            routes.push(Route {
                name: spec.name.clone(),
                action,
                rendered: limits.iter().map(|l| Rendered::of(l)).collect(),
                counters: metrics.route_counters(&spec.name, limits.iter().map(|l| &*l.name)),
                logged_keys: logged_keys(&limits),
                counts_responses: (limits.iter())
                    .any(|l| l.count_when.is_some() || l.settle.is_some()),
                limits,
                body: spec.body,
                websocket: spec.websocket,
                websocket_idle: spec.websocket_idle,
                buffer_request: spec.buffer_request,
                buffer_response: spec.buffer_response,
                retry_idempotent: spec.retry_idempotent,
                fold_path: spec.fold_path,
                priority: spec.priority,
                path_template: settings.table.matcher(i).and_then(path_template),
            });
        }
        let store = store(&settings, previous, metrics);
        let rls = (settings.rls.as_ref()).map(|r| {
            crate::limiter::descriptors::Domains::build(&r.domains, &old_limits, &settings.limiter)
        });
        let candidate = crate::candidate::build(
            &settings,
            previous.and_then(|p| p.candidate.as_ref()),
            metrics,
        );
        Ok(Self {
            store,
            tracer: tracer(&settings, previous).map_err(BuildError::Traces)?,
            settings: Arc::new(settings),
            routes,
            upstreams,
            redis,
            candidate,
            rls,
        })
    }

    /// The first route, in file order, that matches the request.
    pub fn find<B>(&self, req: &Request<B>) -> Option<&Route> {
        let i = self.settings.table.find(req)?;
        self.routes.get(i)
    }

    /// Every limit of every route, in file order, then the rate limit service's.
    pub fn limits(&self) -> impl Iterator<Item = &Arc<Limit>> {
        let rls = self
            .rls
            .iter()
            .flat_map(crate::limiter::descriptors::Domains::limits);
        self.routes.iter().flat_map(|r| r.limits.iter()).chain(rls)
    }
}

/// A route's path as a template, for traces' `http.route`: its exact path, or its prefix
/// followed by `*`.
fn path_template(m: &crate::route::Matcher) -> Option<Arc<str>> {
    match &m.path {
        crate::route::PathPattern::Exact(p) => Some(p.as_str().into()),
        crate::route::PathPattern::Prefix(p) => Some(format!("{p}*").into()),
        crate::route::PathPattern::Any => None,
    }
}

/// The tracer of `telemetry.traces`: the previous one while its settings are unchanged (its
/// queue and exporter go on), else a new one.
fn tracer(
    settings: &Settings,
    previous: Option<&Runtime>,
) -> Result<Option<Arc<crate::telemetry::Tracer>>, String> {
    let Some(traces) = &settings.traces else {
        return Ok(None);
    };
    let old = previous.and_then(|p| p.tracer.as_ref());
    if let Some(old) = old.filter(|t| t.settings == *traces) {
        return Ok(Some(old.clone()));
    }
    crate::telemetry::Tracer::start(traces).map(|t| Some(Arc::new(t)))
}

/// The sources `limits` read in their keys and `exempt` entries that access lines log.
fn logged_keys(limits: &[Arc<Limit>]) -> crate::access_log::KeySources {
    crate::access_log::KeySources::of(limits.iter().flat_map(|l| {
        let exempt = l.exempt.iter().filter_map(|e| match e {
            crate::identity::Exemption::Equals(source, _) => Some(source),
            crate::identity::Exemption::Net(_) => None,
        });
        l.key.0.iter().flat_map(|alt| alt.0.iter()).chain(exempt)
    }))
}

/// What a route does: forward to its upstream (live in `by_name`), or answer itself.
fn action(spec: &RouteSpec, by_name: &HashMap<&str, &Arc<Upstream>>) -> Result<Action, BuildError> {
    Ok(match &spec.action {
        ActionSpec::Forward(u) => Action::Forward(
            by_name
                .get(&*u.name)
                .map(|u| Arc::clone(u))
                .ok_or_else(|| BuildError::MissingUpstream {
                    route: spec.name.clone(),
                    upstream: u.name.clone(),
                })?,
        ),
        ActionSpec::Respond(r) => Action::Respond(r.clone()),
    })
}

/// The live upstreams of `settings`: `previous`'s where their fingerprint is the same (their
/// warm connections, health and queue kept, their caps changed in place), new ones otherwise.
fn upstreams(
    settings: &Settings,
    previous: Option<&Runtime>,
    workers: &Workers,
    metrics: &Metrics,
) -> Vec<Arc<Upstream>> {
    let old_upstreams: HashMap<&str, &Arc<Upstream>> = previous
        .map(|p| p.upstreams.iter().map(|u| (&*u.name, u)).collect())
        .unwrap_or_default();
    settings
        .upstreams
        .iter()
        .map(|spec| match old_upstreams.get(&*spec.name) {
            Some(kept) if kept.fingerprint == spec.fingerprint => {
                kept.respec(spec);
                Arc::clone(kept)
            }
            _ => Arc::new(Upstream::new(spec, workers.count(), metrics.upstream(spec))),
        })
        .collect()
}

/// Where `settings` buffer bodies. The memory budget is `previous`'s when its cap is the same:
/// the bodies held now keep counting against it.
fn store(settings: &Settings, previous: Option<&Runtime>, metrics: &Metrics) -> Store {
    let b = &settings.buffering;
    let budget = previous
        .filter(|p| p.settings.buffering.max_memory == b.max_memory)
        .map_or_else(
            || Arc::new(Budget::new(b.max_memory)),
            |p| p.store.budget.clone(),
        );
    let spill = previous
        .filter(|p| p.store.spill.limit() == b.max_spill)
        .map_or_else(
            || Arc::new(Spill::new(b.max_spill, metrics.spill.clone())),
            |p| p.store.spill.clone(),
        );
    Store {
        temp_dir: b.temp_dir.clone(),
        memory_per_body: b.memory_per_body,
        max_file: b.max_response_file,
        budget,
        spill,
    }
}

/// The Redis client of `settings`: `previous`'s when the Redis settings did not change, else a
/// new one whose workers' connections open at once.
fn redis(
    settings: &Settings,
    previous: Option<&Runtime>,
    workers: &Workers,
    metrics: &Metrics,
) -> Result<Option<Arc<RedisLimiter>>, String> {
    let Backend::Redis(cfg) = &settings.limiter.backend else {
        return Ok(None);
    };
    let kept = previous
        .filter(|p| p.settings.limiter.backend == settings.limiter.backend)
        .and_then(|p| p.redis.clone());
    if let Some(kept) = kept {
        return Ok(Some(kept));
    }
    let limiter = Arc::new(
        RedisLimiter::for_workers(cfg, workers.count())?
            .with_latency(metrics.redis_check_seconds.clone()),
    );
    // The workers running now open their connections at once (a worker started later does so
    // as it starts).
    let warm = limiter.clone();
    workers.on_every(move |id| {
        let limiter = warm.clone();
        async move { limiter.warm_up_worker(id).await }
    });
    Ok(Some(limiter))
}
