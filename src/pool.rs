//! Keep-alive HTTP/1.1 connections to an upstream's targets: one pool per worker thread, so a
//! request, its connection's task and the pool all live on one thread.
//!
//! This is hyper's own connection API (`client::conn::http1`) with the few lines of pooling a
//! reverse proxy needs: the most recently used idle connection first (it is the warmest), a
//! connection back in the pool only once its response body has been read to the end (a body
//! left unread closes it), idle connections forgotten after `idle_timeout`, and a request
//! that a reused connection never wrote (the upstream had closed it meanwhile) sent again on
//! another one. hyper-util's general-purpose client does the same with a shared, hashed pool
//! and a boxed future per request; here a checkout is a `Vec::pop`.

use std::collections::VecDeque;
use std::error::Error as StdError;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use parking_lot::Mutex;
use tokio::time::Instant;
use tower_service::Service;

use crate::body::{Guarded, Sent};

/// Idle connections kept per target and worker; more are closed when they come back.
const MAX_IDLE: usize = 1024;

type Sender = http1::SendRequest<Guarded>;

/// Why a request got no response head.
#[derive(Debug)]
pub enum SendError {
    /// No connection: refused, unreachable, timed out, TLS failed.
    Connect(Box<dyn StdError + Send + Sync>),
    /// The connection failed during the exchange.
    Exchange(hyper::Error),
}

impl SendError {
    /// The error, for walking its causes.
    pub fn as_error(&self) -> &(dyn StdError + 'static) {
        match self {
            SendError::Connect(e) => &**e,
            SendError::Exchange(e) => e,
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

/// One worker's connections to every target of one upstream.
#[derive(Debug)]
pub struct Pool {
    connector: Connector,
    /// Per target (by index), oldest first.
    idle: Mutex<Vec<VecDeque<Idle>>>,
    idle_timeout: Duration,
}

#[derive(Debug)]
struct Idle {
    sender: Sender,
    since: Instant,
}

/// A connection on loan to one response: it goes back to its pool when the body ends.
#[derive(Debug)]
pub struct Lease {
    pool: Arc<Pool>,
    target: usize,
    sender: Sender,
    /// The request body's progress: a connection whose request is still being uploaded (the
    /// upstream answered early) is not reusable until that ends, so it is not given back.
    sent: Sent,
}

impl Pool {
    pub fn new(connector: Connector, targets: usize, idle_timeout: Duration) -> Self {
        Self {
            connector,
            idle: Mutex::new((0..targets).map(|_| VecDeque::new()).collect()),
            idle_timeout,
        }
    }

    /// Send `req` (origin-form URI, `Host` set) to target number `target`, reached at `uri`
    /// (`scheme://authority/`). `now`: about now (the request's arrival will do), for idle
    /// expiry. Returns the response head, and the connection's lease unless the connection
    /// cannot be reused.
    pub async fn send(
        self: &Arc<Self>,
        target: usize,
        uri: &Uri,
        mut req: Request<Guarded>,
        now: Instant,
    ) -> Result<(Response<Incoming>, Option<Lease>), SendError> {
        let sent = req.body().sent();
        loop {
            let (mut sender, reused) = match self.checkout(target, now) {
                Some(sender) => (sender, true),
                // Boxed: a connect's state (TCP, TLS) is large, and a request future that
                // carried it inline would be copied in full at every move, connect or not.
                None => (Box::pin(self.connect(uri)).await?, false),
            };
            if let Err(e) = sender.ready().await {
                // Closed while it sat idle: try the next one, or a new one.
                if reused {
                    continue;
                }
                return Err(SendError::Exchange(e));
            }
            match sender.try_send_request(req).await {
                Ok(res) => {
                    let lease = Lease {
                        pool: self.clone(),
                        target,
                        sender,
                        sent,
                    };
                    return Ok((res, Some(lease)));
                }
                Err(mut e) => match e.take_message() {
                    // Never written: the upstream closed the connection just before.
                    Some(unsent) if reused => req = unsent,
                    _ => return Err(SendError::Exchange(e.into_error())),
                },
            }
        }
    }

    /// The most recently used live idle connection to `target`, dropping the ones expired at
    /// `now`.
    fn checkout(&self, target: usize, now: Instant) -> Option<Sender> {
        let mut idle = self.idle.lock();
        let list = idle.get_mut(target)?;
        while list
            .front()
            .is_some_and(|c| now.duration_since(c.since) >= self.idle_timeout)
        {
            list.pop_front();
        }
        while let Some(c) = list.pop_back() {
            if !c.sender.is_closed() {
                return Some(c.sender);
            }
        }
        None
    }

    /// A new connection to `uri`, its task spawned on this worker.
    async fn connect(&self, uri: &Uri) -> Result<Sender, SendError> {
        match &self.connector {
            Connector::Plain(c) => handshake(c.clone(), uri).await,
            Connector::Tls(c) => handshake(c.clone(), uri).await,
        }
    }

    /// Close the connections idle for longer than the idle timeout (and forget closed ones).
    pub fn expire(&self) {
        let now = Instant::now();
        let mut idle = self.idle.lock();
        for list in idle.iter_mut() {
            list.retain(|c| {
                now.duration_since(c.since) < self.idle_timeout && !c.sender.is_closed()
            });
        }
    }

    fn give_back(&self, target: usize, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock();
        if let Some(list) = idle.get_mut(target) {
            if list.len() >= MAX_IDLE {
                list.pop_front();
            }
            list.push_back(Idle {
                sender,
                since: Instant::now(),
            });
        }
    }
}

/// Connect with `connector`, then start HTTP/1.1 on the connection, its task on this worker.
async fn handshake<C>(mut connector: C, uri: &Uri) -> Result<Sender, SendError>
where
    C: Service<Uri>,
    C::Response: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    C::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    std::future::poll_fn(|cx| connector.poll_ready(cx))
        .await
        .map_err(|e| SendError::Connect(e.into()))?;
    let io = connector
        .call(uri.clone())
        .await
        .map_err(|e| SendError::Connect(e.into()))?;
    let (sender, connection) = http1::Builder::new()
        .handshake(io)
        .await
        .map_err(SendError::Exchange)?;
    tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!(error = %e, "upstream connection ended with an error");
        }
    });
    Ok(sender)
}

/// An upstream response body that returns its connection to the pool once read to the end.
/// Dropped before that, it takes the connection with it (hyper closes it).
#[derive(Debug)]
pub struct Pooled {
    inner: Incoming,
    lease: Option<Lease>,
}

impl Pooled {
    /// `lease`: the connection to give back when the body ends (at once if it is empty).
    pub fn new(inner: Incoming, lease: Option<Lease>) -> Self {
        let mut body = Self { inner, lease };
        if body.inner.is_end_stream() {
            body.release();
        }
        body
    }

    fn release(&mut self) {
        if let Some(l) = self.lease.take() {
            if l.sent.is_done() {
                l.pool.give_back(l.target, l.sender);
            }
        }
    }
}

impl Body for Pooled {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            None => self.release(),
            Some(Err(_)) => self.lease = None,
            Some(Ok(_)) if self.inner.is_end_stream() => self.release(),
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
