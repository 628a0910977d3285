//! Wiring: load the config, build the shared state, bind, serve, and drain on shutdown.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

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
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// How often idle (full) buckets are forgotten.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// Run the proxy with the config at `path` until SIGTERM or SIGINT.
pub async fn run(path: &Path) -> Result<(), StartError> {
    let mut snapshot = config::load(path, None)?;
    snapshot.attach_redis(None).map_err(StartError::Redis)?;
    let mut listeners = Vec::new();
    for l in &snapshot.listeners {
        let tcp = TcpListener::bind(l.address)
            .await
            .map_err(|source| StartError::Bind {
                address: l.address,
                source,
            })?;
        listeners.push(server::Listening {
            listener: tcp,
            configured: l.address,
            settings: l.settings.clone(),
            tls: l.tls.as_ref().map(|t| t.config.clone()),
        });
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
    let mut accept_loops = Vec::new();
    for l in listeners {
        if let Ok(bound) = l.listener.local_addr() {
            tracing::info!(address = %bound, "listening");
        }
        accept_loops.push(tokio::spawn(server::serve(
            l,
            state.clone(),
            stop_rx.clone(),
        )));
    }
    if let Some(admin) = admin {
        if let Ok(bound) = admin.local_addr() {
            tracing::info!(address = %bound, "admin endpoints");
        }
        tokio::spawn(crate::admin::serve(admin, state.clone(), stop_rx.clone()));
    }
    tracing::info!(config = %path.display(), routes, limits, "tollgate started");

    shutdown.await;
    tracing::info!("shutting down: no new connections, draining in-flight requests");
    let _ = stop_tx.send(true);
    for l in accept_loops {
        let _ = l.await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Forget full buckets periodically so memory follows the active clients, not all clients ever.
async fn sweep(state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(SWEEP_EVERY);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = every.tick() => {}
        }
        let snapshot = state.config.load_full();
        let now = state.clock.now_us();
        for limit in snapshot.limits() {
            limit.local.sweep(now);
        }
    }
}

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
