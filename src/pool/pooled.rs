//! An upstream response body that gives its connection (or HTTP/2 stream) back when it ends.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::{InFlight, Lease};

/// An upstream response body that returns its connection to the pool once read to the end.
/// Dropped before that, it takes the connection with it (hyper closes it).
#[derive(Debug)]
pub struct Pooled {
    inner: Incoming,
    lease: Option<Lease>,
    /// Counts the response as in flight to its target until the body ends (for
    /// `least_request`, and in a capped upstream's slot: boxed, so that a body of an
    /// uncapped upstream, moved on every stage out, stays one pointer wider, not a slot's).
    in_flight: (Option<InFlight>, Option<Box<crate::capacity::Slot>>),
    answered: Instant,
}

impl Pooled {
    /// `lease`: the connection to give back when the body ends (at once if it is empty).
    /// `in_flight`: the counts to leave then. `answered`: when the response head came, the
    /// connection's idle time counted from then (no clock read when the body ends).
    pub fn new(
        inner: Incoming,
        lease: Option<Lease>,
        in_flight: (Option<InFlight>, Option<Box<crate::capacity::Slot>>),
        answered: Instant,
    ) -> Self {
        let mut body = Self {
            inner,
            lease,
            in_flight,
            answered,
        };
        if body.inner.is_end_stream() {
            body.release();
        }
        body
    }

    /// The connection goes back before the slot is freed: a request the freed slot lets in
    /// then finds it idle rather than open one more.
    fn release(&mut self) {
        if let Some(Lease::Conn(l)) = self.lease.take() {
            if l.sent.is_done() {
                l.pool.give_back(l.target, l.conn, self.answered);
            }
        }
        self.in_flight = (None, None);
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
            Some(Err(_)) => {
                self.lease = None;
                self.in_flight = (None, None);
            }
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
