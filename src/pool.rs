//! Keep-alive connections to an upstream's targets (HTTP/1.1 here, HTTP/2 in `h2`): one pool
//! per worker thread, so a request, its connection's task and the pool all live on one thread.
//!
//! This is hyper's own connection API (`client::conn::http1`) with the few lines of pooling a
//! reverse proxy needs: the most recently used idle connection first (it is the warmest), a
//! connection back in the pool only once its response body has been read to the end (a body
//! left unread closes it), idle connections forgotten after `idle_timeout`, and a request
//! that a reused connection never wrote (the upstream had closed it meanwhile) sent again on
//! another one. A request that no connection could take (refused, timed out) comes back to
//! the caller unwritten, for another target. hyper-util's general-purpose client does the
//! same with a shared, hashed pool and a boxed future per request; here a checkout is a
//! `Vec::pop`. `Loads` counts the requests in flight per target, for `least_request`.
//!
//! A capped upstream (`max_in_flight`) has one pool shared by every worker, tied to its gate,
//! so that its connections, idle ones included, never outnumber the cap, as HAProxy's
//! `maxconn` bounds them (`Open`): a connection counts from its connect until its task has
//! closed it, a request opens one only while fewer are open (else it waits for one to come
//! back or close), and a connection comes back before its slot is freed, so the request the
//! slot lets in finds it idle.

use std::collections::VecDeque;
use std::error::Error as StdError;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::{Connection, HttpConnector};
use parking_lot::Mutex;
use tokio::time::Instant;
use tower_service::Service;

use crate::body::{Guarded, Sent};
use crate::config::settings::Protocol;

mod h2;
mod head;
mod load;
mod open;
mod pooled;
use head::{drive, HeadWatch};
pub use load::{InFlight, Loads};
use open::{Counted, Open};
pub use pooled::Pooled;

type Sender = http1::SendRequest<Guarded>;

/// Why a request got no response head.
#[derive(Debug)]
pub enum SendError {
    /// No connection: refused, unreachable, timed out, TLS failed.
    Connect(Box<dyn StdError + Send + Sync>),
    /// The connection failed during the exchange.
    Exchange(hyper::Error),
    /// No response head by the deadline the request was sent with: the connection was closed.
    HeadTimeout,
}

impl SendError {
    /// The error's name in traces (`error.type`).
    pub fn kind(&self) -> &'static str {
        match self {
            SendError::Connect(_) => "connect",
            SendError::Exchange(_) => "exchange",
            SendError::HeadTimeout => "timeout",
        }
    }

    /// The error, for walking its causes.
    pub fn as_error(&self) -> &(dyn StdError + 'static) {
        match self {
            SendError::Connect(e) => &**e,
            SendError::Exchange(e) => e,
            SendError::HeadTimeout => &HeadTimedOut,
        }
    }
}

/// A request that got no response head: why, and the request itself when none of it was
/// written (refused, no connection in time, a new connection closed at once), so the caller
/// can send it to another target.
#[derive(Debug)]
pub struct Failed {
    pub error: SendError,
    pub unsent: Option<Box<Request<Guarded>>>,
}

impl Failed {
    fn unsent(error: SendError, req: Box<Request<Guarded>>) -> Self {
        Self {
            error,
            unsent: Some(req),
        }
    }

    fn written(error: SendError) -> Self {
        Self {
            error,
            unsent: None,
        }
    }
}

/// How new connections to an upstream's targets are made.
#[derive(Debug, Clone)]
pub enum Connector {
    /// `http://`: TCP only.
    Plain(HttpConnector),
    /// `https://`: TCP, then TLS.
    Tls(HttpsConnector<HttpConnector>),
}

/// The error of a response head that did not come in time.
#[derive(Debug, thiserror::Error)]
#[error("no response head before the upstream's timeout")]
pub struct HeadTimedOut;

