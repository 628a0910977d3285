//! Wiring: load the config, build the shared state, bind, serve, and drain on shutdown.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::config::{self, ConfigError};
use crate::proxy::State;
use crate::server;

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("cannot set up the Redis client: {0}")]
    Redis(String),
    #[error("cannot start a worker thread: {0}")]
    Worker(std::io::Error),
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// How often idle (full) buckets are forgotten.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// How many worker threads serve the proxy listeners: `TOLLGATE_WORKERS`, else one per core.
fn worker_count() -> usize {
    std::env::var("TOLLGATE_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n: &usize| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// Bind `address` once per worker with SO_REUSEPORT, so the kernel spreads connections over
/// the workers. The first socket resolves port 0; the others join it on that port.
fn bind_shared(
    address: SocketAddr,
    workers: usize,
) -> Result<Vec<std::net::TcpListener>, StartError> {
    let bind = |at: SocketAddr| -> std::io::Result<std::net::TcpListener> {
        let socket = Socket::new(Domain::for_address(at), Type::STREAM, Some(Protocol::TCP))?;
        socket.set_reuse_address(true)?;
        #[cfg(unix)]
        socket.set_reuse_port(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&at.into())?;
        socket.listen(1024)?;
        Ok(socket.into())
    };
    let err = |source| StartError::Bind { address, source };
    let first = bind(address).map_err(err)?;
    let resolved = first.local_addr().map_err(err)?;
    let mut all = vec![first];
    for _ in 1..workers {
        all.push(bind(resolved).map_err(err)?);
    }
    Ok(all)
}

/// Run the proxy with the config at `path` until SIGTERM or SIGINT.
///
/// The proxy listeners are served by one single-threaded runtime per core (thread per core,
/// like nginx's workers): a request's tasks (downstream connection, upstream connection) wake
/// each other on one thread instead of bouncing between cores. This runtime keeps the control
/// work: signals, reload, the admin listener, the sweeper and Redis connections.
pub async fn run(path: &Path) -> Result<(), StartError> {
    let workers = worker_count();
    crate::forward::set_workers(workers);
    let mut snapshot = config::load(path, None)?;
    snapshot.attach_redis(None).map_err(StartError::Redis)?;
    let mut sockets = Vec::new();
    for l in &snapshot.listeners {
        sockets.push((l.clone(), bind_shared(l.address, workers)?));
    }
    let admin = match snapshot.admin {
        Some(address) => Some(
            TcpListener::bind(address)
                .await
                .map_err(|source| StartError::Bind { address, source })?,
        ),
        None => None,
    };
    let (routes, limits) = (snapshot.routes.len(), snapshot.limits().count());
    let state = Arc::new(State::new(snapshot));
    let (stop_tx, stop_rx) = watch::channel(false);
    // Signal handlers go in before the first "listening" line, so that nobody who saw it can
    // kill the process with a SIGHUP or SIGTERM meant for it.
    let shutdown = shutdown_signal();
    config::reload::start(path.to_path_buf(), state.clone(), stop_rx.clone());
    tokio::spawn(sweep(state.clone(), stop_rx.clone()));
    let mut per_worker: Vec<Vec<WorkerListener>> = (0..workers).map(|_| Vec::new()).collect();
    for (l, socks) in sockets {
        if let Some(bound) = socks.first().and_then(|s| s.local_addr().ok()) {
            tracing::info!(address = %bound, "listening");
        }
        let slots = Arc::new(Semaphore::new(l.settings.max_connections));
        let (balance, inboxes) = server::Balance::new(workers, &state.metrics);
        for (w, (sock, inbox)) in socks.into_iter().zip(inboxes).enumerate() {
            per_worker[w].push(WorkerListener {
                socket: sock,
                listener: l.clone(),
                slots: slots.clone(),
                balance: balance.clone(),
                inbox,
            });
        }
    }
    let threads: Vec<_> = per_worker
        .into_iter()
        .enumerate()
        .map(|(id, listeners)| spawn_worker(id, listeners, state.clone(), stop_rx.clone()))
        .collect::<Result<_, _>>()
        .map_err(StartError::Worker)?;
    if let Some(admin) = admin {
        if let Ok(bound) = admin.local_addr() {
            tracing::info!(address = %bound, "admin endpoints");
        }
        tokio::spawn(crate::admin::serve(admin, state.clone(), stop_rx.clone()));
    }
    tracing::info!(config = %path.display(), routes, limits, workers, "tollgate started");

    shutdown.await;
    tracing::info!("shutting down: no new connections, draining in-flight requests");
    let _ = stop_tx.send(true);
    let _ = tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await;
    tracing::info!("stopped");
    Ok(())
}

/// One worker's socket for one configured listener.
struct WorkerListener {
    socket: std::net::TcpListener,
    listener: config::Listener,
    slots: Arc<Semaphore>,
    balance: Arc<server::Balance>,
    inbox: tokio::sync::mpsc::UnboundedReceiver<server::Handoff>,
}

fn spawn_worker(
    id: usize,
    listeners: Vec<WorkerListener>,
    state: Arc<State>,
    stop: watch::Receiver<bool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("tollgate-worker-{id}"))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, worker = id, "cannot start a worker runtime");
                    return;
                }
            };
            crate::forward::register_worker(id, runtime.handle().clone());
            // Open this worker's Redis connection now, not on its first check.
            if let Some(redis) = state.config.load().redis.clone() {
                runtime.spawn(async move { redis.warm_up_worker().await });
            }
            runtime.block_on(async move {
                let mut loops = Vec::new();
                for wl in listeners {
                    let listener = match TcpListener::from_std(wl.socket) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "cannot register a listener");
                            continue;
                        }
                    };
                    let l = server::Listening {
                        listener,
                        configured: wl.listener.address,
                        settings: wl.listener.settings.clone(),
                        tls: wl.listener.tls.as_ref().map(|t| t.config.clone()),
                        slots: wl.slots,
                        balance: wl.balance,
                        worker: id,
                        inbox: wl.inbox,
                    };
                    loops.push(tokio::spawn(server::serve(l, state.clone(), stop.clone())));
                }
                for l in loops {
                    let _ = l.await;
                }
            });
        })
}

/// Forget full buckets periodically so memory follows the active clients, not all clients ever,
/// and close upstream connections that sat idle past their timeout.
async fn sweep(state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(SWEEP_EVERY);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = every.tick() => {}
        }
        let snapshot = state.config.load_full();
        let now = state.clock.now_us();
        let mut forgotten = 0;
        for limit in snapshot.limits() {
            forgotten += limit.local.sweep(now);
        }
        for upstream in snapshot.upstreams() {
            upstream.expire_idle();
        }
        if forgotten >= COLLECT_AFTER_FORGETTING {
            // This thread freed the buckets, but most were allocated by the workers: the pages
            // are theirs, so each worker collects its own heap too.
            tollgate_alloc::collect();
            crate::forward::on_every_worker(|| async { tollgate_alloc::collect() });
        }
    }
}

/// Buckets forgotten by one sweep (about 80 bytes each) worth handing memory back for: the
/// allocator keeps freed pages for a while (mimalloc's purge delay, and until the thread that
/// owns them frees again), so a proxy that went idle after a flood would keep its peak RSS.
/// `tollgate_alloc::collect` hands them back at once (the binary's global allocator is
/// `tollgate_alloc::Allocator`; under another one this only walks an empty heap).
const COLLECT_AFTER_FORGETTING: usize = 10_000;

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called, not when
/// the future is first polled.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    #[cfg(unix)]
    let int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt());
    async move {
        #[cfg(unix)]
        match (term, int) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}
