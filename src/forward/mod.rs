//! Forwarding upstream: target choice, the request rewrite, a pooled keep-alive client, streaming.

mod framing;
mod rewrite;
pub mod tunnel;
mod upstream;

use std::net::IpAddr;
use std::time::Duration;

use http::header::{CONNECTION, UPGRADE};
use http::{HeaderValue, Request, Response, StatusCode};

use crate::body::Guarded;
use crate::error::ProxyError;
use crate::pool::{Pooled, SendError};
use rewrite::rewrite;
pub use rewrite::strip_hop_by_hop;
use tunnel::is_websocket_upgrade;
pub use tunnel::Tunnel;
pub use upstream::Upstream;

/// An upstream's answer: its response head (the body still streaming), and the tunnel a
/// WebSocket handshake opened.
#[derive(Debug)]
pub struct Forwarded {
    pub response: Response<Pooled>,
    pub tunnel: Option<Tunnel>,
}

/// What the rewrite needs to know about the downstream connection.
// Four independent facts about one request, not a state machine in disguise.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug, Clone, Copy)]
pub struct Downstream<'a> {
    pub peer: IpAddr,
    /// `peer`, rendered once per connection.
    pub peer_value: &'a HeaderValue,
    pub peer_trusted: bool,
    pub tls: bool,
    /// The client address tollgate decided on (sent as `X-Real-IP`).
    pub client_ip: IpAddr,
    /// The route proxies WebSocket upgrades.
    pub websocket_allowed: bool,
    /// The route's idle timeout for an open tunnel.
    pub websocket_idle: Duration,
    /// Headers with `_` in their names go upstream (else they are dropped).
    pub underscores: bool,
    /// Headers removed when the peer is not a trusted proxy (`strip_untrusted_headers`).
    pub untrusted_strip: &'a [http::HeaderName],
    /// The worker serving the connection (whose upstream pool it uses).
    pub worker: usize,
}

/// Send `req` to one of the upstream's targets and return its response head, the body still
/// streaming. Connection refused is `UpstreamUnreachable` (502); no response head within the
/// upstream's `timeout`, or no connection within `connect_timeout`, is `UpstreamTimeout` (504).
/// `now`: about now (a request without a body is sent from then on). A WebSocket handshake
/// the upstream accepted comes back with its tunnel, for the connection to run.
pub async fn send(
    upstream: &Upstream,
    mut req: Box<Request<Guarded>>,
    down: Downstream<'_>,
    now: tokio::time::Instant,
) -> Result<Forwarded, ProxyError> {
    // Taken before the rewrite strips the headers that ask for it.
    let websocket = down.websocket_allowed && is_websocket_upgrade(req.headers());
    let client_side = websocket.then(|| hyper::upgrade::on(&mut *req));
    let target = upstream.pick();
    rewrite(&mut req, &upstream.targets[target], down)?;
    if websocket {
        let headers = req.headers_mut();
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(UPGRADE, HeaderValue::from_static("websocket"));
    }
    let sent = req.body().sent();
    let pool = upstream.pool(down.worker);
    let uri = &upstream.target_uris[target];
    // `timeout` runs from the moment the request is fully sent: until then the route's body
    // limits judge the client, and the connect timeout the connection. A request without a
    // body is sent now, and its connection's task keeps the deadline; one whose body is still
    // streaming gets a timer that starts when the body is done.
    let head_by = sent.is_done().then(|| now + upstream.timeout);
    // Pinned in place: awaited in one of two ways below, it has one slot in this future.
    let mut exchange = std::pin::pin!(pool.send(target, uri, req, now, head_by));
    let exchanged = if head_by.is_some() {
        exchange.await
    } else {
        let head_deadline = async {
            sent.wait().await;
            tokio::time::sleep(upstream.timeout).await;
        };
        tokio::select! {
            // The response first: no random draw per poll.
            biased;
            exchanged = &mut exchange => exchanged,
            () = head_deadline => return Err(ProxyError::UpstreamTimeout),
        }
    };
    let (mut res, mut lease) = exchanged.map_err(|e| classify(&e))?;
    framing::check_response(&res, client_side.is_some())?;
    // Only a switch of protocols needs the upstream's `Upgrade` after the strip.
    let upgrade = (res.status() == StatusCode::SWITCHING_PROTOCOLS)
        .then(|| res.headers().get(UPGRADE).cloned())
        .flatten();
    strip_hop_by_hop(res.headers_mut());
    let mut tunnel = None;
    if let (Some(client_side), StatusCode::SWITCHING_PROTOCOLS) = (client_side, res.status()) {
        let headers = res.headers_mut();
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(
            UPGRADE,
            upgrade.unwrap_or(HeaderValue::from_static("websocket")),
        );
        tunnel = Some(Tunnel {
            client: client_side,
            upstream: hyper::upgrade::on(&mut res),
            idle: down.websocket_idle,
        });
    }
    if res.status() == StatusCode::SWITCHING_PROTOCOLS {
        // The connection now belongs to the tunnel (or is useless): never back in the pool.
        lease = None;
    }
    Ok(Forwarded {
        response: res.map(|body| Pooled::new(body, lease)),
        tunnel,
    })
}

fn classify(e: &SendError) -> ProxyError {
    if let SendError::HeadTimeout = e {
        return ProxyError::UpstreamTimeout;
    }
    let e = e.as_error();
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return ProxyError::UpstreamTimeout;
            }
        }
        source = s.source();
    }
    let mut chain = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        chain.push_str(": ");
        chain.push_str(&s.to_string());
        source = s.source();
    }
    tracing::debug!(error = %chain, "upstream request failed");
    ProxyError::UpstreamUnreachable
}