/// One worker's connections to every target of one upstream.
#[derive(Debug)]
pub struct Pool {
    connector: Connector,
    /// Per target (by index), oldest first.
    idle: Mutex<Vec<VecDeque<Idle>>>,
    /// Idle connections kept per target: past it the oldest is closed when one comes back.
    max_idle: usize,
    idle_timeout: Duration,
    /// A capped upstream's slots and its connections counted against them.
    capped: Option<(Arc<crate::capacity::Gate>, Arc<Open>)>,
    /// The HTTP version requests go in, and (HTTP/2) the connection to each target.
    protocol: Protocol,
    h2: Option<h2::Conns>,
}

/// A new connection, in the version it speaks.
enum Opened {
    H1(Link),
    /// With its opener's stream counted, when the pool keeps it for the next requests.
    H2(h2::Sender, Option<h2::Stream>),
}

#[derive(Debug)]
struct Idle {
    conn: Link,
    since: Instant,
}

/// One upstream connection: where requests go in, and the deadline its task watches.
#[derive(Debug)]
struct Link {
    sender: Sender,
    watch: Arc<HeadWatch>,
}

/// What a response holds until its body ends.
#[derive(Debug)]
pub enum Lease {
    /// An HTTP/1.1 connection, back to its pool then.
    Conn(Loan),
    /// A stream of a shared HTTP/2 connection, counted against its bound until then.
    Stream(h2::Stream),
}

/// An HTTP/1.1 connection on loan to one response: it goes back to its pool when the body
/// ends.
#[derive(Debug)]
pub struct Loan {
    pool: Arc<Pool>,
    target: usize,
    conn: Link,
    /// The request body's progress: a connection whose request is still being uploaded (the
    /// upstream answered early) is not reusable until that ends, so it is not given back.
    sent: Sent,
}

impl Pool {
    /// `max_idle`: idle connections kept per target (0: every connection closes after its
    /// response). `gate`: a capped upstream's slots, which bound the connections too (its one
    /// pool is then shared by every worker). `max_streams`: an HTTP/2 connection's streams at
    /// most.
    pub fn new(
        connector: Connector,
        targets: usize,
        max_idle: usize,
        idle_timeout: Duration,
        gate: Option<Arc<crate::capacity::Gate>>,
        protocol: Protocol,
        max_streams: usize,
    ) -> Self {
        let capped = gate.map(|gate| {
            let open = Open {
                per_target: (0..targets).map(|_| 0.into()).collect(),
                changed: tokio::sync::Notify::new(),
            };
            (gate, Arc::new(open))
        });
        Self {
            connector,
            idle: Mutex::new((0..targets).map(|_| VecDeque::new()).collect()),
            max_idle,
            idle_timeout,
            capped,
            protocol,
            h2: (protocol != Protocol::Http1).then(|| h2::Conns::new(targets, max_streams)),
        }
    }

