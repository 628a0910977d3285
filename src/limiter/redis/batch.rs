//! Checks that are waiting at the same moment on one worker go to Redis as one script call
//! (`bucket.lua`'s "batch" mode): under load a call carries many requests' checks, so Redis
//! runs one script (one command, one read, one write) for all of them instead of one each.
//!
//! There is no timer and no waiting for a batch to fill: a worker's requests queue their
//! checks as they run, and the batching task, once it has a check, lets the worker's event
//! loop turn a few times (`GATHER_TURNS`: each turn polls the sockets and runs the requests
//! that became ready) and then takes everything queued. A lone request goes alone after those
//! few idle turns (microseconds). Calls are not serialised: a batch is sent while earlier ones
//! are still out. On a Redis Cluster every check queued here has its buckets in one slot (a
//! check spanning slots queues one check per slot: see `cluster`), and a batch goes as one
//! call per slot.
//!
//! The checks of a batch run one after the other inside one atomic script, so each keeps the
//! semantics of a "check" call of its own: charged all-or-nothing, and a later check of the
//! batch sees what an earlier one took from a shared bucket. Identical checks (one busy
//! client, or a limit all clients share) go as one group: their keys and values are sent and
//! parsed once, and the script runs the group's checks one after the other.
//!
//! A check carries its deadline: a call is bounded by the earliest of its checks', and a check
//! still queued past its own fails without being sent. The request waits on its answer alone,
//! with no timer of its own.
//!
//! A settled cost's difference (`cost.from_response`) goes the same way, as a group of its own
//! that nobody waits for: charged or refunded after the checks queued before it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::link::Link;
use super::wire::{parse_items, reply_bytes, Mode, QuotaArgs, Reply, BUCKET_REPLY};
use super::{bump, by_deadline, Bucket, Counters, Failure, Unavailable, BUCKET_SCRIPT};
use crate::limiter::ban::BanArgs;
use crate::limiter::Rate;

/// At most this many checks share one call.
const MAX_BATCH: usize = 128;

/// Turns of the worker's event loop (each polls its sockets once) a batch gathers checks for
/// once its first check is queued. Measured (benches, wrk -c64, one Redis): 0 turns made 0.119
/// script calls per request and cost Redis 4.1 us per request; 4 turns, 0.066 calls and 2.9 us,
/// with the same p50 and a lower p99; 8 turns gained nothing more.
const GATHER_TURNS: usize = 4;

/// A check's buckets, in a request's own allocation: a route has one or two limits.
type PerBucket<T> = SmallVec<[T; 2]>;

/// One bucket's rate, cost, enforcement, quota and ban, as the script takes them.
/// A bucket's rate, cost, leased tokens asked, enforcement, quota, ban, and whether it may owe.
type Args = (
    Rate,
    u32,
    u32,
    bool,
    Option<QuotaArgs>,
    Option<BanArgs>,
    bool,
);

/// One request's check, waiting for its batch.
struct Job {
    /// The buckets' keys (moved into the call), and each bucket's rate, cost and enforcement.
    keys: PerBucket<String>,
    /// The slot of every key (on a single server, 0).
    slot: u16,
    args: PerBucket<Args>,
    /// Past this, the check fails as timed out.
    deadline: Instant,
    /// Where the check's answer goes; `None` for a settlement, which nobody waits for.
    reply: Option<oneshot::Sender<Result<Reply, Failure>>>,
    /// A settlement (`Charge` or `Refund` of its one bucket) rather than a check.
    settle: Option<Mode>,
}

/// The queue of one worker's checks. On a single server a batch's keys may live anywhere; on a
/// cluster every check queued here has its buckets in one slot, and a batch is sent as one call
/// per slot its checks live in.
#[derive(Debug)]
pub(super) struct Batcher {
    jobs: mpsc::UnboundedSender<Job>,
}

impl Batcher {
    /// Start the batching task on the current runtime. `timeout` is what the failures of
    /// timed-out checks report.
    pub(super) fn start(link: Arc<Link>, counters: Arc<Counters>, timeout: Duration) -> Self {
        let (jobs, queue) = mpsc::unbounded_channel();
        tokio::spawn(collect(link, queue, counters, timeout));
        Self { jobs }
    }

