//! The listeners bound (one socket per worker) and dealt to the workers, the worker threads
//! started, and the admin listener served.

use std::net::SocketAddr;
use std::sync::Arc;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use super::StartError;
use crate::config;
use crate::server;
use crate::state::State;

/// How many worker threads serve the proxy listeners: `TOLLGATE_WORKERS`, else one per core.
pub(super) fn worker_count() -> usize {
    std::env::var("TOLLGATE_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n: &usize| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// Bind `address` once per worker with SO_REUSEPORT, so the kernel spreads connections over
/// the workers. The first socket resolves port 0; the others join it on that port.
///
/// SO_REUSEPORT would let a second process on the same port take a share of its connections
/// (and double every in-process limit), so unless `share` says that is meant, the port is
/// first bound alone, without SO_REUSEPORT: that fails if anyone listens there already.
pub(super) fn bind_shared(
    address: SocketAddr,
    workers: usize,
    share: bool,
) -> Result<Vec<std::net::TcpListener>, StartError> {
    if !share && address.port() != 0 {
        let alone = Socket::new(
            Domain::for_address(address),
            Type::STREAM,
            Some(Protocol::TCP),
        )
        .and_then(|s| s.set_reuse_address(true).map(|()| s))
        .and_then(|s| s.bind(&address.into()));
        alone.map_err(|source| StartError::Bind { address, source })?;
    }
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

/// Every proxy listener's sockets (one per worker) and the admin listener, bound.
pub(super) async fn bind(settings: &config::Settings, workers: usize) -> Result<Bound, StartError> {
    let mut sockets = Vec::new();
    for l in &settings.listeners {
        sockets.push((
            l.clone(),
            bind_shared(l.address, workers, l.settings.share_port)?,
        ));
    }
    let bind = |address: SocketAddr| async move {
        TcpListener::bind(address)
            .await
            .map_err(|source| StartError::Bind { address, source })
    };
    let admin = match settings.admin {
        Some(address) => Some(bind(address).await?),
        None => None,
    };
    let rls = match &settings.rls {
        Some(rls) => Some(bind(rls.address).await?),
        None => None,
    };
    Ok((sockets, admin, rls))
}

/// Serve the rate limit service on `listener` until `stop`; its bound address.
pub(super) fn serve_rls(
    listener: TcpListener,
    state: &Arc<State>,
    stop: watch::Receiver<bool>,
) -> Option<SocketAddr> {
    let address = listener.local_addr().ok();
    if let Some(address) = address {
        tracing::info!(%address, "rate limit service (envoy.service.ratelimit.v3)");
    }
    tokio::spawn(crate::rls::serve(listener, state.clone(), stop));
    address
}

/// The proxy listeners' sockets (each listener's, one per worker), and the admin and rate
/// limit service listeners.
type Bound = (
    Vec<(config::settings::Listener, Vec<std::net::TcpListener>)>,
    Option<TcpListener>,
    Option<TcpListener>,
);

/// The listeners' sockets dealt to the workers, each listener with its connection cap and
/// balancer; and the addresses bound, logged.
pub(super) fn per_worker(
    sockets: Vec<(config::settings::Listener, Vec<std::net::TcpListener>)>,
    state: &Arc<State>,
) -> (Vec<SocketAddr>, Vec<Vec<WorkerListener>>) {
    let count = state.workers.count();
    let mut bound = Vec::new();
    let mut per_worker: Vec<Vec<WorkerListener>> = (0..count).map(|_| Vec::new()).collect();
    for (l, socks) in sockets {
        if let Some(address) = socks.first().and_then(|s| s.local_addr().ok()) {
            tracing::info!(%address, "listening");
            bound.push(address);
        }
        let slots = Arc::new(Semaphore::new(l.settings.max_connections));
        let (balance, inboxes) = server::WorkerBalancer::new(count, &state.metrics);
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
    (bound, per_worker)
}

/// The workers as they run: a thread each, or one task on the calling runtime.
pub(super) type Started = (
    Vec<std::thread::JoinHandle<()>>,
    Option<tokio::task::JoinHandle<()>>,
);

/// The workers started: a thread each, or with `inline` one task on the calling runtime.
pub(super) fn spawn_workers(
    inline: bool,
    per_worker: Vec<Vec<WorkerListener>>,
    state: &Arc<State>,
    stop: &watch::Receiver<bool>,
) -> Result<Started, StartError> {
    if inline {
        let listeners = per_worker.into_iter().next().unwrap_or_default();
        let worker = tokio::spawn(serve_worker(0, listeners, state.clone(), stop.clone()));
        return Ok((Vec::new(), Some(worker)));
    }
    let threads: Vec<_> = per_worker
        .into_iter()
        .enumerate()
        .map(|(id, listeners)| spawn_worker(id, listeners, state.clone(), stop.clone()))
        .collect::<Result<_, _>>()
        .map_err(StartError::Worker)?;
    Ok((threads, None))
}

/// Serve the admin listener until `stop`; its address, logged.
pub(super) fn serve_admin(
    admin: TcpListener,
    state: &Arc<State>,
    stop: watch::Receiver<bool>,
) -> Option<SocketAddr> {
    let address = admin.local_addr().ok();
    if let Some(address) = address {
        tracing::info!(%address, "admin endpoints");
    }
    tokio::spawn(crate::admin::serve(admin, state.clone(), stop));
    address
}

/// One worker's socket for one configured listener.
pub(super) struct WorkerListener {
    socket: std::net::TcpListener,
    listener: config::settings::Listener,
    slots: Arc<Semaphore>,
    balance: Arc<server::WorkerBalancer>,
    inbox: tokio::sync::mpsc::UnboundedReceiver<server::Handoff>,
}

/// A worker thread: a single-threaded runtime of its own serving `listeners`.
pub(super) fn spawn_worker(
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
            runtime.block_on(serve_worker(id, listeners, state, stop));
        })
}

/// Serve worker `id`'s listeners on the current runtime until `stop` and the drain end.
pub(super) async fn serve_worker(
    id: usize,
    listeners: Vec<WorkerListener>,
    state: Arc<State>,
    stop: watch::Receiver<bool>,
) {
    state.workers.started(id, tokio::runtime::Handle::current());
    // Open this worker's Redis connection now, not on its first check.
    if let Some(redis) = state.runtime.load().redis.clone() {
        tokio::spawn(async move { redis.warm_up_worker(id).await });
    }
    let mut loops = Vec::new();
    if crate::access_log::enabled() {
        loops.push(tokio::spawn(crate::access_log::flush_periodically(
            stop.clone(),
        )));
    }
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
}