    /// Send `req` (origin-form URI, `Host` set) to target number `target`, reached at `uri`
    /// (`scheme://authority/`). `now`: about now (the request's arrival will do), for idle
    /// expiry. `head_by`: the deadline for the response head of a request that is sent as a
    /// whole (no body to stream), kept by the connection's task (`SendError::HeadTimeout`);
    /// the caller times other requests itself. Returns the response head, and the
    /// connection's lease unless the connection cannot be reused; or why there is none, with
    /// the request itself when none of it was written (so it can go to another target).
    pub async fn send(
        self: &Arc<Self>,
        target: usize,
        uri: &Uri,
        mut req: Box<Request<Guarded>>,
        now: Instant,
        head_by: Option<Instant>,
    ) -> Result<(Response<Incoming>, Option<Lease>), Failed> {
        let sent = req.body().sent();
        // HTTP/2 (`auto`: once a target picked it). Boxed: inline, its state would make every
        // HTTP/1.1 send larger.
        if let Some(h2) = &self.h2 {
            if self.protocol != Protocol::Auto || h2.any(target) {
                let h2 = crate::boxed(|| self.send_over_h2(target, uri, req, head_by));
                return h2.await;
            }
        }
        loop {
            let (mut conn, reused) = match self.checkout(target, now) {
                Some(conn) => (conn, true),
                None => {
                    // Boxed, for the same reason: connecting is rare on a warm pool.
                    let open = crate::boxed(|| self.open(target, uri));
                    match open.await {
                        Ok(Some(Opened::H1(conn))) => (conn, false),
                        // A capped target's connections all taken: one came back or closed.
                        Ok(None) => continue,
                        // `auto`: the target picked HTTP/2.
                        Ok(Some(Opened::H2(sender, stream))) => {
                            let h2 = crate::boxed(|| {
                                self.send_h2(target, uri, (sender, stream), req, head_by)
                            });
                            return h2.await;
                        }
                        Err(error) => return Err(Failed::unsent(error, req)),
                    }
                }
            };
            if let Err(e) = conn.sender.ready().await {
                // Closed while it sat idle: try the next one, or a new one.
                if reused {
                    continue;
                }
                return Err(Failed::unsent(SendError::Exchange(e), req));
            }
            if let Some(at) = head_by {
                conn.watch.expect_by(at);
            }
            match conn.sender.try_send_request(*req).await {
                Ok(res) => {
                    conn.watch.answered();
                    let lease = Loan {
                        pool: self.clone(),
                        target,
                        conn,
                        sent,
                    };
                    return Ok((res, Some(Lease::Conn(lease))));
                }
                Err(_) if conn.watch.timed_out.load(Ordering::Acquire) => {
                    return Err(Failed::written(SendError::HeadTimeout))
                }
                Err(mut e) => match e.take_message() {
                    // Never written: the upstream closed the connection just before.
                    Some(unsent) if reused => *req = unsent,
                    Some(unsent) => {
                        *req = unsent;
                        return Err(Failed::unsent(SendError::Exchange(e.into_error()), req));
                    }
                    None => return Err(Failed::written(SendError::Exchange(e.into_error()))),
                },
            }
        }
    }

    /// The most recently used live idle connection to `target`, dropping the ones expired at
    /// `now`.
    fn checkout(&self, target: usize, now: Instant) -> Option<Link> {
        let mut idle = self.idle.lock();
        let list = idle.get_mut(target)?;
        while list
            .front()
            .is_some_and(|c| now.duration_since(c.since) >= self.idle_timeout)
        {
            list.pop_front();
        }
        while let Some(c) = list.pop_back() {
            if !c.conn.sender.is_closed() {
                return Some(c.conn);
            }
        }
        None
    }

    /// A new connection to target `target` at `uri`, its task spawned on this worker; `None`
    /// once one of a capped target's connections came back or closed, when as many as its cap
    /// were open (the caller looks in the pool again).
    async fn open(&self, target: usize, uri: &Uri) -> Result<Option<Opened>, SendError> {
        let mut counted = None;
        if let Some((gate, open)) = &self.capped {
            let changed = open.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            counted = open.take(target, gate.cap(target));
            if counted.is_none() {
                changed.await;
                return Ok(None);
            }
        }
        // The caller boxes this future: a connect's state (TCP, TLS) is large, and a request
        // future that carried it inline would be copied in full at every move.
        let protocol = self.protocol;
        let mut opened = match &self.connector {
            Connector::Plain(c) => handshake(c.clone(), uri, counted, protocol).await?,
            Connector::Tls(c) => handshake(c.clone(), uri, counted, protocol).await?,
        };
        // A new HTTP/2 connection is the target's from now on: the next requests share it.
        if let (Opened::H2(sender, stream), Some(h2)) = (&mut opened, &self.h2) {
            *stream = Some(h2.put(target, sender));
        }
        Ok(Some(opened))
    }

    /// Close the connections idle for longer than the idle timeout (and forget closed ones).
    pub fn expire(&self) {
        let now = Instant::now();
        let mut idle = self.idle.lock();
        for list in idle.iter_mut() {
            list.retain(|c| {
                now.duration_since(c.since) < self.idle_timeout && !c.conn.sender.is_closed()
            });
        }
    }