    /// Check `buckets` as one, like a "check" call, in the next batch; answered by `deadline`.
    pub(super) async fn check<'b, 'a: 'b>(
        &self,
        buckets: impl Iterator<Item = &'b Bucket<'a>> + Clone,
        deadline: Instant,
    ) -> Result<Reply, Failure> {
        let (reply, answer) = oneshot::channel();
        let job = Job::of(buckets, deadline, Some(reply), None);
        if self.jobs.send(job).is_err() {
            return Err(gone());
        }
        answer.await.unwrap_or_else(|_| Err(gone()))
    }

    /// Charge or refund (`mode`) `bucket` its cost in the next batch, unanswered; `false` when
    /// the batching task has stopped.
    pub(super) fn settle(&self, bucket: &Bucket<'_>, mode: Mode, deadline: Instant) -> bool {
        let job = Job::of(std::iter::once(bucket), deadline, None, Some(mode));
        self.jobs.send(job).is_ok()
    }
}

impl Job {
    fn of<'b, 'a: 'b>(
        buckets: impl Iterator<Item = &'b Bucket<'a>> + Clone,
        deadline: Instant,
        reply: Option<oneshot::Sender<Result<Reply, Failure>>>,
        settle: Option<Mode>,
    ) -> Self {
        Self {
            keys: buckets.clone().map(|b| b.key.clone()).collect(),
            slot: buckets.clone().next().map_or(0, |b| b.slot),
            args: buckets
                .map(|b| {
                    (
                        b.rate.clone(),
                        b.cost,
                        b.lease,
                        b.enforced,
                        b.quota,
                        b.ban,
                        b.debt,
                    )
                })
                .collect(),
            deadline,
            reply,
            settle,
        }
    }

    /// How many checks its group stands for in the call: 0 for a settlement's charge, -1 for
    /// its refund (see `bucket.lua`).
    fn checks_marker(&self, members: usize) -> i64 {
        match self.settle {
            Some(Mode::Refund) => -1,
            Some(_) => 0,
            None => i64::try_from(members).unwrap_or(i64::MAX),
        }
    }
}

fn gone() -> Failure {
    Failure::new(Unavailable::Error, "the Redis batching task has stopped")
}

/// Take everything queued, send it as one call (without waiting for it), repeat.
async fn collect(
    link: Arc<Link>,
    mut queue: mpsc::UnboundedReceiver<Job>,
    counters: Arc<Counters>,
    timeout: Duration,
) {
    let cluster = link.is_cluster();
    while let Some(batch) = gather(&mut queue).await {
        if cluster {
            for batch in by_slot(batch, |j| j.slot) {
                tokio::spawn(send(link.clone(), batch, counters.clone(), timeout));
            }
        } else {
            tokio::spawn(send(link.clone(), batch, counters.clone(), timeout));
        }
    }
}

/// The next batch from `queue` (`None`: closed): its first item, then, after the worker's
/// event loop turned `GATHER_TURNS` times (the requests that became ready meanwhile join this
/// call; each turn is microseconds on an idle worker), everything queued, at most `MAX_BATCH`.
pub(super) async fn gather<T>(queue: &mut mpsc::UnboundedReceiver<T>) -> Option<Vec<T>> {
    let first = queue.recv().await?;
    for _ in 0..GATHER_TURNS {
        tokio::task::yield_now().await;
    }
    let mut batch = Vec::with_capacity(1 + queue.len().min(MAX_BATCH - 1));
    batch.push(first);
    while batch.len() < MAX_BATCH {
        match queue.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
    Some(batch)
}

/// A cluster batch split by the slot its items live in (each check's buckets share one), in
/// the order each slot first appears: a script call may only touch keys of one slot.
pub(super) fn by_slot<T>(batch: Vec<T>, slot_of: impl Fn(&T) -> u16) -> Vec<Vec<T>> {
    let mut slots: Vec<(u16, Vec<T>)> = Vec::new();
    for job in batch {
        let slot = slot_of(&job);
        match slots.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, jobs)) => jobs.push(job),
            None => slots.push((slot, vec![job])),
        }
    }
    slots.into_iter().map(|(_, jobs)| jobs).collect()
}

