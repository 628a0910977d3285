//! The rate limit service's listener: gRPC over HTTP/2 (cleartext, or TLS with `rls.tls`),
//! each connection's peer address handed to the service.

use std::convert::Infallible;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower_service::Service as _;

use super::pb::rate_limit_service_server::RateLimitServiceServer;
use super::{Peer, Service};
use crate::state::State;

/// Serve `listener` until `stop`: TLS when `rls.tls` was given as the service started.
pub async fn serve(listener: TcpListener, state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let tls = (state.runtime.load().settings.rls.as_ref())
        .and_then(|r| r.tls.as_ref())
        .map(|t| crate::tls::acceptor(t.config.clone()));
    let grpc = RateLimitServiceServer::new(Service::new(state));
    let mut builder = auto::Builder::new(TokioExecutor::new()).http2_only();
    builder.http2().timer(TokioTimer::new());
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(_) => continue,
            },
        };
        let _ = stream.set_nodelay(true);
        let grpc = grpc.clone();
        let service = service_fn(move |mut req: Request<Incoming>| {
            req.extensions_mut().insert(Peer(peer.ip()));
            let mut grpc = grpc.clone();
            async move { Ok::<_, Infallible>(grpc.call(req).await.unwrap_or_else(|e| match e {})) }
        });
        let (builder, tls) = (builder.clone(), tls.clone());
        tokio::spawn(async move {
            let served = match tls {
                Some(tls) => match tls.accept(stream).await {
                    Ok(stream) => {
                        builder
                            .serve_connection(TokioIo::new(stream), service)
                            .await
                    }
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "rls: TLS handshake failed");
                        return;
                    }
                },
                None => {
                    builder
                        .serve_connection(TokioIo::new(stream), service)
                        .await
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "rls: connection ended with an error");
            }
        });
    }
}
