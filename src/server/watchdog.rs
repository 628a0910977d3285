//! The connection watchdog: head and idle timeouts, the request cap, rapid-reset retirement.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{oneshot, watch, Notify};
use tokio::time::Instant;

use crate::config::settings::ListenerSettings;

/// Watches one connection: asks it to close gracefully on shutdown, when it has served its
/// quota of requests or was caught in a rapid reset, or when it sat idle too long; asks it to
/// drop when a request head did not complete in time. Sleeps until the next deadline and
/// re-reads the connection's marks only then: requests themselves never wake it.
///
/// On shutdown, an HTTP/1.1 connection whose next request head is under way (a client reusing
/// its kept-alive connection just as the signal lands) is not closed under it: that client has
/// sent a request and could not tell whether it was received. The head is read and answered,
/// with `Connection: close` (see `Activity::stopping`), within its own head deadline.
///
/// `shared` is what the connection shares with its requests; the watchdog keeps it alive and
/// reads only its `Activity`.
pub(super) async fn watchdog<S: AsRef<Activity>>(
    shared: Arc<S>,
    settings: Arc<ListenerSettings>,
    mut stop: watch::Receiver<bool>,
    verdict: oneshot::Sender<Command>,
) {
    let activity = (*shared).as_ref();
    let sleep = tokio::time::sleep_until(activity.next_check(&settings));
    tokio::pin!(sleep);
    let mut stopping = false;
    let command = loop {
        tokio::select! {
            _ = stop.changed(), if !stopping => {
                stopping = true;
                activity.stopping.store(true, Ordering::Release);
                if !activity.head_in_progress() {
                    break Command::Close;
                }
                sleep.as_mut().reset(activity.next_check(&settings));
            }
            () = activity.retire.notified() => break Command::Close,
            () = sleep.as_mut() => match activity.overdue(&settings) {
                // The head that held the close off was answered, and nothing else started.
                Overdue::No if stopping && !activity.busy() => break Command::Close,
                Overdue::No => sleep.as_mut().reset(activity.next_check(&settings)),
                Overdue::Idle => break Command::Close,
                Overdue::Head => break Command::Drop,
                Overdue::Send => {
                    tracing::debug!("client took no response bytes within send_timeout: closed");
                    break Command::Drop;
                }
            },
        }
    };
    let _ = verdict.send(command);
}

/// Aborts the watchdog when its connection ends.
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the watchdog asks of its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Command {
    Close,
    Drop,
}

/// Requests per window of the rapid-reset guard, and how many of them may be cancelled.
const RESET_WINDOW: u32 = 100;
const RESETS_ALLOWED: u32 = 50;

/// What a connection is doing, for its timeouts and its request cap.
pub(super) struct Activity {
    inflight: AtomicUsize,
    served: AtomicU64,
    /// The client speaks HTTP/2: its frames (pings, window updates, settings acks) arrive at
    /// any time, so bytes read do not mean a request head is in progress.
    pub(super) http2: AtomicBool,
    /// Requests and client cancellations in the current window of `RESET_WINDOW` requests.
    window: parking_lot::Mutex<(u32, u32)>,
    /// When the connection last went idle (its start, or its last request's end), and when
    /// the first byte after that arrived (a request head in progress).
    marks: parking_lot::Mutex<Marks>,
    pub(super) retire: Notify,
    /// Shutting down: responses say `Connection: close`, and closing lingers (see
    /// `connection::WriteWatched`).
    pub(super) stopping: AtomicBool,
    /// Since when a write to the client has been waiting for the socket (milliseconds after
    /// `origin`, plus one; 0: none waits).
    write_waiting: AtomicU64,
    /// HTTP/2 responses whose last data the client has not taken yet (its stream window is
    /// shut), by request number, with since when.
    unsent: parking_lot::Mutex<Vec<(u64, Instant)>>,
    origin: Instant,
}

