//! The accept loop: one task per connection, HTTP/1.1 and HTTP/2 on every listener (h2c prior
//! knowledge in plain text, ALPN over TLS), connections watched so shutdown can drain them.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::proxy::{self, Conn, State};

/// A TLS handshake that has not finished by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

type Builder = Arc<auto::Builder<TokioExecutor>>;

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

/// Accept connections on `listener` (configured as `configured`) until `stop` flips to true,
/// then let the open connections finish their in-flight requests for up to the live config's
/// `shutdown_timeout` and return. Idle keep-alive connections close at once (HTTP/2: GOAWAY).
pub async fn serve(
    listener: TcpListener,
    configured: SocketAddr,
    state: Arc<State>,
    builder: Builder,
    mut stop: watch::Receiver<bool>,
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
        // The live config's certificates: a reload that changes them applies to the next
        // handshake without rebinding.
        let tls = state
            .config
            .load()
            .listeners
            .iter()
            .find(|l| l.address == configured)
            .and_then(|l| l.tls.as_ref().map(|t| t.config.clone()));
        let task = Connection {
            state: state.clone(),
            builder: builder.clone(),
            watcher: graceful.watcher(),
            peer,
        };
        tokio::spawn(task.run(stream, tls));
    }
    drop(listener);
    let drain = state.config.load().shutdown_timeout;
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("drain timed out; closing the remaining connections");
    }
}

/// One accepted connection and what serving it needs.
struct Connection {
    state: Arc<State>,
    builder: Builder,
    watcher: Watcher,
    peer: SocketAddr,
}

impl Connection {
    async fn run(self, stream: TcpStream, tls: Option<Arc<rustls::ServerConfig>>) {
        let Some(tls) = tls else {
            return self.serve(stream, false).await;
        };
        let acceptor = crate::tls::acceptor(tls);
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
            Ok(Ok(stream)) => self.serve(stream, true).await,
            Ok(Err(e)) => tracing::debug!(peer = %self.peer, error = %e, "TLS handshake failed"),
            Err(_) => tracing::debug!(peer = %self.peer, "TLS handshake timed out"),
        }
    }

    async fn serve<I>(self, io: I, tls: bool)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let conn = Conn {
            peer: self.peer,
            tls,
        };
        let state = self.state.clone();
        let service = service_fn(move |req| {
            let state = state.clone();
            async move { Ok::<_, Infallible>(proxy::handle(&state, conn, req).await) }
        });
        let connection = self
            .builder
            .serve_connection_with_upgrades(TokioIo::new(io), service)
            .into_owned();
        let open = self.state.metrics.open_connections.clone();
        open.inc();
        if let Err(e) = self.watcher.watch(connection).await {
            tracing::debug!(peer = %self.peer, error = %e, "connection ended with an error");
        }
        open.dec();
    }
}
