//! Concurrency slots in Redis: leases in a sorted set per limit and identity (`slots.lua`),
//! renewed in one batch per interval by one task per limit while held, released by ZREM.
//!
//! Takes and releases waiting at the same moment on one worker go to Redis as one script call
//! (`slots.lua`'s "batch" mode), gathered as `batch` gathers bucket checks: under load a call
//! carries many requests' takes and the releases of those that ended, on the worker's own
//! connection.
//!
//! A replica that dies stops renewing: its leases expire within the `lease` time and the
//! next take drops them. Renewals and releases are fire-and-forget: a lost one costs at most a
//! slot held until its lease ends.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Weak};
use std::time::Duration;

use ::redis::{Script, Value};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::batch::{by_slot, gather};
use super::failure::{by_deadline, Failure, Unavailable};
use super::link::Link;
use super::{bump, Counters, RedisLimiter};
use crate::identity::ClientId;
use crate::limiter::Limit;

static LEASE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("slots.lua")));

/// One limit's live leases in this replica, for its renewal task.
#[derive(Debug)]
pub struct SlotLeases {
    /// SlotLease ID -> its set's key.
    live: Mutex<HashMap<u128, Arc<str>>>,
    link: Arc<Link>,
    lease: Duration,
}

/// A lease held by a request; released when dropped.
#[derive(Debug)]
pub struct SlotLease {
    leases: Arc<SlotLeases>,
    id: u128,
    key: Arc<str>,
    /// The batcher of the worker that took it, which sends its release.
    batcher: Batcher,
}

/// What a take found.
#[derive(Debug)]
pub enum Taken {
    /// A slot, and the count in flight with it.
    Slot(SlotLease, u32),
    /// Every slot taken: the count in flight.
    Full(u32),
}

fn member(id: u128) -> String {
    format!("{id:032x}")
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        self.leases.live.lock().remove(&self.id);
        // Into the next batch; if the batcher is gone (shutdown), the lease expires unrenewed.
        let _ = self.batcher.ops.send(Op::Drop {
            key: self.key.clone(),
            id: self.id,
        });
    }
}

/// One take or release waiting for its worker's next lease call.
enum Op {
    Take {
        key: Arc<str>,
        max: u32,
        lease_ms: u64,
        id: u128,
        deadline: Instant,
        reply: oneshot::Sender<Result<(bool, u32), Failure>>,
    },
    Drop {
        key: Arc<str>,
        id: u128,
    },
}

impl Op {
    fn key(&self) -> &Arc<str> {
        match self {
            Op::Take { key, .. } | Op::Drop { key, .. } => key,
        }
    }
}

/// The queue of one worker's lease takes and releases.
#[derive(Debug, Clone)]
pub(super) struct Batcher {
    ops: mpsc::UnboundedSender<Op>,
}

impl Batcher {
    /// Start the batching task on the current runtime.
    pub(super) fn start(link: Arc<Link>, counters: Arc<Counters>, timeout: Duration) -> Self {
        let (ops, queue) = mpsc::unbounded_channel();
        tokio::spawn(collect(link, queue, counters, timeout));
        Self { ops }
    }
}

/// Take everything queued, send it as one call per slot (without waiting for it), repeat.
async fn collect(
    link: Arc<Link>,
    mut queue: mpsc::UnboundedReceiver<Op>,
    counters: Arc<Counters>,
    timeout: Duration,
) {
    let cluster = link.is_cluster();
    while let Some(batch) = gather(&mut queue).await {
        if cluster {
            for ops in by_slot(batch, |op| super::cluster::slot_of(op.key())) {
                tokio::spawn(send(link.clone(), ops, counters.clone(), timeout));
            }
        } else {
            tokio::spawn(send(link.clone(), batch, counters.clone(), timeout));
        }
    }
}

/// One "batch" call for `ops`; every take gets its answer, or the failure.
async fn send(link: Arc<Link>, mut ops: Vec<Op>, counters: Arc<Counters>, timeout: Duration) {
    let now = Instant::now();
    let late = ops.extract_if(
        ..,
        |op| matches!(op, Op::Take { deadline, .. } if *deadline <= now),
    );
    for op in late {
        if let Op::Take { reply, .. } = op {
            let _ = reply.send(Err(Failure::timed_out(timeout)));
        }
    }
    if ops.is_empty() {
        return;
    }
    // Releases alone wait longer: nothing waits on them.
    let deadline = ops
        .iter()
        .filter_map(|op| match op {
            Op::Take { deadline, .. } => Some(*deadline),
            Op::Drop { .. } => None,
        })
        .min()
        .unwrap_or(now + timeout * 4);
    bump(&counters.redis_calls);
    let call = batch_call(&ops);
    let replies: Vec<_> = (ops.into_iter())
        .filter_map(|op| match op {
            Op::Take { reply, .. } => Some(reply),
            Op::Drop { .. } => None,
        })
        .collect();
    let on = link.now();
    let value = by_deadline(deadline, timeout, on.conn.invoke(&call)).await;
    link.settle(&on, &value);
    let answers = match &value {
        Ok(Value::Array(items)) if items.len() == 2 * replies.len() => items
            .chunks(2)
            .map(|pair| parse(pair).ok_or_else(Failure::unexpected_reply))
            .collect(),
        Ok(other) => {
            // Another call's reply: the connection is out of step (see `link`).
            link.out_of_step(&on);
            let failure = Failure::new(
                Unavailable::Error,
                format!("unexpected lease reply {other:?}"),
            );
            vec![Err(failure); replies.len()]
        }
        Err(failure) => vec![Err(failure.clone()); replies.len()],
    };
    for (reply, answer) in replies.into_iter().zip(answers) {
        let _ = reply.send(answer);
    }
}

