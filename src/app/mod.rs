//! Wiring: load the config, build the runtime and state, bind, serve, and drain on shutdown.
//! `start` is the in-process entry point (tests use it); `run` is the binary's.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::{self, ConfigError};
use crate::metrics::Metrics;
use crate::runtime::Runtime;
use crate::state::State;
use crate::workers::Workers;
use listen::{bind, per_worker, serve_admin, spawn_workers, worker_count};

mod listen;
mod memory;

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Build(#[from] crate::runtime::BuildError),
    #[error("cannot start a worker thread: {0}")]
    Worker(std::io::Error),
    #[error("cannot write the address file {}: {source}", path.display())]
    AddressFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// How often idle (full) buckets are forgotten.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// How to start: the worker count, and whether SIGHUP reloads.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Worker threads serving the proxy listeners; `None`: `TOLLGATE_WORKERS`, else one per core.
    pub workers: Option<usize>,
    /// Serve the listeners on the calling runtime instead, as one worker and no thread: a test
    /// that pauses tokio's clock then controls the proxy's time too.
    pub inline: bool,
    /// Reload on SIGHUP (the binary does; a proxy started in a test process need not).
    pub sighup: bool,
}

/// A proxy serving in this process, from `start`.
#[derive(Debug)]
pub struct Running {
    /// The proxy listeners' bound addresses, in config order (port 0 resolved).
    pub listeners: Vec<SocketAddr>,
    /// The admin listener's bound address.
    pub admin: Option<SocketAddr>,
    /// The rate limit service's bound address (`rls:`).
    pub rls: Option<SocketAddr>,
    /// The live config's generation: 1 as started, one more per successful reload.
    pub generation: watch::Receiver<u64>,
    /// Asks for a reload, as SIGHUP does.
    pub reloader: crate::reload::Reloader,
    pub state: Arc<State>,
    stopped: tokio::task::JoinHandle<()>,
}

impl Running {
    /// `listener ADDR` per proxy listener, then `admin ADDR`, one per line, written whole (a
    /// temporary file renamed into place): a reader sees the old file or the whole new one.
    pub fn write_addresses(&self, file: &Path) -> Result<(), StartError> {
        use std::fmt::Write as _;
        let mut text = String::new();
        for a in &self.listeners {
            let _ = writeln!(text, "listener {a}");
        }
        if let Some(a) = self.admin {
            let _ = writeln!(text, "admin {a}");
        }
        if let Some(a) = self.rls {
            let _ = writeln!(text, "rls {a}");
        }
        let failed = |source| StartError::AddressFile {
            path: file.to_path_buf(),
            source,
        };
        let partial = file.with_extension("partial");
        std::fs::write(&partial, text).map_err(failed)?;
        std::fs::rename(&partial, file).map_err(failed)
    }

    /// Wait until the proxy has stopped: the shutdown future resolved and the drain is over.
    pub async fn stopped(self) {
        let _ = self.stopped.await;
    }
}

/// Run the proxy with the config at `path` until SIGTERM or SIGINT; once it serves, write the
/// bound addresses to `address_file` if given.
pub async fn run(path: &Path, address_file: Option<&Path>) -> Result<(), StartError> {
    // Signal handlers go in before the first "listening" line, so that nobody who saw it can
    // kill the process with a SIGHUP or SIGTERM meant for it.
    let shutdown = shutdown_signal();
    reopen_access_log_on_sigusr1();
    let options = Options {
        sighup: true,
        ..Options::default()
    };
    let running = start(path, options, shutdown).await?;
    if let Some(file) = address_file {
        running.write_addresses(file)?;
    }
    running.stopped().await;
    Ok(())
}

