//! The request body on its way upstream: streamed, with an idle timeout, an overall deadline
//! and a size cap, and a record of why it failed so the client gets 408, 413 or 400 rather
//! than a generic 502.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use crate::buffer::{Filling, HeldReader, Store};

/// Why a request body stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFailure {
    /// No data for longer than the route's `body_idle`.
    Idle,
    /// The route's whole-request `request` timeout passed.
    Deadline,
    /// More bytes than the route's `max_body`.
    TooLarge,
    /// The client's framing was broken (a bad chunk, a short body) or it went away.
    Malformed,
}

#[derive(Debug, thiserror::Error)]
#[error("request body: {0:?}")]
pub struct BodyError(pub BodyFailure);

/// Why a body could not be held whole.
#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    #[error("request body: {0:?}")]
    Body(BodyFailure),
    #[error("cannot write the request body to a temporary file: {0}")]
    Store(std::io::Error),
}

/// The limits one route puts on request bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyLimits {
    pub idle: Duration,
    /// `None`: no overall deadline (`request: 0s`).
    pub request: Option<Duration>,
    pub max_bytes: u64,
}

impl Default for BodyLimits {
    fn default() -> Self {
        Self {
            idle: Duration::from_secs(30),
            request: Some(Duration::from_mins(5)),
            max_bytes: 10 << 20,
        }
    }
}

/// How far a request body got: all of it gone upstream (the upstream's response-head timeout
/// counts from then, so a slow upload is judged by the body limits, not by `timeout`), or why it
/// failed. A request whose body was complete on arrival (every GET) shares nothing: no
/// allocation, always done, never failed.
#[derive(Debug, Clone, Default)]
pub struct Sent(Option<Arc<Progress>>);

#[derive(Debug, Default)]
struct Progress {
    done: AtomicBool,
    notify: tokio::sync::Notify,
    failure: OnceLock<BodyFailure>,
    /// Bytes read from the client so far.
    received: AtomicU64,
}

impl Sent {
    fn mark(&self) {
        if let Some(p) = &self.0 {
            if !p.done.swap(true, Ordering::AcqRel) {
                p.notify.notify_one();
            }
        }
    }

    /// The whole body has been read (and handed upstream).
    pub fn is_done(&self) -> bool {
        self.0
            .as_ref()
            .is_none_or(|p| p.done.load(Ordering::Acquire))
    }

    /// Resolves once the body is fully sent (at once for a request without a body).
    pub async fn wait(&self) {
        if let Some(p) = &self.0 {
            while !p.done.load(Ordering::Acquire) {
                p.notify.notified().await;
            }
        }
    }

    /// Why the body failed, if it did.
    pub fn failure(&self) -> Option<BodyFailure> {
        self.0.as_ref().and_then(|p| p.failure.get().copied())
    }

    /// Bytes of a streamed body read from the client so far (0 without one).
    pub fn received(&self) -> u64 {
        self.0
            .as_ref()
            .map_or(0, |p| p.received.load(Ordering::Relaxed))
    }
}

/// A request body on its way upstream: the client's, streamed with the route's limits applied,
/// or one that can be sent again (`replay`) because nothing of it is left to read.
#[derive(Debug)]
pub struct Guarded {
    kind: Kind,
    sent: Sent,
}

#[derive(Debug)]
enum Kind {
    /// Streamed from the client as it arrives.
    Streaming(Box<Streaming>),
    /// No bytes (every GET): complete on arrival.
    Empty,
    /// Received whole before the upstream was contacted (request buffering). Boxed: every
    /// upstream connection's request queue (hyper's channel) holds 32 requests' room at once.
    Held(Box<HeldReader>),
    /// Bytes of tollgate's own (a gRPC health check's request), sent at once. Boxed: every
    /// upstream request carries a body, and hyper's request queue moves it whole.
    Fixed(Box<Bytes>),
}

/// `Incoming` with the route's limits applied.
#[derive(Debug)]
struct Streaming {
    inner: Incoming,
    limits: BodyLimits,
    /// Armed on the first wait for data: a request whose body is already complete (every
    /// GET) never creates a timer.
    idle: Option<Pin<Box<Sleep>>>,
    deadline: Option<Pin<Box<Sleep>>>,
    deadline_at: Option<Instant>,
    seen: u64,
}

impl Guarded {
    /// The body's progress, shared with whoever needs to know when it is sent or why it failed.
    pub fn sent(&self) -> Sent {
        self.sent.clone()
    }

    /// Wrap `inner`; `started` is when the request arrived (the deadline counts from there).
    pub fn new(inner: Incoming, limits: BodyLimits, started: Instant) -> Self {
        if inner.is_end_stream() {
            return Self::empty();
        }
        Self {
            kind: Kind::Streaming(Box::new(Streaming {
                inner,
                limits,
                idle: None,
                deadline: None,
                deadline_at: limits.request.map(|d| started + d),
                seen: 0,
            })),
            sent: Sent(Some(Arc::default())),
        }
    }