impl RedisLimiter {
    /// A limit's lease registry, with its renewal task (which ends once the registry is gone).
    pub(crate) fn leases(&self, lease: Duration) -> Arc<SlotLeases> {
        let leases = Arc::new(SlotLeases {
            live: Mutex::default(),
            link: self.shared.clone(),
            lease,
        });
        tokio::spawn(renew(Arc::downgrade(&leases)));
        leases
    }

    /// The lease batcher of worker `worker`, else of the shared connection.
    fn lease_batcher(&self, worker: Option<usize>) -> &Batcher {
        match self.worker(worker) {
            Some(w) => &w.leases,
            None => self.shared_leases.get_or_init(|| {
                Batcher::start(self.shared.clone(), self.counters.clone(), self.timeout)
            }),
        }
    }

    /// The Redis key of `client`'s leases under `limit`: the bucket's hash tag, so a cluster
    /// keeps an identity's keys together.
    pub(super) fn lease_key(&self, limit: &Limit, client: ClientId) -> String {
        let mut key = String::with_capacity(self.key_prefix.len() + limit.name.len() + 37);
        key.push_str(&self.key_prefix);
        key.push_str(&limit.name);
        key.push_str(":c:{");
        client.push_hex(&mut key);
        key.push('}');
        key
    }

    /// Take one of `max` slots of `client` under `limit`, as a lease in `leases`, in the next
    /// lease call of worker `worker` (`None`: of the shared connection).
    pub(crate) async fn take_lease(
        &self,
        worker: Option<usize>,
        leases: &Arc<SlotLeases>,
        limit: &Limit,
        client: ClientId,
        max: u32,
    ) -> Result<Taken, Unavailable> {
        let key: Arc<str> = self.lease_key(limit, client).into();
        let id = (u128::from(fastrand::u64(..)) << 64) | u128::from(fastrand::u64(..));
        let batcher = self.lease_batcher(worker).clone();
        // Registered before it is asked: a renewal may go out for it, never a lease unrenewed.
        leases.live.lock().insert(id, key.clone());
        let (reply, answer) = oneshot::channel();
        let op = Op::Take {
            key: key.clone(),
            max,
            lease_ms: u64::try_from(leases.lease.as_millis()).unwrap_or(u64::MAX),
            id,
            deadline: Instant::now() + self.timeout,
            reply,
        };
        let taken = if batcher.ops.send(op).is_ok() {
            answer.await.unwrap_or_else(|_| Err(stopped()))
        } else {
            Err(stopped())
        };
        match taken {
            Ok((true, n)) => Ok(Taken::Slot(
                SlotLease {
                    leases: leases.clone(),
                    id,
                    key,
                    batcher,
                },
                n,
            )),
            // Not added (or unknown: then it expires unrenewed).
            Ok((false, n)) => {
                leases.live.lock().remove(&id);
                Ok(Taken::Full(n))
            }
            Err(failure) => {
                leases.live.lock().remove(&id);
                Err(self.failed(&failure))
            }
        }
    }
}

fn stopped() -> Failure {
    Failure::new(
        Unavailable::Error,
        "the Redis lease batching task has stopped",
    )
}

/// `slots.lua`'s "batch" call of `ops`, each set's key sent once.
fn batch_call(ops: &[Op]) -> ::redis::ScriptInvocation<'static> {
    let mut call = LEASE_SCRIPT.prepare_invoke();
    call.arg("batch");
    let mut keys: Vec<&Arc<str>> = Vec::new();
    for op in ops {
        // Lua's KEYS count from 1.
        let at = 1 + keys.iter().position(|k| *k == op.key()).unwrap_or_else(|| {
            keys.push(op.key());
            call.key(&**op.key());
            keys.len() - 1
        });
        match op {
            Op::Take {
                max, lease_ms, id, ..
            } => {
                call.arg("t")
                    .arg(at)
                    .arg(*max)
                    .arg(*lease_ms)
                    .arg(member(*id));
            }
            Op::Drop { id, .. } => {
                call.arg("d").arg(at).arg(member(*id));
            }
        }
    }
    call
}

/// `{admitted, in flight}`.
fn parse(items: &[Value]) -> Option<(bool, u32)> {
    let int = |v: &Value| match v {
        Value::Int(n) => u32::try_from(*n).ok(),
        _ => None,
    };
    Some((int(items.first()?)? == 1, int(items.get(1)?)?))
}

/// Every third of the lease, renew all live leases of the registry: one call per set.
async fn renew(leases: Weak<SlotLeases>) {
    let period = match leases.upgrade() {
        Some(l) => l.lease / 3,
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(leases) = leases.upgrade() else {
            return;
        };
        let mut by_key: HashMap<Arc<str>, Vec<String>> = HashMap::new();
        for (id, key) in leases.live.lock().iter() {
            by_key.entry(key.clone()).or_default().push(member(*id));
        }
        if by_key.is_empty() {
            continue;
        }
        let lease_ms = u64::try_from(leases.lease.as_millis()).unwrap_or(u64::MAX);
        let on = leases.link.now();
        let calls = by_key.iter().map(|(key, ids)| {
            let mut call = LEASE_SCRIPT.prepare_invoke();
            call.key(&**key).arg("renew").arg(lease_ms);
            for id in ids {
                call.arg(id);
            }
            call
        });
        let calls: Vec<_> = calls.collect();
        let sent = futures_util::future::join_all(calls.iter().map(|c| on.conn.invoke(c)));
        match tokio::time::timeout(period, sent).await {
            Ok(results) => {
                if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
                    tracing::debug!(error = %e, "renewing concurrency leases failed");
                }
            }
            Err(_) => tracing::debug!("renewing concurrency leases timed out"),
        }
        drop(leases);
    }
}