/// Load the config at `path`, bind its listeners and serve them until `shutdown` resolves,
/// then drain. Returns once the listeners are bound and serving; the config file is watched
/// for reloads like the binary's.
///
/// The proxy listeners are served by one single-threaded runtime per worker (thread per core,
/// like nginx's workers): a request's tasks (downstream connection, upstream connection) wake
/// each other on one thread instead of bouncing between cores. The calling runtime keeps the
/// control work: reload, the admin listener, the sweeper and Redis connections.
pub async fn start(
    path: &Path,
    options: Options,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<Running, StartError> {
    let count = if options.inline {
        1
    } else {
        options.workers.unwrap_or_else(worker_count)
    };
    let workers = Arc::new(Workers::new(count));
    let metrics = Metrics::new();
    let settings = config::load(path)?;
    let runtime = Runtime::build(settings, None, &workers, &metrics)?;
    let (sockets, admin, rls) = bind(&runtime.settings, workers.count()).await?;
    let (routes, limits) = (runtime.routes.len(), runtime.limits().count());
    let state = Arc::new(State::new(runtime, workers.clone(), metrics));
    let (stop_tx, stop_rx) = watch::channel(false);
    // The admin listener outlives the proxy listeners: it answers (`/readyz` 503) until the
    // drain is over.
    let (admin_stop_tx, admin_stop_rx) = watch::channel(false);
    let reloader = crate::reload::start(path.to_path_buf(), state.clone(), stop_rx.clone());
    if options.sighup {
        crate::reload::watch_sighup(reloader.clone());
    }
    tokio::spawn(sweep(state.clone(), stop_rx.clone()));
    tokio::spawn(return_leases(state.clone(), stop_rx.clone()));
    tokio::spawn(memory::watch(state.clone(), stop_rx.clone()));
    start_control(&state, stop_rx.clone()).await;
    let (bound, per_worker) = per_worker(sockets, &state);
    let (threads, inline) = spawn_workers(options.inline, per_worker, &state, &stop_rx)?;
    let admin_address = admin.and_then(|admin| serve_admin(admin, &state, admin_stop_rx));
    let rls = rls.and_then(|rls| listen::serve_rls(rls, &state, stop_rx.clone()));
    let limiter = state.runtime.load().settings.limiter.backend.describe();
    tracing::info!(config = %path.display(), routes, limits, workers = workers.count(), %limiter, "tollgate started");
    for warning in state.runtime.load().settings.warnings() {
        tracing::warn!("{warning}");
    }
    let stopping = Stopping {
        state: state.clone(),
        stop: stop_tx,
        admin_stop: admin_stop_tx,
        inline,
        threads,
    };
    let stopped = tokio::spawn(async move {
        shutdown.await;
        stopping.run().await;
    });
    Ok(Running {
        listeners: bound,
        admin: admin_address,
        rls,
        generation: state.generation.subscribe(),
        reloader,
        state,
        stopped,
    })
}

/// Load the operators' entries Redis holds, so they are in force from the first request, then
/// poll for their changes (and sweep the expired ones) until `stop`.
async fn start_control(state: &Arc<State>, stop: watch::Receiver<bool>) {
    let control = state.control.clone();
    control
        .load_at_start(state.runtime.load().redis.clone())
        .await;
    let polled = state.clone();
    let redis_of = move || polled.runtime.load().redis.clone();
    tokio::spawn(crate::control::run(control, redis_of, stop));
}

/// What the shutdown stops, in order.
struct Stopping {
    state: Arc<State>,
    /// Tells the proxy listeners (and the reloader, the sweeper) to stop.
    stop: watch::Sender<bool>,
    /// Tells the admin listener to stop.
    admin_stop: watch::Sender<bool>,
    inline: Option<tokio::task::JoinHandle<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Stopping {
    /// Readiness fails first; the listeners go on accepting for `shutdown_delay` (the time a
    /// load balancer, a Kubernetes endpoint update, takes to stop sending here), then stop and
    /// drain; the admin listener goes last, so `/readyz` answers 503 until the very end.
    async fn run(self) {
        self.state.begin_draining();
        let delay = self.state.runtime.load().settings.shutdown_delay;
        if !delay.is_zero() {
            tracing::info!(
                ?delay,
                "shutting down: readiness fails; still accepting for shutdown_delay"
            );
            tokio::time::sleep(delay).await;
        }
        tracing::info!("shutting down: no new connections, draining in-flight requests");
        let _ = self.stop.send(true);
        if let Some(inline) = self.inline {
            let _ = inline.await;
        }
        let threads = self.threads;
        let tracer = self.state.runtime.load().tracer.clone();
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
            // The workers handed their last lines over as they ended, and their spans.
            crate::access_log::sync(Duration::from_secs(5));
            if let Some(tracer) = tracer {
                tracer.flush(Duration::from_secs(5));
            }
        })
        .await;
        let _ = self.admin_stop.send(true);
        tracing::info!("stopped");
    }
}

