//! The accept loop: one task per connection, HTTP/1.1 and HTTP/2 on every listener (h2c prior
//! knowledge in plain text, ALPN over TLS), connections watched so shutdown can drain them.
//!
//! `balance` spreads connections over the workers, `connection` serves one, `watchdog` times
//! it out.

mod balance;
mod connection;
mod request_line;
mod watchdog;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinSet;

pub use crate::config::settings::ListenerSettings;
use crate::state::State;
use balance::{pass, Seat};
pub use balance::{Handoff, WorkerBalancer};
use connection::Connection;

type Builder = Arc<auto::Builder<TokioExecutor>>;

/// hyper's smallest HTTP/1 read buffer (it panics below it).
const MIN_READ_BUFFER: usize = 8192;

/// The HTTP/1.1 and HTTP/2 settings of one listener. hyper's own defaults are set explicitly
/// where they differ from ours: its header read timeout needs a timer, and it has no idle,
/// body or connection-count limits (those live in this module and in `body`).
pub fn builder(s: &ListenerSettings) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    // hyper's header read timeout would also cut keep-alive idle time to the same value; the
    // connection watchdog below times heads and idleness separately instead.
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(s.max_header_bytes.max(MIN_READ_BUFFER))
        .max_headers(s.max_headers)
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(s.h2_max_concurrent_streams)
        .initial_stream_window_size(s.h2_stream_window)
        .initial_connection_window_size(s.h2_connection_window)
        .max_header_list_size(s.h2_max_header_list)
        // Rapid reset (CVE-2023-44487): streams a client opens and resets at once count here,
        // and past the cap the connection is closed with GOAWAY.
        .max_pending_accept_reset_streams(Some(20))
        .max_local_error_reset_streams(Some(256))
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20));
    b
}

/// One listening socket and how to serve it.
pub struct Listening {
    pub listener: TcpListener,
    /// The address as configured (the key to its live TLS settings across reloads).
    pub configured: SocketAddr,
    pub settings: ListenerSettings,
    /// The certificates it was bound with; `None`: a plain-text port for its whole life.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// The listener's `max_connections`, shared by the workers serving it.
    pub slots: Arc<Semaphore>,
    /// How the listener's connections are spread over the workers, and this worker's number.
    pub balance: Arc<WorkerBalancer>,
    pub worker: usize,
    /// Connections other workers accepted and passed to this one.
    pub inbox: mpsc::UnboundedReceiver<Handoff>,
}

/// Accept connections until `stop` flips to true, then let the open connections finish their
/// in-flight requests for up to the live config's `shutdown_timeout` and return. Idle
/// keep-alive connections close at once (HTTP/2: GOAWAY).
// The accept loop and its drain share the listener's state; split, each would take all of it.
#[allow(clippy::too_many_lines)]
pub async fn serve(l: Listening, state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let settings = Arc::new(l.settings);
    let builder = Arc::new(builder(&settings));
    let slots = l.slots.clone();
    let (balance, me, mut inbox) = (l.balance, l.worker, l.inbox);
    let mut connections = JoinSet::new();
    loop {
        let (stream, peer, slot) = tokio::select! {
            _ = stop.changed() => break,
            Some(passed) = inbox.recv() => match TcpStream::from_std(passed.stream) {
                Ok(stream) => (stream, passed.peer, passed.slot),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot take over a connection from another worker");
                    balance.unseat(me);
                    continue;
                }
            },
            accepted = l.listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if state.memory_over.load(std::sync::atomic::Ordering::Relaxed) {
                        // Past `max_rss`: a new connection would only add to it.
                        state.metrics.memory_refused_connections.inc();
                        drop(stream);
                        continue;
                    }
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        // At the cap: close at once rather than queue, so a flood costs a
                        // socket each.
                        state.metrics.connections_refused.inc();
                        drop(stream);
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    match pass(&balance, me, stream, peer, slot) {
                        Some(mine) => mine,
                        None => continue,
                    }
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        while connections.try_join_next().is_some() {}
        let task = Connection {
            state: state.clone(),
            builder: builder.clone(),
            settings: settings.clone(),
            stop: stop.clone(),
            peer,
            worker: me,
            _slot: slot,
            _seat: Seat {
                balance: balance.clone(),
                worker: me,
            },
        };
        let tls = live_tls(&state, l.configured, l.tls.as_ref());
        connections.spawn(task.run(stream, tls));
    }
    drop(l.listener);
    // From now on, a connection another worker passes here is served by that worker.
    drop(inbox);
    let drain = state.runtime.load().settings.shutdown_timeout;
    close_queues(&state, drain);
    let drained = tokio::time::timeout(drain, async {
        while connections.join_next().await.is_some() {}
    });
    if drained.await.is_err() {
        tracing::warn!(
            left = connections.len(),
            "drain timed out; closing the remaining connections"
        );
        connections.shutdown().await;
    }
}

/// Requests waiting for a capped upstream's slot are answered `503` before the drain of
/// `drain` ends, if their turn has not come by then: never cut without an answer.
fn close_queues(state: &State, drain: Duration) {
    // Time to write the 503s before the connections close.
    let margin = (drain / 2).min(Duration::from_secs(1));
    let by = tokio::time::Instant::now() + drain.saturating_sub(margin);
    for upstream in &state.runtime.load().upstreams {
        if let Some(gate) = &upstream.gate {
            gate.close_by(by);
        }
    }
}

/// The certificates for the next handshake on this listener. Whether a port speaks TLS is
/// fixed when it is bound (a reload never turns a TLS port into a plain one, or back); which
/// certificates it presents follow the live config while it still has a TLS listener at this
/// address, and stay as they were otherwise.
fn live_tls(
    state: &State,
    configured: SocketAddr,
    initial: Option<&Arc<rustls::ServerConfig>>,
) -> Option<Arc<rustls::ServerConfig>> {
    let initial = initial?;
    let live = state
        .runtime
        .load()
        .settings
        .listeners
        .iter()
        .find(|l| l.address == configured)
        .and_then(|l| l.tls.as_ref().map(|t| t.config.clone()));
    Some(live.unwrap_or_else(|| initial.clone()))
}
