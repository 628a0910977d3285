//! The accept loop: one task per connection, HTTP/1.1 and HTTP/2 (h2c prior knowledge) on every
//! listener, connections watched so shutdown can drain them.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::proxy::{self, Conn, State};

/// The connection settings shared by every listener.
pub fn builder() -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10))
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(100)
        .keep_alive_interval(Some(Duration::from_secs(30)));
    b
}

/// Accept connections on `listener` until `stop` flips to true, then let the open connections
/// finish their in-flight requests for up to `drain` and return.
pub async fn serve(
    listener: TcpListener,
    state: Arc<State>,
    builder: Arc<auto::Builder<TokioExecutor>>,
    mut stop: watch::Receiver<bool>,
    drain: Duration,
) {
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let conn = Conn { peer, tls: false };
        let service_state = state.clone();
        let service = service_fn(move |req| {
            let state = service_state.clone();
            async move { Ok::<_, Infallible>(proxy::handle(&state, conn, req).await) }
        });
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        let open = state.metrics.open_connections.clone();
        open.inc();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            open.dec();
        });
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("drain timed out; closing the remaining connections");
    }
}
