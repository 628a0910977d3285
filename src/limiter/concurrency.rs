//! Concurrency limits: per identity, the requests in flight, each holding a slot until its
//! response is done.
//!
//! In process a slot is a count in a sharded map whose entries exist only while their identity
//! has requests in flight (so it holds at most one entry per request in flight); over Redis
//! it is a lease (`redis::slots`). Either way the request holds a `Guard` that gives its slots
//! back when dropped: body sent, client gone, error, upstream failure or tunnel closed.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::redis::slots::{SlotLease, SlotLeases, Taken};
use super::redis::RedisLimiter;
use super::{FailurePolicy, Limit, LimitResult, Outcome, Small, Verdict};
use crate::identity::{ClientId, RequestView};

/// Shards of the in-process map: enough that workers rarely meet on one lock.
const SHARDS: usize = 64;

/// The answer a rejection carries: nothing left, retry in a second.
const FULL: Verdict = Verdict {
    admitted: false,
    remaining: 0,
    reset_us: 1e6,
    retry_after_us: 1e6,
};

/// One concurrency limit's in-process counts (the store for `backend: local`, the fallback
/// for Redis), and its Redis leases.
#[derive(Debug)]
pub struct Slots {
    shards: Box<[Mutex<HashMap<u128, u32>>]>,
    /// This limit's live Redis leases, renewed by one task; made on the first Redis take.
    leases: OnceLock<Arc<SlotLeases>>,
}

impl Slots {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            leases: OnceLock::new(),
        })
    }

    fn shard(&self, client: u128) -> &Mutex<HashMap<u128, u32>> {
        // The identity is a digest: any of its bits spread the shards evenly.
        &self.shards[(client >> 64) as usize % SHARDS]
    }

    /// Take one of `client`'s `max` slots: the slot and the count in flight with it, or the
    /// count in flight when all are taken.
    pub fn try_take(self: &Arc<Self>, client: ClientId, max: u32) -> Result<(Slot, u32), u32> {
        let mut shard = self.shard(client.0).lock();
        let n = shard.entry(client.0).or_insert(0);
        if *n >= max {
            let full = *n;
            if full == 0 {
                shard.remove(&client.0);
            }
            return Err(full);
        }
        *n += 1;
        let taken = *n;
        drop(shard);
        Ok((
            Slot {
                slots: self.clone(),
                client: client.0,
            },
            taken,
        ))
    }

    /// `client`'s requests in flight.
    pub fn in_flight(&self, client: ClientId) -> u32 {
        self.shard(client.0)
            .lock()
            .get(&client.0)
            .copied()
            .unwrap_or(0)
    }

    /// Identities with requests in flight (the map's entries).
    pub fn identities(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    fn give_back(&self, client: u128) {
        let mut shard = self.shard(client).lock();
        if let Some(n) = shard.get_mut(&client) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                shard.remove(&client);
            }
        }
    }
}

/// One in-process slot, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<Slots>,
    client: u128,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.give_back(self.client);
    }
}