    /// `since`: when the connection last heard from the upstream, about. Its response head
    /// will do: earlier than its last byte, a connection idles out sooner, never later than
    /// the upstream's own keep-alive timeout would close it. On a capped upstream the request's
    /// slot is still held: the oldest idle connections past what the cap leaves room for are
    /// closed (a cap lowered by a reload or learned smaller sheds them here).
    fn give_back(&self, target: usize, conn: Link, since: Instant) {
        if conn.sender.is_closed() || self.max_idle == 0 {
            return;
        }
        if let Some((gate, open)) = &self.capped {
            // A cap lowered by a reload, or learned smaller, sheds connections as they return.
            if open.count(target) > gate.cap(target) {
                return;
            }
        }
        let mut idle = self.idle.lock();
        if let Some(list) = idle.get_mut(target) {
            if list.len() >= self.max_idle {
                list.pop_front();
            }
            list.push_back(Idle { conn, since });
        }
        drop(idle);
        if let Some((_, open)) = &self.capped {
            open.changed.notify_waiters();
        }
    }
}

impl Connector {
    /// `req` on a connection of its own to `uri`, for a one-off request such as a health
    /// check: the response head (its body unread, the connection closed when it is dropped).
    pub async fn request_once(
        &self,
        uri: &Uri,
        mut req: Request<Guarded>,
        protocol: Protocol,
    ) -> Result<Response<Incoming>, SendError> {
        let opened = match self {
            Connector::Plain(c) => handshake(c.clone(), uri, None, protocol).await?,
            Connector::Tls(c) => handshake(c.clone(), uri, None, protocol).await?,
        };
        match opened {
            Opened::H1(mut conn) => {
                conn.sender.ready().await.map_err(SendError::Exchange)?;
                conn.sender
                    .send_request(req)
                    .await
                    .map_err(SendError::Exchange)
            }
            Opened::H2(mut sender, _) => {
                let scheme = uri.scheme().cloned().unwrap_or(http::uri::Scheme::HTTP);
                h2::to_h2(&mut req, scheme);
                h2::send(&mut sender, req, None).await.map_err(|(e, _)| e)
            }
        }
    }
}

/// The most an upstream connection's read buffer grows to.
const UPSTREAM_READ_BUFFER: usize = 64 << 10;

/// Connect with `connector`, then start HTTP/1.1 or HTTP/2 (as `protocol` says, and for `h2`
/// and `auto` as TLS's ALPN picked) on the connection, its task on this worker (which keeps
/// `counted` until the connection is closed).
async fn handshake<C>(
    mut connector: C,
    uri: &Uri,
    counted: Option<Counted>,
    protocol: Protocol,
) -> Result<Opened, SendError>
where
    C: Service<Uri>,
    C::Response: hyper::rt::Read + hyper::rt::Write + Connection + Unpin + Send + 'static,
    C::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    std::future::poll_fn(|cx| connector.poll_ready(cx))
        .await
        .map_err(|e| SendError::Connect(e.into()))?;
    let io = connector
        .call(uri.clone())
        .await
        .map_err(|e| SendError::Connect(e.into()))?;
    let negotiated_h2 = io.connected().is_negotiated_h2();
    let h2 = match protocol {
        Protocol::Http1 => false,
        Protocol::H2c => true,
        Protocol::Auto => negotiated_h2,
        Protocol::H2 if negotiated_h2 => true,
        Protocol::H2 => {
            return Err(SendError::Connect(
                "the target did not offer HTTP/2 (no `h2` in its TLS ALPN): use protocol: auto or http1".into(),
            ))
        }
    };
    if h2 {
        return h2::handshake(io, counted)
            .await
            .map(|sender| Opened::H2(sender, None));
    }
    // hyper's read buffer grows with large responses and keeps its size: 64 KiB bounds what
    // each upstream connection (busy or idle in the pool) holds.
    let (sender, connection) = http1::Builder::new()
        .max_buf_size(UPSTREAM_READ_BUFFER)
        .handshake(io)
        .await
        .map_err(SendError::Exchange)?;
    let watch = Arc::new(HeadWatch::new());
    let driven = drive(connection.with_upgrades(), watch.clone());
    match counted {
        None => tokio::spawn(driven),
        // The connection (its socket) is gone once `drive` returns: it counts until then.
        Some(counted) => tokio::spawn(async move {
            driven.await;
            drop(counted);
        }),
    };
    Ok(Opened::H1(Link { sender, watch }))
}
