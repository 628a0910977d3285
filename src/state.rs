//! What every request and control task shares: the live runtime, the clock, the metrics and
//! the workers.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use tokio::sync::watch;

use crate::config::Settings;
use crate::limiter::Clock;
use crate::metrics::Metrics;
use crate::runtime::Runtime;
use crate::workers::Workers;

/// The proxy's shared state. One per running proxy (tests may run several in one process).
#[derive(Debug)]
pub struct State {
    /// The live runtime; a reload swaps in a whole new one.
    pub runtime: ArcSwap<Runtime>,
    pub clock: Clock,
    pub metrics: Metrics,
    /// Requests in flight, all listeners together (for `max_inflight`).
    pub inflight: AtomicUsize,
    pub workers: Arc<Workers>,
    /// The generation of the live runtime: 1 as started, one more for every reload.
    pub generation: watch::Sender<u64>,
    /// Shutting down: set on SIGTERM (before `shutdown_delay` and the drain), never cleared.
    draining: AtomicBool,
    /// Operators' bans and overrides (the admin API's); kept across reloads.
    pub control: Arc<crate::control::Control>,
    /// Resident memory is past `max_rss`: new requests get 503, new connections are refused.
    pub memory_over: AtomicBool,
}

impl State {
    pub fn new(runtime: Runtime, workers: Arc<Workers>, metrics: Metrics) -> Self {
        metrics.loaded(&runtime.settings.source);
        Self {
            runtime: ArcSwap::from_pointee(runtime),
            clock: Clock::new(),
            metrics,
            inflight: AtomicUsize::new(0),
            workers,
            generation: watch::Sender::new(1),
            draining: AtomicBool::new(false),
            control: Arc::new(crate::control::Control::new()),
            memory_over: AtomicBool::new(false),
        }
    }

    /// From now on `/readyz` fails: the proxy is shutting down.
    pub fn begin_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// The proxy is shutting down (`begin_draining` was called).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The state of a proxy serving `settings` with `workers` workers, built from nothing (no
    /// previous runtime): what `app::start` does, for harnesses that drive `proxy::handle`
    /// themselves. Needs a tokio runtime when the limiter is Redis.
    pub fn build(settings: Settings, workers: usize) -> Result<Self, crate::runtime::BuildError> {
        let workers = Arc::new(Workers::new(workers));
        let metrics = Metrics::new();
        let runtime = Runtime::build(settings, None, &workers, &metrics)?;
        Ok(Self::new(runtime, workers, metrics))
    }

    /// Make `next` the live runtime and return its generation. Each worker lets go of the
    /// runtime it held (see `current`), so an idle worker does not keep the old one alive.
    pub fn swap(&self, next: Runtime) -> u64 {
        self.runtime.store(Arc::new(next));
        self.workers.on_every(|_| async { forget_current() });
        let mut generation = 0;
        self.generation.send_modify(|g| {
            *g += 1;
            generation = *g;
        });
        generation
    }

    /// The live runtime, as a reference only this thread counts.
    ///
    /// Every request holds the runtime it started with. Cloning the `Arc` of the live one
    /// would have every worker write the same reference count twice per request, and each of
    /// those writes waits for the line to come back from the other core. Instead each thread
    /// keeps the runtime it last saw in an `Arc` of its own, and its requests clone that one;
    /// checking that it is still the live one is a read (`ArcSwap::load`).
    pub fn current(&self) -> Held {
        let live = self.runtime.load();
        SEEN.with_borrow_mut(|seen| match seen {
            Some(held) if Arc::ptr_eq(&**held, &*live) => held.clone(),
            _ => seen.insert(Arc::new(Guard::into_inner(live))).clone(),
        })
    }
}

/// A runtime as one thread holds it. The second `Arc` is the point: a reference count that
/// only this thread's requests write.
#[allow(clippy::redundant_allocation)]
pub type Held = Arc<Arc<Runtime>>;

thread_local! {
    /// The runtime this thread last served with: a cache of `State::runtime`, never the source
    /// of truth (it is checked against the live one on every use).
    static SEEN: RefCell<Option<Held>> = const { RefCell::new(None) };
}

/// Let go of the runtime this thread last served with.
fn forget_current() {
    SEEN.with_borrow_mut(Option::take);
}