    /// A body without bytes.
    pub fn empty() -> Self {
        Self {
            kind: Kind::Empty,
            sent: Sent(None),
        }
    }

    /// `bytes`, as a body of tollgate's own request.
    pub fn fixed(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Fixed(Box::new(bytes)),
            sent: Sent(None),
        }
    }

    /// The same body again, from its start, for another attempt upstream; `None` when its
    /// bytes were streamed and are gone.
    pub fn replay(&self) -> Option<Self> {
        match &self.kind {
            Kind::Empty => Some(Self::empty()),
            Kind::Fixed(b) => Some(Self::fixed((**b).clone())),
            Kind::Held(r) => Some(Self {
                kind: Kind::Held(Box::new(r.restart())),
                sent: Sent(None),
            }),
            Kind::Streaming(_) => None,
        }
    }

    /// Receive the whole body now, with the route's limits, into memory and (past
    /// `store.memory_per_body`) a temporary file; the result is sent with its length known.
    /// A streamed body's failure is recorded as for any body (`Sent::failure`).
    pub async fn hold(mut self, store: &Store) -> Result<(Self, u64), HoldError> {
        if !matches!(self.kind, Kind::Streaming(_)) {
            return Ok((self, 0));
        }
        let mut filling = Filling::new(store);
        while let Some(frame) = self.frame().await {
            let frame = frame.map_err(|BodyError(why)| HoldError::Body(why))?;
            if let Ok(data) = frame.into_data() {
                filling.push(&data).map_err(HoldError::Store)?;
            }
        }
        let held = Arc::new(filling.finish());
        let len = held.size();
        let body = Self {
            kind: Kind::Held(Box::new(held.reader())),
            sent: Sent(None),
        };
        Ok((body, len))
    }

    fn fail(&self, why: BodyFailure) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if let Some(p) = &self.sent.0 {
            let _ = p.failure.set(why);
        }
        Poll::Ready(Some(Err(BodyError(why))))
    }
}

impl Body for Guarded {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let polled = match &mut this.kind {
            Kind::Empty => return Poll::Ready(None),
            Kind::Fixed(b) if b.is_empty() => return Poll::Ready(None),
            Kind::Fixed(b) => return Poll::Ready(Some(Ok(Frame::data(std::mem::take(&mut **b))))),
            Kind::Held(r) => {
                return Pin::new(&mut **r)
                    .poll_frame(cx)
                    .map_err(|_| BodyError(BodyFailure::Malformed));
            }
            Kind::Streaming(s) => {
                let polled = s.poll(cx);
                if let (Some(p), Poll::Ready(Some(Ok(_)))) = (&this.sent.0, &polled) {
                    p.received.store(s.seen, Ordering::Relaxed);
                }
                polled
            }
        };
        match polled {
            Poll::Ready(Some(Err(why))) => this.fail(why),
            Poll::Ready(None) => {
                this.sent.mark();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Empty => true,
            Kind::Fixed(b) => b.is_empty(),
            Kind::Held(r) => r.is_end_stream(),
            Kind::Streaming(s) => s.inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Empty => SizeHint::with_exact(0),
            Kind::Fixed(b) => SizeHint::with_exact(b.len() as u64),
            Kind::Held(r) => r.size_hint(),
            Kind::Streaming(s) => s.inner.size_hint(),
        }
    }
}

impl Streaming {
    /// The next frame, or why the body failed.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyFailure>>> {
        if let Some(deadline) = self.deadline.as_mut() {
            if deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Some(Err(BodyFailure::Deadline)));
            }
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.seen += data.len() as u64;
                    if self.seen > self.limits.max_bytes {
                        return Poll::Ready(Some(Err(BodyFailure::TooLarge)));
                    }
                }
                // Before the timers are armed (data arrived without a wait so far), the
                // deadline is checked against the clock.
                let now = Instant::now();
                if self.deadline.is_none() && self.deadline_at.is_some_and(|at| now >= at) {
                    return Poll::Ready(Some(Err(BodyFailure::Deadline)));
                }
                let next = now + self.limits.idle;
                if let Some(idle) = self.idle.as_mut() {
                    idle.as_mut().reset(next);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(_))) => Poll::Ready(Some(Err(BodyFailure::Malformed))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                let this = self;
                if let (None, Some(at)) = (&this.deadline, this.deadline_at) {
                    let mut deadline = Box::pin(tokio::time::sleep_until(at));
                    if deadline.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Some(Err(BodyFailure::Deadline)));
                    }
                    this.deadline = Some(deadline);
                }
                let limit = this.limits.idle;
                let idle = this
                    .idle
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                ready!(idle.as_mut().poll(cx));
                Poll::Ready(Some(Err(BodyFailure::Idle)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// hyper queues requests to an upstream connection in a tokio channel that allocates room
    /// for 32 at once, for every connection: each byte here is 32 per upstream connection.
    #[test]
    fn a_request_to_an_upstream_stays_small() {
        let size = std::mem::size_of::<http::Request<super::Guarded>>();
        assert!(size <= 248, "Request<Guarded> is {size} bytes");
    }
}
