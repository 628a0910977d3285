//! Concurrency limits: per identity, the requests in flight, each holding a slot until its
//! response is done.
//!
//! In process a slot is a count in a sharded map whose entries exist only while their identity
//! has requests in flight (so it holds at most one entry per request in flight); over Redis
//! it is a lease (`redis::slots`). Both are taken through the store (`store::Store::take_slot`,
//! by each limit's failure policy in `decide::slots`). Either way the request holds a `Guard`
//! that gives its slots back when dropped: body sent, client gone, error, upstream failure or
//! tunnel closed.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::redis::slots::{SlotLease, SlotLeases};
use super::{Limit, Verdict};
use crate::identity::ClientId;

/// Shards of the in-process map: enough that workers rarely meet on one lock.
const SHARDS: usize = 64;

/// The answer a rejection carries: nothing left, retry in a second.
pub(crate) const FULL: Verdict = Verdict {
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

    /// This limit's Redis leases, made by `make` on the first take.
    pub(crate) fn leases(&self, make: impl FnOnce() -> Arc<SlotLeases>) -> &Arc<SlotLeases> {
        self.leases.get_or_init(make)
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
pub enum SlotHeld {
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

    /// Hold `slot` too, until this guard is dropped.
    pub(crate) fn hold(&mut self, slot: SlotHeld) {
        self.0.push(slot);
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
