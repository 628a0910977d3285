//! An upstream's capacity: at most a cap of requests in flight per target, the rest waiting in
//! a bounded queue that is fair across identities (`queue`), the cap fixed or learned from
//! latency (`adaptive`).
//!
//! One mutex per capped upstream, taken to enter and to leave: the queue's fairness needs one
//! order of every waiting request, and an uncapped upstream has no gate at all. A full queue
//! is fair too: a request of an identity with fewer waiting pushes out the newest request of
//! the identity with the most (`queue_full` for that one), so one heavy tenant cannot fill it.

mod adaptive;
mod queue;
mod slot;
mod spec;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

pub use adaptive::{AdaptiveSpec, PROBE_SAMPLES};
use queue::{FairQueue, Waiter};
pub use queue::{Priority, SHARES};
pub use slot::Slot;
pub use spec::{Cap, Handles, Refusal, Refused, Spec, Stats};

/// What a queued request is sent instead of a target when a lighter identity's request took
/// its place in the full queue.
const PUSHED_OUT: usize = usize::MAX;

/// Which targets take traffic now (health lives with the upstream).
pub type Healthy = Box<dyn Fn(usize) -> bool + Send + Sync>;

/// One capped upstream's slots and queue.
pub struct Gate {
    inner: Mutex<Inner>,
    /// Wakes the waiting requests when the drain sets `close_at`.
    closing: tokio::sync::Notify,
    healthy: Healthy,
    handles: Handles,
    origin: Instant,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Inner {
    spec: Spec,
    targets: Vec<Target>,
    queue: FairQueue<Grant>,
    next_id: u64,
    /// The average response time, smoothed: what `Retry-After` estimates the wait from.
    latency: Duration,
    /// When a drain ends: requests still waiting then are answered `503` before it does.
    close_at: Option<Instant>,
}

/// One target's requests in flight and its cap.
#[derive(Debug)]
struct Target {
    in_flight: usize,
    adaptive: Option<adaptive::Gradient>,
    fixed: usize,
}

impl Target {
    fn new(cap: &Cap) -> Self {
        match cap {
            Cap::Fixed(n) => Self {
                in_flight: 0,
                adaptive: None,
                fixed: *n,
            },
            Cap::Adaptive(spec) => Self {
                in_flight: 0,
                adaptive: Some(adaptive::Gradient::new(spec.clone())),
                fixed: 0,
            },
        }
    }

    fn cap(&self) -> usize {
        self.adaptive
            .as_ref()
            .map_or(self.fixed, adaptive::Gradient::cap)
    }

    fn has_room(&self) -> bool {
        self.in_flight < self.cap()
    }
}

/// What a waiting request is handed when its turn comes: the target, and what it must
/// not get while another target is usable (targets it already tried). Its class and key put
/// it back in the queue when only targets it tried have room.
#[derive(Debug)]
struct Grant {
    tried: crate::Small<usize>,
    to: oneshot::Sender<usize>,
    priority: Priority,
    key: u128,
}

/// Who is asking for a slot.
#[derive(Debug, Clone, Copy)]
pub struct Ticket<'a> {
    /// The identity the queue is fair across.
    pub key: u128,
    /// The client's address (`identity::peer_key`): a full queue is fair across those too.
    pub peer: u64,
    pub priority: Priority,
    /// Targets this request already tried: it waits for another while one is usable.
    pub tried: &'a [usize],
}

