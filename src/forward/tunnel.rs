//! WebSocket tunnels: the two upgraded sockets copied both ways until one closes or both idle.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::header::{CONNECTION, UPGRADE};
use http::HeaderMap;
use hyper_util::rt::TokioIo;

use crate::io::ReadNoted;

/// `Connection: upgrade` with `Upgrade: websocket` (HTTP/1.1 only; the limit was already
/// checked on this handshake request).
pub(super) fn is_websocket_upgrade(headers: &HeaderMap) -> bool {
    let connection_upgrade = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    connection_upgrade
        && headers
            .get(UPGRADE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("websocket"))
}

/// The two sides of a WebSocket tunnel, once both have switched protocols.
#[derive(Debug)]
pub struct Tunnel {
    pub(super) client: hyper::upgrade::OnUpgrade,
    pub(super) upstream: hyper::upgrade::OnUpgrade,
    /// Closed after this long without a byte either way.
    pub(super) idle: Duration,
    /// The handshake's concurrency slots, held until the tunnel closes.
    pub(crate) slots: crate::limiter::concurrency::Guard,
}

/// Copy bytes both ways until either side closes, or nothing moved for the route's
/// `timeouts.websocket_idle`.
pub async fn run(t: Tunnel) {
    let (client, upstream) = match tokio::join!(t.client, t.upstream) {
        (Ok(c), Ok(u)) => (c, u),
        (c, u) => {
            tracing::debug!(
                client = c.is_ok(),
                upstream = u.is_ok(),
                "websocket upgrade failed"
            );
            return;
        }
    };
    // When bytes last moved either way, in milliseconds since the tunnel opened.
    let started = tokio::time::Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let touch = || {
        let last = last.clone();
        move || {
            let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            last.store(ms, Ordering::Relaxed);
        }
    };
    let mut client = ReadNoted::new(TokioIo::new(client), touch());
    let mut upstream = ReadNoted::new(TokioIo::new(upstream), touch());
    let idle = async {
        loop {
            let since = Duration::from_millis(last.load(Ordering::Relaxed));
            let deadline = started + since + t.idle;
            if tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    };
    tokio::select! {
        copied = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {
            if let Err(e) = copied {
                tracing::debug!(error = %e, "websocket tunnel ended with an error");
            }
        }
        () = idle => tracing::debug!(idle = ?t.idle, "websocket tunnel idle: closed"),
    }
}
