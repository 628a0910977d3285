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

/// How long in-flight requests may take to finish once shutdown starts.
const DRAIN: Duration = Duration::from_secs(30);

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
        let bound = tcp.local_addr().unwrap_or(l.address);
        tracing::info!(address = %bound, "listening");
        listeners.push(tcp);
    }
    tracing::info!(
        config = %path.display(),
        routes = snapshot.routes.len(),
        limits = snapshot.limits().count(),
        "tollgate started"
    );
    let state = Arc::new(State::new(snapshot));
    let (stop_tx, stop_rx) = watch::channel(false);
    let builder = Arc::new(server::builder());
    let mut accept_loops = Vec::new();
    for tcp in listeners {
        accept_loops.push(tokio::spawn(server::serve(
            tcp,
            state.clone(),
            builder.clone(),
            stop_rx.clone(),
            DRAIN,
        )));
    }
    tokio::spawn(sweep(state.clone(), stop_rx.clone()));

    shutdown_signal().await;
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

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