#[derive(Clone, Copy)]
struct Marks {
    idle_since: Instant,
    head_started: Option<Instant>,
}

/// What the watchdog should do about a connection with nothing in flight.
enum Overdue {
    No,
    /// Idle too long between requests: close it gracefully.
    Idle,
    /// A request head started but did not complete in time: drop it.
    Head,
    /// The client took no response bytes for `send_timeout`: drop it.
    Send,
}

impl Activity {
    pub(super) fn new() -> Self {
        Self {
            inflight: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            http2: AtomicBool::new(false),
            window: parking_lot::Mutex::new((0, 0)),
            marks: parking_lot::Mutex::new(Marks {
                idle_since: Instant::now(),
                head_started: None,
            }),
            retire: Notify::new(),
            stopping: AtomicBool::new(false),
            write_waiting: AtomicU64::new(0),
            unsent: parking_lot::Mutex::new(Vec::new()),
            origin: Instant::now(),
        }
    }

    /// A write to the client found its socket full.
    pub(super) fn write_pending(&self) {
        if self.write_waiting.load(Ordering::Relaxed) == 0 {
            let ms = self.origin.elapsed().as_millis();
            let ms = u64::try_from(ms).unwrap_or(u64::MAX - 1);
            self.write_waiting.store(ms + 1, Ordering::Relaxed);
        }
    }

    /// A write to the client went through.
    pub(super) fn write_done(&self) {
        if self.write_waiting.load(Ordering::Relaxed) != 0 {
            self.write_waiting.store(0, Ordering::Relaxed);
        }
    }

    /// HTTP/2 request `id`'s response handed data to hyper that the client has yet to take
    /// (`true`), or asked for more, so it took it (`false`).
    pub(super) fn unsent(&self, id: u64, waiting: bool) {
        let mut unsent = self.unsent.lock();
        unsent.retain(|(r, _)| *r != id);
        if waiting {
            unsent.push((id, Instant::now()));
        }
    }