/// Forget full buckets periodically so memory follows the active clients, not all clients ever,
/// and close upstream connections that sat idle past their timeout.
async fn sweep(state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(SWEEP_EVERY);
    // Connections open at the last sweep.
    let mut was_open = 0;
    // What Redis's `INFO` said at the last look.
    let mut redis_seen = memory::RedisSeen::default();
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = every.tick() => {}
        }
        let runtime = state.runtime.load_full();
        if let Some(r) = &runtime.redis {
            redis_seen = memory::look_at_redis(&state, r, redis_seen).await;
        }
        let now = state.clock.now().us();
        let mut forgotten = 0;
        for limit in runtime.limits() {
            forgotten += limit.local.sweep(now);
            if let Some(bans) = &limit.bans {
                forgotten += bans.sweep(now);
            }
        }
        for upstream in &runtime.upstreams {
            upstream.expire_idle();
        }
        // Connections that closed freed their buffers on the workers' heaps, which mimalloc
        // keeps until those threads free more: fewer connections than at the last sweep are
        // worth handing back (a walk of each heap every few seconds at most).
        let open = state.metrics.open_connections.get();
        let closed = open < was_open;
        was_open = open;
        if forgotten >= COLLECT_AFTER_FORGETTING || closed {
            // This thread freed the buckets, but most were allocated by the workers: the pages
            // are theirs, so each worker collects its own heap too.
            tollgate_alloc::collect();
            state
                .workers
                .on_every(|_| async { tollgate_alloc::collect() });
        }
    }
}

/// How often leased tokens whose hold ended go back to Redis: a quiet identity's tokens are
/// back within its hold plus this.
const LEASES_EVERY: Duration = Duration::from_millis(100);

/// Give leased tokens back to Redis once their hold ends (see `limiter::leasing`).
async fn return_leases(state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(LEASES_EVERY);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = every.tick() => {}
        }
        let runtime = state.runtime.load();
        let Some(redis) = &runtime.redis else {
            continue;
        };
        let now = state.clock.now().us();
        for limit in runtime.limits() {
            let Some(leases) = &limit.leases else {
                continue;
            };
            for back in leases.sweep(now) {
                redis.give_back(limit, back);
            }
        }
    }
}

/// Buckets forgotten by one sweep (about 80 bytes each) worth handing memory back for: the
/// allocator keeps freed pages for a while (mimalloc's purge delay, and until the thread that
/// owns them frees again), so a proxy that went idle after a flood would keep its peak RSS.
/// `tollgate_alloc::collect` hands them back at once (the binary's global allocator is
/// `tollgate_alloc::Allocator`; under another one this only walks an empty heap).
const COLLECT_AFTER_FORGETTING: usize = 10_000;

/// Reopen the access-log file on SIGUSR1 (logrotate's `postrotate`), from now on.
fn reopen_access_log_on_sigusr1() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut usr1) = signal(SignalKind::user_defined1()) else {
            return;
        };
        tokio::spawn(async move {
            while usr1.recv().await.is_some() {
                tracing::info!("SIGUSR1: reopening the access log");
                crate::access_log::reopen();
            }
        });
    }
}

/// Resolves on SIGTERM or SIGINT; a second one of either, during the delay or the drain, ends
/// the process at once (exit status 128 + the signal's number, as a shell reports a process
/// that signal killed). Once installed, tokio's handlers stay for the life of the process, so
/// without this a second signal would be caught and ignored: an operator's "stop now" (a
/// second Ctrl-C, `docker stop`'s repeat) must still work. The handlers are installed when
/// this is called, not when the future is first polled.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let signals = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        );
        async move {
            let (Ok(mut term), Ok(mut int)) = signals else {
                let _ = tokio::signal::ctrl_c().await;
                return;
            };
            let (first, _) = next_signal(&mut term, &mut int).await;
            tracing::info!(
                signal = first,
                "graceful shutdown; a second signal stops at once"
            );
            tokio::spawn(async move {
                let (second, number) = next_signal(&mut term, &mut int).await;
                tracing::warn!(
                    signal = second,
                    "second signal: stopping now, without draining"
                );
                std::process::exit(128 + number);
            });
        }
    }
    #[cfg(not(unix))]
    async move {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The next SIGTERM or SIGINT: its name and number.
#[cfg(unix)]
async fn next_signal(
    term: &mut tokio::signal::unix::Signal,
    int: &mut tokio::signal::unix::Signal,
) -> (&'static str, i32) {
    tokio::select! {
        _ = term.recv() => ("SIGTERM", 15),
        _ = int.recv() => ("SIGINT", 2),
    }
}