impl Gate {
    pub fn new(spec: &Spec, targets: usize, healthy: Healthy, handles: Handles) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner {
                targets: (0..targets).map(|_| Target::new(&spec.cap)).collect(),
                spec: spec.clone(),
                queue: FairQueue::default(),
                next_id: 0,
                latency: Duration::ZERO,
                close_at: None,
            }),
            closing: tokio::sync::Notify::new(),
            healthy,
            handles,
            origin: Instant::now(),
        })
    }

    /// New limits from a reload: requests waiting stay queued (a larger cap lets some go at
    /// once), an adaptive cap keeps what it learned.
    pub fn respec(&self, spec: &Spec) {
        let mut inner = self.inner.lock();
        for t in &mut inner.targets {
            match (&spec.cap, &mut t.adaptive) {
                (Cap::Adaptive(a), Some(g)) => g.respec(a.clone()),
                (cap, _) => {
                    let in_flight = t.in_flight;
                    *t = Target::new(cap);
                    t.in_flight = in_flight;
                }
            }
        }
        inner.spec = spec.clone();
        self.dispatch(&mut inner);
    }

    /// A slot for `ticket`: at once when a target has room and nobody waits, else after its
    /// turn in the queue. Dropping the future leaves the queue at once.
    pub async fn admit(self: &Arc<Self>, ticket: Ticket<'_>) -> Result<Slot, Refusal> {
        let since = Instant::now();
        let (rx, id, deadline) = {
            let mut inner = self.inner.lock();
            if inner.queue.len() == 0 {
                if let Some(target) = self.choose(&mut inner, ticket.tried) {
                    drop(inner);
                    self.handles.wait.observe(0.0);
                    return Ok(self.slot(target, Duration::ZERO));
                }
            }
            self.make_room(&mut inner, &ticket)?;
            let (to, rx) = oneshot::channel();
            let id = inner.next_id;
            inner.next_id += 1;
            let grant = Grant {
                tried: ticket.tried.iter().copied().collect(),
                to,
                priority: ticket.priority,
                key: ticket.key,
            };
            let waiter = Waiter {
                id,
                peer: ticket.peer,
                item: grant,
            };
            inner.queue.push(ticket.priority, ticket.key, waiter);
            // A slot can be free while requests wait: retries that only targets they tried
            // have room for. The newcomer takes it in its turn.
            self.dispatch(&mut inner);
            (rx, id, since + inner.spec.timeout)
        };
        let mut queued = Queued {
            gate: self,
            priority: ticket.priority,
            key: ticket.key,
            id,
            rx,
            done: false,
        };
        let target = match self.wait(&mut queued.rx, deadline).await {
            Ok(target) => target,
            Err(why) => {
                drop(queued);
                let inner = self.inner.lock();
                let waited = since.elapsed();
                return Err(Refusal {
                    waited,
                    ..self.refusal(&inner, why)
                });
            }
        };
        queued.done = true;
        let waited = since.elapsed();
        self.handles.wait.observe(waited.as_secs_f64());
        Ok(self.slot(target, waited))
    }

    /// Room in the queue for `ticket`: a full queue pushes out a heavier address's or
    /// identity's newest request, or refuses the newcomer.
    fn make_room(&self, inner: &mut Inner, ticket: &Ticket<'_>) -> Result<(), Refusal> {
        if inner.queue.len() < inner.spec.queue_size {
            return Ok(());
        }
        match inner
            .queue
            .push_out(ticket.priority, ticket.key, ticket.peer)
        {
            // Told it was pushed out: its wait ends with `queue_full`.
            Some(out) => {
                let _ = out.item.to.send(PUSHED_OUT);
                Ok(())
            }
            None => Err(self.refusal(inner, Refused::QueueFull)),
        }
    }

    /// The slot `rx` brings by `deadline`, or by the drain's end if that comes first.
    async fn wait(
        &self,
        rx: &mut oneshot::Receiver<usize>,
        deadline: Instant,
    ) -> Result<usize, Refused> {
        loop {
            let closing = self.closing.notified();
            tokio::pin!(closing);
            closing.as_mut().enable();
            let close_at = self.inner.lock().close_at;
            let (until, why) = match close_at {
                Some(at) if at < deadline => (at, Refused::ShuttingDown),
                _ => (deadline, Refused::QueueTimeout),
            };
            tokio::select! {
                biased;
                granted = &mut *rx => {
                    return match granted {
                        Ok(PUSHED_OUT) => Err(Refused::QueueFull),
                        Ok(target) => Ok(target),
                        Err(_) => Err(why),
                    };
                }
                () = tokio::time::sleep_until(until) => {
                    // Its turn may have come at the deadline: taken, not wasted.
                    return rx.try_recv().ok().filter(|t| *t != PUSHED_OUT).ok_or(why);
                }
                () = &mut closing => {}
            }
        }
    }

    /// The proxy drains until `by`: requests still waiting shortly before are answered `503`
    /// (a drain that ends first would cut them without an answer).
    pub fn close_by(&self, by: Instant) {
        let mut inner = self.inner.lock();
        if inner.close_at.is_none_or(|at| by < at) {
            inner.close_at = Some(by);
            drop(inner);
            self.closing.notify_waiters();
        }
    }

    /// The caps and the queue now.
    pub fn stats(&self) -> Stats {
        let inner = self.inner.lock();
        Stats {
            targets: inner
                .targets
                .iter()
                .map(|t| (t.in_flight, t.cap()))
                .collect(),
            queued: inner.queue.len(),
            queued_by_class: inner.queue.by_class(),
            identities_queued: inner.queue.identities(),
            queue_size: inner.spec.queue_size,
            timeout: inner.spec.timeout,
            min_rtt: inner
                .targets
                .iter()
                .map(|t| t.adaptive.as_ref().and_then(adaptive::Gradient::min_rtt))
                .collect(),
        }
    }

    /// `target`'s cap now (0 for a target it does not have).
    pub fn cap(&self, target: usize) -> usize {
        self.inner.lock().targets.get(target).map_or(0, Target::cap)
    }

    fn slot(self: &Arc<Self>, target: usize, waited: Duration) -> Slot {
        let generation = {
            let inner = self.inner.lock();
            inner.targets[target]
                .adaptive
                .as_ref()
                .map_or(0, |g| g.generation)
        };
        Slot {
            gate: Arc::clone(self),
            target,
            generation,
            sent: Instant::now(),
            took: None,
            waited,
        }
    }

    fn refusal(&self, inner: &Inner, why: Refused) -> Refusal {
        self.handles.refused[why as usize].inc();
        let cap = inner.targets.iter().map(Target::cap).sum::<usize>().max(1);
        // The queue ahead, served `cap` at a time at the average response time.
        let ahead = inner.queue.len() as u32 / cap as u32 + 1;
        let retry_after = (inner.latency * ahead).as_secs().max(1);
        Refusal {
            why,
            retry_after,
            waited: Duration::ZERO,
        }
    }

    /// A target with room for a request that tried `tried`: a healthy one (any, when none
    /// is), one not tried yet while one is usable (a retry waits for it rather than go back
    /// to the target that just failed), the least loaded of those. Counted in.
    fn choose(&self, inner: &mut Inner, tried: &[usize]) -> Option<usize> {
        let targets = &mut inner.targets;
        let any_healthy = (0..targets.len()).any(|t| (self.healthy)(t));
        let usable = |t: usize| !any_healthy || (self.healthy)(t);
        let fresh = (0..targets.len()).any(|t| usable(t) && !tried.contains(&t));
        let mut best: Option<(f64, usize)> = None;
        for (i, t) in targets.iter_mut().enumerate() {
            if !usable(i) || (fresh && tried.contains(&i)) {
                continue;
            }
            if !t.has_room() {
                if let Some(g) = &mut t.adaptive {
                    g.reached();
                }
                continue;
            }
            let load = t.in_flight as f64 / t.cap() as f64;
            if best.is_none_or(|b| load < b.0) {
                best = Some((load, i));
            }
        }
        let (_, chosen) = best?;
        let t = &mut targets[chosen];
        t.in_flight += 1;
        if !t.has_room() {
            if let Some(g) = &mut t.adaptive {
                g.reached();
            }
        }
        Some(chosen)
    }

    /// Hand free slots to waiting requests, in their turn. A retry whose turn brings only
    /// targets it tried goes back in the queue and the next request takes the slot.
    fn dispatch(&self, inner: &mut Inner) {
        let mut passed = Vec::new();
        while inner.queue.len() > 0 {
            let Some(target) = self.choose(inner, &[]) else {
                break;
            };
            let Some(waiter) = inner.queue.pop() else {
                inner.targets[target].in_flight -= 1;
                break;
            };
            let target = if waiter.item.tried.contains(&target) {
                inner.targets[target].in_flight -= 1;
                match self.choose(inner, &waiter.item.tried) {
                    Some(other) => other,
                    None => {
                        passed.push(waiter);
                        continue;
                    }
                }
            } else {
                target
            };
            if waiter.item.to.send(target).is_err() {
                inner.targets[target].in_flight -= 1;
            }
        }
        for waiter in passed {
            let (priority, key) = (waiter.item.priority, waiter.item.key);
            inner.queue.push(priority, key, waiter);
        }
    }

    fn release(&self, target: usize, generation: u64, took: Option<Duration>) {
        let mut inner = self.inner.lock();
        let now = self.origin.elapsed();
        if let Some(took) = took {
            // An average over about the last hundred responses.
            inner.latency = if inner.latency.is_zero() {
                took
            } else {
                (inner.latency * 99 + took) / 100
            };
        }
        if let Some(t) = inner.targets.get_mut(target) {
            t.in_flight = t.in_flight.saturating_sub(1);
            if let (Some(g), Some(took)) = (&mut t.adaptive, took) {
                g.sample(now, took, generation);
            }
        }
        self.dispatch(&mut inner);
    }
}

/// A request waiting in the queue: leaves it when dropped, or gives back the slot its turn
/// brought if that came as it was dropped.
struct Queued<'a> {
    gate: &'a Gate,
    priority: Priority,
    key: u128,
    id: u64,
    rx: oneshot::Receiver<usize>,
    done: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut inner = self.gate.inner.lock();
        if inner
            .queue
            .remove(self.priority, self.key, self.id)
            .is_some()
        {
            return;
        }
        // Its turn came: the slot it was handed goes to the next in turn.
        if let Ok(target) = self.rx.try_recv() {
            if let Some(t) = inner
                .targets
                .get_mut(target)
                .filter(|_| target != PUSHED_OUT)
            {
                t.in_flight = t.in_flight.saturating_sub(1);
            }
            self.gate.dispatch(&mut inner);
        }
    }
}

#[cfg(test)]
mod tests;