    /// Since when the client has taken nothing that waits for it, if anything waits.
    fn stalled_since(&self) -> Option<Instant> {
        let socket = match self.write_waiting.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.origin + std::time::Duration::from_millis(ms - 1)),
        };
        let stream = self.unsent.lock().iter().map(|(_, at)| *at).min();
        socket.into_iter().chain(stream).min()
    }

    /// A request starts; returns how many this connection has now served, this one included.
    pub(super) fn begin(&self) -> u64 {
        self.inflight.fetch_add(1, Ordering::AcqRel);
        if self.stopping.load(Ordering::Acquire) {
            // The head the shutdown waited for is complete: close after this request now
            // (HTTP/2: GOAWAY), rather than at the watchdog's next look.
            self.retire.notify_one();
        }
        self.served.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// A request is done: answered, or cancelled by the client before its response head.
    /// A connection whose client cancels most of its recent requests is retired (HTTP/2
    /// GOAWAY): that is the rapid-reset attack on streams already being proxied, which the
    /// HTTP/2 layer's own reset cap (streams reset before they are accepted) cannot see. An
    /// HTTP/1.1 client cancels by closing its connection: nothing to count.
    pub(super) fn end(&self, answered: bool) {
        *self.marks.lock() = Marks {
            idle_since: Instant::now(),
            head_started: None,
        };
        self.inflight.fetch_sub(1, Ordering::AcqRel);
        if !self.http2.load(Ordering::Acquire) {
            return;
        }
        let mut window = self.window.lock();
        window.0 += 1;
        window.1 += u32::from(!answered);
        if window.1 > RESETS_ALLOWED {
            tracing::warn!(
                "client cancels most of its requests (rapid reset): closing its connection"
            );
            *window = (0, 0);
            self.retire.notify_one();
        } else if window.0 >= RESET_WINDOW {
            *window = (0, 0);
        }
    }

    /// The connection is shutting down (the watchdog saw the signal).
    pub(super) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// An HTTP/1.1 request head has begun arriving and is not complete yet.
    fn head_in_progress(&self) -> bool {
        self.inflight.load(Ordering::Acquire) == 0
            && !self.http2.load(Ordering::Acquire)
            && self.marks.lock().head_started.is_some()
    }

    /// A request is in flight, or a head under way.
    fn busy(&self) -> bool {
        self.inflight.load(Ordering::Acquire) > 0 || self.head_in_progress()
    }

    /// The number of requests begun so far, when none is in flight on an HTTP/1 connection:
    /// bytes read now belong to the next head. `None` while a request (its body) is in flight,
    /// and on HTTP/2.
    pub(super) fn between_requests(&self) -> Option<u64> {
        (self.inflight.load(Ordering::Acquire) == 0 && !self.http2.load(Ordering::Acquire))
            .then(|| self.served.load(Ordering::Acquire))
    }

    pub(super) fn bytes_read(&self) {
        if self.inflight.load(Ordering::Acquire) == 0 && !self.http2.load(Ordering::Acquire) {
            let mut marks = self.marks.lock();
            marks.head_started.get_or_insert_with(Instant::now);
        }
    }

    fn deadline(&self, s: &ListenerSettings) -> (Instant, Overdue) {
        let marks = *self.marks.lock();
        let fresh = self.served.load(Ordering::Acquire) == 0;
        match marks.head_started {
            // A fresh connection's first head counts from the connection's start, not from its
            // first byte: a slowloris that waits out most of the timeout before its first byte
            // would otherwise hold the socket for two of them.
            Some(_) if fresh => (marks.idle_since + s.header_read_timeout, Overdue::Head),
            // A kept-alive connection idles under `idle`; its next head then has its own
            // `header_read` from its first byte.
            Some(started) => (started + s.header_read_timeout, Overdue::Head),
            // A fresh connection must send its first head within the header timeout.
            None if fresh => (marks.idle_since + s.header_read_timeout, Overdue::Idle),
            None => (marks.idle_since + s.idle_timeout, Overdue::Idle),
        }
    }

    /// When the watchdog should look next. While a request is in flight nothing can be
    /// overdue: look again after the shorter timeout (never a deadline in the past, which
    /// would spin for as long as a slow request takes). A request that ends before that look
    /// leaves a deadline later than it, so the look then finds the exact deadline.
    ///
    /// An idle kept-alive connection is looked at every `header_read` too, not only at its
    /// idle deadline: the first byte of its next head does not wake the watchdog (requests
    /// never do), so without these looks a head started after the last one would be noticed
    /// only at the idle deadline, and a slowloris on a kept-alive connection would have `idle`
    /// for its head instead of `header_read`. With them, the look after the first byte finds
    /// the head's exact deadline. Costs one wake-up per `header_read` per idle connection.
    fn next_check(&self, s: &ListenerSettings) -> Instant {
        if self.inflight.load(Ordering::Acquire) > 0 {
            let look = Instant::now() + s.idle_timeout.min(s.header_read_timeout);
            let look = look.min(Instant::now() + s.send_timeout);
            return match self.stalled_since() {
                Some(since) => look.min(since + s.send_timeout).max(Instant::now()),
                None => look,
            };
        }
        let (deadline, kind) = self.deadline(s);
        match kind {
            Overdue::Idle => deadline.min(Instant::now() + s.header_read_timeout),
            _ => deadline,
        }
    }

    fn overdue(&self, s: &ListenerSettings) -> Overdue {
        if self.inflight.load(Ordering::Acquire) > 0 {
            let stalled = self
                .stalled_since()
                .is_some_and(|since| Instant::now() >= since + s.send_timeout);
            return if stalled { Overdue::Send } else { Overdue::No };
        }
        let (deadline, kind) = self.deadline(s);
        if Instant::now() >= deadline {
            kind
        } else {
            Overdue::No
        }
    }
}