/// One script call for `batch`; every check gets its own part of the reply, or the failure.
// One script call end to end: each check's part of the reply is handed over in place.
#[allow(clippy::too_many_lines)]
async fn send(link: Arc<Link>, mut batch: Vec<Job>, counters: Arc<Counters>, timeout: Duration) {
    let now = Instant::now();
    for late in batch.extract_if(.., |j| j.deadline <= now) {
        if let Some(reply) = late.reply {
            let _ = reply.send(Err(Failure::timed_out(timeout)));
        }
    }
    let Some(deadline) = batch.iter().map(|j| j.deadline).min() else {
        return;
    };
    bump(&counters.redis_calls);
    // One slot for the whole batch (see `by_slot`).
    let slot = batch.first().map_or(0, |j| j.slot);
    let groups = group(&batch);
    let markers: Vec<i64> = (groups.iter())
        .map(|members| batch[members[0]].checks_marker(members.len()))
        .collect();
    let n = batch.len();
    let (mut keys, mut args, mut replies) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for job in batch {
        keys.push(job.keys);
        args.push(job.args);
        replies.push(job.reply);
    }
    // Each group's buckets, with the keys of its first check moved into the call.
    let buckets: Vec<PerBucket<Bucket<'_>>> = groups
        .iter()
        .map(|members| {
            let first = members[0];
            std::mem::take(&mut keys[first])
                .into_iter()
                .zip(&args[first])
                .map(
                    |(key, (rate, cost, lease, enforced, quota, ban, debt))| Bucket {
                        key,
                        slot,
                        rate,
                        cost: *cost,
                        lease: *lease,
                        enforced: *enforced,
                        quota: *quota,
                        ban: *ban,
                        debt: *debt,
                    },
                )
                .collect()
        })
        .collect();
    let on = link.now();
    let call = on.conn.run_batch(
        &BUCKET_SCRIPT,
        markers.iter().zip(&buckets).map(|(&m, b)| (m, b.iter())),
    );
    let value = by_deadline(deadline, timeout, call).await;
    link.settle(&on, &value);
    // A reply of the wrong shape, or of the wrong length for this batch, is another call's:
    // the connection is out of step (see `link`).
    let expected: usize = (groups.iter().zip(&markers))
        .map(|(members, &m)| {
            usize::try_from(m).unwrap_or(0) * BUCKET_REPLY * args[members[0]].len()
        })
        .sum();
    let outcome = match &value {
        Ok(value) => reply_bytes(value)
            .filter(|items| items.len() == expected)
            .ok_or_else(|| {
                link.out_of_step(&on);
                Failure::unexpected_reply()
            }),
        Err(failure) => Err(failure.clone()),
    };
    let items = match outcome {
        Ok(items) => items,
        Err(failure) => {
            for reply in replies.into_iter().flatten() {
                let _ = reply.send(Err(failure.clone()));
            }
            return;
        }
    };
    hand_out(&groups, &args, items, &mut replies);
}

/// Each check's part of the reply `items` handed to it: a group's checks are identical, and
/// each reply is one bucket reply per bucket of its first.
fn hand_out(
    groups: &[SmallVec<[usize; 4]>],
    args: &[PerBucket<Args>],
    items: &[u8],
    replies: &mut [Option<oneshot::Sender<Result<Reply, Failure>>>],
) {
    let mut at = 0;
    for members in groups {
        // A settlement has no reply, and nobody to hand one to.
        if replies[members[0]].is_none() {
            continue;
        }
        let bucket_args = &args[members[0]];
        let n = BUCKET_REPLY * bucket_args.len();
        for &member in members {
            let reply = items
                .get(at..at + n)
                .and_then(|part| parse_items(part, bucket_args.iter().map(|a| a.3)))
                .ok_or_else(Failure::unexpected_reply);
            at += n;
            if let Some(sender) = replies[member].take() {
                let _ = sender.send(reply);
            }
        }
    }
}

/// The batch's checks in groups of identical ones (the same keys, rates, costs and
/// enforcement), in the order each group first appears; each group lists its checks in order.
fn group(batch: &[Job]) -> Vec<SmallVec<[usize; 4]>> {
    let mut groups: Vec<SmallVec<[usize; 4]>> = Vec::new();
    let mut by_keys: HashMap<&[String], SmallVec<[usize; 1]>> = HashMap::new();
    // The group of the check before: a busy client's checks come in runs, and one like the
    // check before it joins that group without hashing its keys.
    let mut previous: Option<(&Job, usize)> = None;
    for (j, job) in batch.iter().enumerate() {
        // A settlement is a group of its own, where it was queued.
        if job.settle.is_some() {
            groups.push(SmallVec::from_elem(j, 1));
            previous = None;
            continue;
        }
        if let Some((before, g)) = previous {
            if before.keys == job.keys && before.args == job.args {
                groups[g].push(j);
                previous = Some((job, g));
                continue;
            }
        }
        let same_keys = by_keys.entry(job.keys.as_slice()).or_default();
        let g = match same_keys
            .iter()
            .find(|&&g| batch[groups[g][0]].args == job.args)
        {
            Some(&g) => {
                groups[g].push(j);
                g
            }
            None => {
                same_keys.push(groups.len());
                groups.push(SmallVec::from_elem(j, 1));
                groups.len() - 1
            }
        };
        previous = Some((job, g));
    }
    groups
}
