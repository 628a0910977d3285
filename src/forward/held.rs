//! One attempt at a capped upstream, in a task that holds the request's slot until the
//! backend is done with the request, whether or not its client is still there.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::body::Guarded;
use crate::capacity::Slot;
use crate::pool::{Failed, Lease, Pool, Pooled, SendError};

/// One attempt at a capped upstream, run in a task of its own that holds the request's slot:
/// a client that leaves before the answer frees no slot while the backend still works on its
/// request. The slot is held until the response head comes (or the upstream's timeout); then
/// an answer no one waits for any more is read to its end, up to `DRAIN_BYTES`, so that its
/// connection goes back to the pool, and dropped (its connection closed) past that.
pub(super) struct Attempt {
    pub(super) pool: Arc<Pool>,
    pub(super) target: usize,
    pub(super) uri: http::Uri,
    pub(super) at: Instant,
    pub(super) head_by: Option<Instant>,
    pub(super) timeout: Duration,
    /// A gRPC call's deadline, which the response head is due by too.
    pub(super) deadline: Option<Instant>,
    /// A gRPC call: cancelled (its stream reset) as soon as its client leaves, as gRPC
    /// expects, rather than answered to no one.
    pub(super) grpc: bool,
}

/// The most of an answer its client left that is read to keep the connection.
const DRAIN_BYTES: usize = 256 << 10;

pub(super) type Exchanged = Result<(Response<Incoming>, Option<Lease>), Failed>;

impl Attempt {
    /// The exchange and the slot back; no slot when the task failed (it cannot panic by
    /// design, but a slot lost to one must not be counted twice).
    pub(super) async fn run_holding(
        self,
        req: Box<Request<Guarded>>,
        slot: Slot,
    ) -> (Exchanged, Option<Slot>) {
        let (mut tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let sent = req.body().sent();
            let exchange = self
                .pool
                .send(self.target, &self.uri, req, self.at, self.head_by);
            // As `send` awaits an uncapped attempt (there inline, so that the response is
            // not moved once more on the hot path).
            let exchanged = async {
                if self.head_by.is_some() {
                    exchange.await
                } else {
                    let head_deadline =
                        super::deadline::head_due(&sent, self.timeout, self.deadline);
                    tokio::select! {
                        biased;
                        exchanged = exchange => exchanged,
                        () = head_deadline => Err(Failed { error: SendError::HeadTimeout, unsent: None }),
                    }
                }
            };
            let exchanged = if self.grpc {
                // A gRPC call whose client left is cancelled: its stream reset at once.
                tokio::select! {
                    biased;
                    exchanged = exchanged => exchanged,
                    () = tx.closed() => return,
                }
            } else {
                exchanged.await
            };
            if let Err((Ok((res, lease)), mut slot)) = tx.send((exchanged, slot)) {
                // The client left: its slot stays held while the answer is read off.
                slot.answered();
                let in_flight = (None, Some(Box::new(slot)));
                let body = Pooled::new(res.into_body(), lease, in_flight, Instant::now());
                let _ = tokio::time::timeout(self.timeout, drain(body, DRAIN_BYTES)).await;
            }
        });
        match rx.await {
            Ok((exchanged, slot)) => (exchanged, Some(slot)),
            Err(_) => (
                Err(Failed {
                    error: SendError::Connect("the upstream exchange's task ended".into()),
                    unsent: None,
                }),
                None,
            ),
        }
    }
}

/// Read `body` to its end (which gives its connection back to the pool), or drop it past
/// `limit` bytes.
async fn drain(mut body: Pooled, limit: usize) {
    use http_body_util::BodyExt;
    let mut read = 0;
    while let Some(Ok(frame)) = body.frame().await {
        read += frame.data_ref().map_or(0, bytes::Buf::remaining);
        if read > limit {
            return;
        }
    }
}