/// A slot in one of the two stores.
#[derive(Debug)]
enum SlotHeld {
    Local(#[allow(dead_code)] Slot),
    SlotLease(#[allow(dead_code)] SlotLease),
}

/// The slots one request holds, given back when it is dropped. A `Vec`, not a list kept
/// inline: the guard moves with the request's trace and its response body (hyper's state),
/// and most routes have no concurrency limit, so an empty one should cost 24 bytes, not 224.
#[derive(Debug, Default)]
pub struct Guard(Vec<SlotHeld>);

impl Guard {
    /// Slots held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Hold `other`'s slots too, until this guard is dropped.
    pub fn join(&mut self, other: Guard) {
        if !other.is_empty() {
            self.0.extend(other.0);
        }
    }
}

/// The route has concurrency limits.
pub fn any(limits: &[Arc<Limit>]) -> bool {
    limits.iter().any(|l| l.concurrency.is_some())
}

/// Take a slot of each of `limits`' concurrency limits for the request, in route order: in
/// Redis when `redis` is given, else in process. Stops at the first limit that rejects, and
/// then holds nothing (the guard is empty: what was taken is given back at once).
// Both stores' paths side by side, so that in process and in Redis slots are taken alike.
#[allow(clippy::too_many_lines)]
pub async fn acquire(
    redis: Option<&RedisLimiter>,
    worker: Option<usize>,
    limits: &[Arc<Limit>],
    view: &RequestView<'_>,
) -> (Guard, Small<LimitResult>) {
    let mut guard = Guard::default();
    let mut results = Small::new();
    for (index, limit) in limits.iter().enumerate() {
        let (Some(spec), Some(slots)) = (limit.concurrency, &limit.slots) else {
            continue;
        };
        let mut result = LimitResult {
            index,
            outcome: Outcome::Exempt,
            verdict: None,
            fallback: false,
            shadow: limit.shadow,
            client: None,
            ban: super::ban::BanEvent::None,
        };
        if view.is_exempt(&limit.exempt) {
            results.push(result);
            continue;
        }
        let client = view.resolve(&limit.key);
        result.client = Some(client);
        let taken = match redis {
            None => Some(slots.try_take(client, cap(limit, spec.max)).map(held_here)),
            Some(r) => match take_shared((r, worker), limit, (spec, slots), client).await {
                Shared::Taken(taken) => Some(taken),
                Shared::Failed(policy) => {
                    result.fallback = true;
                    match policy {
                        FailurePolicy::Open => None,
                        FailurePolicy::Closed => {
                            result.outcome = Outcome::FailedClosed;
                            results.push(result);
                            return (Guard::default(), results);
                        }
                        FailurePolicy::Local => Some(
                            slots
                                .try_take(client, cap(limit, spec.fallback))
                                .map(held_here),
                        ),
                    }
                }
            },
        };
        let max = if result.fallback {
            spec.fallback
        } else {
            spec.max
        };
        result.outcome = match taken {
            None => Outcome::FailedOpen,
            Some(Ok((held, n))) => {
                guard.0.push(held);
                if n > max {
                    Outcome::ShadowLimited
                } else {
                    Outcome::Admitted
                }
            }
            Some(Err(_)) => {
                result.verdict = Some(FULL);
                result.outcome = Outcome::Limited;
                results.push(result);
                return (Guard::default(), results);
            }
        };
        results.push(result);
    }
    (guard, results)
}

/// A limit's slot asked of Redis: taken (with the count now) or full (with the count), or the
/// failure policy that applies since Redis did not answer (`Closed` only where it refuses: a
/// shadow limit fails open).
enum Shared {
    Taken(Result<(SlotHeld, u32), u32>),
    Failed(FailurePolicy),
}

async fn take_shared(
    (r, worker): (&RedisLimiter, Option<usize>),
    limit: &Limit,
    (spec, slots): (super::ConcurrencySpec, &Slots),
    client: ClientId,
) -> Shared {
    let leases = slots.leases.get_or_init(|| r.leases(spec.lease));
    match r
        .take_lease(worker, leases, limit, client, cap(limit, spec.max))
        .await
    {
        Ok(Taken::Slot(lease, n)) => Shared::Taken(Ok((SlotHeld::SlotLease(lease), n))),
        Ok(Taken::Full(n)) => Shared::Taken(Err(n)),
        Err(_) if limit.shadow && limit.on_failure == FailurePolicy::Closed => {
            Shared::Failed(FailurePolicy::Open)
        }
        Err(_) => Shared::Failed(limit.on_failure),
    }
}

/// The cap a limit takes a slot under: a shadow limit always takes its slot, and reports when
/// it would have been over.
fn cap(limit: &Limit, max: u32) -> u32 {
    if limit.shadow {
        u32::MAX
    } else {
        max
    }
}

/// A slot taken in process, as the guard holds it.
fn held_here((slot, n): (Slot, u32)) -> (SlotHeld, u32) {
    (SlotHeld::Local(slot), n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_counted_and_entries_removed_at_zero() {
        let slots = Slots::new();
        let a = ClientId(7 << 64);
        let (s1, n1) = slots.try_take(a, 2).unwrap();
        let (s2, n2) = slots.try_take(a, 2).unwrap();
        assert_eq!((n1, n2), (1, 2));
        assert_eq!(slots.try_take(a, 2).unwrap_err(), 2);
        assert_eq!(slots.try_take(ClientId(8), 2).unwrap().1, 1);
        drop(s1);
        assert_eq!(slots.in_flight(a), 1);
        let (s3, _) = slots.try_take(a, 2).unwrap();
        drop((s2, s3));
        assert_eq!(slots.in_flight(a), 0);
        assert_eq!(slots.identities(), 0, "no entry is left behind");
    }
}
