//! The deadline of a connection's response head, kept by the connection's own task.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

/// The deadline of the response head a connection's request awaits, kept by the connection's
/// own task. hyper wakes that task to write each request anyway, so it sees a new deadline at
/// no cost; its one timer is moved only when a deadline comes earlier than the one it is set
/// for, or when it fires (then to the deadline of the request in flight, if any). So a
/// request costs two atomic stores, not a timer of its own (a timer is two locked operations
/// on the runtime's timer wheel); a busy connection moves its timer about once per `timeout`.
#[derive(Debug)]
pub(super) struct HeadWatch {
    pub(super) origin: Instant,
    /// Milliseconds after `origin`, plus one; 0: no request awaits its head.
    deadline: AtomicU64,
    pub(super) timed_out: AtomicBool,
}

impl HeadWatch {
    pub(super) fn new() -> Self {
        Self {
            origin: Instant::now(),
            deadline: AtomicU64::new(0),
            timed_out: AtomicBool::new(false),
        }
    }

    /// The request now sent must have its response head by `at`.
    pub(super) fn expect_by(&self, at: Instant) {
        // Rounded up to the millisecond: never early.
        let ms = at
            .saturating_duration_since(self.origin)
            .as_micros()
            .div_ceil(1000);
        let ms = u64::try_from(ms).unwrap_or(u64::MAX - 1);
        self.deadline.store(ms + 1, Ordering::Release);
    }

    /// The response head came.
    pub(super) fn answered(&self) {
        self.deadline.store(0, Ordering::Release);
    }

    pub(super) fn deadline(&self) -> Option<Instant> {
        match self.deadline.load(Ordering::Acquire) {
            0 => None,
            ms => Some(self.origin + Duration::from_millis(ms - 1)),
        }
    }
}

/// Run one upstream connection until it ends, or until the request in flight on it has not had
/// its response head by its deadline: then the connection is dropped (hyper fails the request)
/// and `timed_out` tells the request why.
pub(super) async fn drive(
    connection: impl Future<Output = hyper::Result<()>>,
    watch: Arc<HeadWatch>,
) {
    tokio::pin!(connection);
    let timer = tokio::time::sleep_until(watch.origin);
    tokio::pin!(timer);
    // The deadline the timer is set for; `None`: not set (and not polled).
    let mut armed: Option<Instant> = None;
    let ended = std::future::poll_fn(|cx| {
        if let Poll::Ready(result) = connection.as_mut().poll(cx) {
            return Poll::Ready(Some(result));
        }
        loop {
            let earlier = watch.deadline().filter(|&at| armed.is_none_or(|a| at < a));
            if let Some(at) = earlier {
                timer.as_mut().reset(at);
                armed = Some(at);
                // Registers the task's waker with the timer. A task's waker never changes, so
                // later wakes only ask whether the timer has fired: no poll of it per request.
                if timer.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            } else if armed.is_none() || !timer.is_elapsed() {
                return Poll::Pending;
            }
            armed = None;
            if watch.deadline().is_some_and(|at| Instant::now() >= at) {
                watch.timed_out.store(true, Ordering::Release);
                return Poll::Ready(None);
            }
        }
    })
    .await;
    match ended {
        Some(Err(e)) => tracing::debug!(error = %e, "upstream connection ended with an error"),
        Some(Ok(())) => {}
        None => tracing::debug!("no response head in time: upstream connection closed"),
    }
}
