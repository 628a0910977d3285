//! In-process token buckets: a sharded map from client digest to `tat`, idle eviction, a cap.
//!
//! Every limit owns one `Buckets`. A check locks the one shard its client lives in, so two
//! cores contend only when two requests hash to the same shard. A multi-limit check locks the
//! shards of all its limits in route order (always the same order, so no deadlock), decides,
//! and commits only if every limit admits: a rejected request takes no token anywhere, and no
//! interleaving of concurrent requests can over-admit.
//!
//! Memory is bounded: a bucket is forgotten once it would be full again (so forgetting it
//! grants nothing), and each limit holds at most `max_buckets`. What happens to a new
//! identity beyond that is the exhaustion policy (docs/hardening.md), made so that one client
//! minting identities (random API keys) cannot lock everyone else out:
//!
//! 1. Buckets that refilled are reclaimed first (that costs nobody anything).
//! 2. A limit whose identities are not one per client address (an API key, a cookie, a path)
//!    counts who minted its buckets, per peer (`peers`): a peer holds at most
//!    `max_buckets_per_peer` of them. Past that, or when the map is full even after step 1,
//!    its new identities share one overflow bucket of that peer's: a flood of random keys is
//!    limited as one client, and newcomers from every other address still get a bucket (or,
//!    with the map full, their own address's).
//! 3. Only when the peer map is full as well (a flood from as many addresses as the map has
//!    room for) is a new identity counted in the limit's one shared overflow bucket.
//!
//! Non-full buckets are never evicted to make room: forgetting one hands its client a full
//! burst, which a flood could cycle through. The price is that the clients behind one address
//! (a NAT) past the per-peer cap share a bucket. Memory stays bounded by `max_buckets`
//! buckets plus at most as many peer entries.

mod log;
mod peek;
mod peers;
mod settle;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

pub use self::log::Logs;
pub use self::peek::Counted;
pub use self::peers::Peer;
use self::peers::{PeerShard, Peers};
use super::window::{self, Window};
use super::{step, Counting, QuotaSpec, Rate, Small, Verdict};
use crate::identity::ClientId;

const SHARDS: usize = 64;

/// The client digest is already uniformly random: hash it by taking its first eight bytes.
#[derive(Default)]
pub struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for (i, b) in bytes.iter().take(8).enumerate() {
            self.0 ^= u64::from(*b) << (8 * i);
        }
    }
    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
}

/// One client's bucket: its `tat`, and the peer that minted it (to release it from the
/// peer's count when it goes).
#[derive(Debug, Clone, Copy)]
struct Entry {
    tat: f64,
    peer: Peer,
}

type Shard = HashMap<ClientId, Entry, BuildHasherDefault<DigestHasher>>;

/// The buckets of one limit.
#[derive(Debug)]
pub struct Buckets {
    shards: Vec<Mutex<Shard>>,
    /// Who minted the buckets; `None` for a limit whose identity is the client's address (one
    /// bucket per peer at most: nothing to cap).
    peers: Option<Peers>,
    overflow: Mutex<Option<f64>>,
    per_shard_cap: usize,
    per_peer_cap: u32,
    overflowed: AtomicU64,
    peer_overflowed: AtomicU64,
    /// A quota limit's buckets hold wall-clock `tat`s, forgotten once their window is over
    /// (not once they are below now: that would hand back what the window used).
    quota: Option<QuotaSpec>,
    /// An `exact` window's request times, instead of `tat`s.
    logs: Option<Logs>,
    /// A settled cost's buckets may owe tokens (see `settle`): never clamped.
    owing: bool,
}

/// One bucket to check: whose buckets, which client (and from which peer), at what rate and
/// cost.
#[derive(Debug, Clone, Copy)]
pub struct Item<'a> {
    pub buckets: &'a Buckets,
    pub client: ClientId,
    pub peer: Peer,
    pub rate: &'a Rate,
    pub cost: u32,
    /// A quota's window: counted by `window::step` instead of the token bucket's.
    pub window: Option<Window>,
}

impl Item<'_> {
    /// The identity's key in the map: a sliding window's two counters alternate between the
    /// client's digest and that digest with its last bit flipped, window by window (the
    /// shard, taken from the high bits, is the same).
    fn key(&self) -> ClientId {
        match &self.window {
            Some(w) if w.counting == Counting::Sliding && window::odd(w) => {
                ClientId(self.client.0 ^ 1)
            }
            _ => self.client,
        }
    }
}

/// Where one item of a check is counted, locked.
enum Slot<'a> {
    /// The client's own bucket, under this key (`Item::key`). With its peer's shard when the
    /// bucket is new and counts against the peer once committed.
    Map(
        MutexGuard<'a, Shard>,
        Option<MutexGuard<'a, PeerShard>>,
        ClientId,
    ),
    /// An `exact` window's log: the client's, its peer's shared one, or its shard's overflow.
    Log(log::Counted<'a>),
    /// The peer's overflow bucket.
    Peer(MutexGuard<'a, PeerShard>),
    /// The limit's overflow bucket, the last resort.
    Overflow(MutexGuard<'a, Option<f64>>),
}

impl Buckets {
    /// Buckets holding at most about `max_buckets` clients (rounded up to a multiple of the
    /// shard count), with no per-peer accounting (a limit keyed by the client address).
    pub fn new(max_buckets: usize) -> Self {
        Self::build(max_buckets, None)
    }

    /// `new`, for a limit whose identities a client can mint at will (API keys, cookies,
    /// paths): a peer holds at most `per_peer` buckets at once (see the module doc).
    pub fn capped_per_peer(max_buckets: usize, per_peer: usize) -> Self {
        Self::build(max_buckets, Some(per_peer))
    }

    fn build(max_buckets: usize, per_peer: Option<usize>) -> Self {
        let per_shard_cap = max_buckets.div_ceil(SHARDS).max(1);
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            peers: per_peer.map(|_| Peers::new(per_shard_cap)),
            overflow: Mutex::new(None),
            per_shard_cap,
            per_peer_cap: per_peer
                .map_or(u32::MAX, |n| u32::try_from(n.max(1)).unwrap_or(u32::MAX)),
            overflowed: AtomicU64::new(0),
            peer_overflowed: AtomicU64::new(0),
            quota: None,
            logs: None,
            owing: false,
        }
    }

    /// These buckets count quota `q` (their `tat`s are wall-clock times: see `sweep`), in logs
    /// for an `exact` window.
    #[must_use]
    pub fn with_quota(mut self, q: Option<QuotaSpec>) -> Self {
        if q.as_ref().is_some_and(|q| q.counting == Counting::Exact) {
            let per_peer = self.peers.is_some().then_some(self.per_peer_cap);
            self.logs = Some(Logs::new(self.per_shard_cap, per_peer));
        }
        self.quota = q;
        self
    }

    /// These buckets may owe tokens: their costs are settled from responses.
    #[must_use]
    pub fn owing(mut self, owing: bool) -> Self {
        self.owing = owing;
        self
    }

    /// Whether these buckets may owe tokens (a reload keeps them only if so still).
    pub fn is_owing(&self) -> bool {
        self.owing
    }

    /// The quota these buckets count, if any (a reload keeps them only for the same one).
    pub fn quota(&self) -> Option<&QuotaSpec> {
        self.quota.as_ref()
    }

    /// Whether these buckets were built with these caps (a reload keeps them only then).
    pub fn has_caps(&self, max_buckets: usize, per_peer: Option<usize>) -> bool {
        self.per_shard_cap == max_buckets.div_ceil(SHARDS).max(1)
            && self.peers.is_some() == per_peer.is_some()
            && per_peer.is_none_or(|n| u64::from(self.per_peer_cap) == n.max(1) as u64)
    }

    fn shard(&self, client: ClientId) -> &Mutex<Shard> {
        &self.shards[shard_of(client)]
    }

    /// Lock the slot `client` (from `peer`) is counted in, following the exhaustion policy
    /// (see the module doc) when it has no bucket yet. Buckets with a `tat` of at most `now`
    /// are free to reclaim (for a quota, `now` is its window's start).
    fn lock(&self, client: ClientId, peer: Peer, now: f64) -> Slot<'_> {
        let mut shard = self.shard(client).lock();
        if shard.contains_key(&client) {
            return Slot::Map(shard, None, client);
        }
        if shard.len() >= self.per_shard_cap {
            self.reclaim(&mut shard, now);
        }
        let room = shard.len() < self.per_shard_cap;
        let Some(peers) = &self.peers else {
            if room {
                return Slot::Map(shard, None, client);
            }
            drop(shard);
            return self.overflow();
        };
        let Some(minted) = peers.entry(peer, now) else {
            drop(shard);
            return self.overflow();
        };
        let live = minted.get(&peer).map_or(0, |m| m.live);
        if room && live < self.per_peer_cap {
            return Slot::Map(shard, Some(minted), client);
        }
        drop(shard);
        self.peer_overflowed.fetch_add(1, Ordering::Relaxed);
        Slot::Peer(minted)
    }

    fn overflow(&self) -> Slot<'_> {
        self.overflowed.fetch_add(1, Ordering::Relaxed);
        Slot::Overflow(self.overflow.lock())
    }

    /// Drop the buckets of `shard` that are full at `now`, releasing them from their peers.
    /// Returns how many were dropped.
    fn reclaim(&self, shard: &mut Shard, now: f64) -> usize {
        let before = shard.len();
        match &self.peers {
            None => shard.retain(|_, e| e.tat > now),
            Some(peers) => {
                let mut gone = Vec::new();
                shard.retain(|_, e| {
                    let keep = e.tat > now;
                    if !keep {
                        gone.push(e.peer);
                    }
                    keep
                });
                peers.release(gone.into_iter(), now);
            }
        }
        before - shard.len()
    }

    /// Forget every bucket that is full at `now` (and every peer left with nothing). Returns
    /// how many buckets were dropped.
    pub fn sweep(&self, now: f64) -> usize {
        // A quota's buckets are wall-clock `tat`s, free to forget below the window's floor.
        let Some(q) = &self.quota else {
            return self.sweep_below(now);
        };
        let w = window::window(q, super::clock::wall_us(), q.count);
        match &self.logs {
            Some(logs) => logs.sweep(w.now, w.len()),
            None => self.sweep_below(w.floor()),
        }
    }

    /// Forget every bucket whose `tat` is at most `floor` (for a quota: its window's start).
    pub fn sweep_below(&self, now: f64) -> usize {
        let mut dropped = 0;
        for shard in &self.shards {
            let mut shard = shard.lock();
            dropped += self.reclaim(&mut shard, now);
            shrink_if_sparse(&mut shard);
        }
        if let Some(peers) = &self.peers {
            peers.sweep(now);
        }
        let mut overflow = self.overflow.lock();
        if overflow.is_some_and(|tat| tat <= now) {
            *overflow = None;
        }
        dropped
    }

    /// Buckets (or `exact` logs) currently held.
    pub fn len(&self) -> usize {
        let logs = self.logs.as_ref().map_or(0, Logs::len);
        logs + self.shards.iter().map(|s| s.lock().len()).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks that found the map (and the peer map) full and were counted in the limit's
    /// overflow bucket.
    pub fn overflowed(&self) -> u64 {
        let logs = self.logs.as_ref().map_or(0, Logs::overflowed);
        logs + self.overflowed.load(Ordering::Relaxed)
    }

    /// Checks of new identities counted in their peer's overflow bucket (the peer at its cap,
    /// or the map full).
    pub fn peer_overflowed(&self) -> u64 {
        self.peer_overflowed.load(Ordering::Relaxed)
    }
}

/// The shard a client's state lives in, by the high bits of its digest (a sliding window's
/// two keys differ in the lowest bit only, so they share it).
fn shard_of(client: ClientId) -> usize {
    (client.0 >> 64) as usize % SHARDS
}

/// Give a table's memory back once it is mostly empty (a sweep after a flood).
fn shrink_if_sparse<K: Eq + std::hash::Hash, V, S: std::hash::BuildHasher>(
    map: &mut HashMap<K, V, S>,
) {
    if map.capacity() > 64 && map.len() < map.capacity() / 4 {
        map.shrink_to_fit();
    }
}

/// Check several buckets as one: every verdict is returned, and tokens are taken from all of
/// them only if every one of them admits (`enforced[i] == false` marks a shadow bucket, whose
/// rejection does not block the others and which is only charged when it admits).
pub fn check(items: &[Item<'_>], enforced: &[bool], now: f64) -> Small<Verdict> {
    // Locks are taken in slice order; callers always pass a route's limits in route order, and
    // no two items share a `Buckets`, so the order is global and cannot deadlock. Within one
    // `Buckets`, a bucket shard is locked before a peer shard, and a peer shard is never held
    // while another peer shard of the same limit is locked.
    // One limit, most routes' case: no lists of slots and states to build.
    if let [item] = items {
        return smallvec::smallvec![check_one(
            item,
            enforced.first().copied().unwrap_or(false),
            now
        )];
    }
    let mut slots: Small<Slot<'_>> = items.iter().map(|i| slot(i, now)).collect();
    let mut verdicts: Small<Verdict> = Small::new();
    let mut tats: Small<f64> = Small::new();
    for (item, slot) in items.iter().zip(&mut slots) {
        let (v, t) = judge(item, slot, now);
        verdicts.push(v);
        tats.push(t);
    }
    let all_admit = verdicts
        .iter()
        .zip(enforced)
        .all(|(v, enforced)| v.admitted || !enforced);
    if !all_admit {
        write_back_clamps(items, &mut slots, now);
    }
    if all_admit {
        for (((item, slot), v), tat) in items.iter().zip(&mut slots).zip(&verdicts).zip(tats) {
            if !v.admitted {
                continue;
            }
            commit(item, slot, tat);
        }
    }
    verdicts
}

/// `check` of a single item: no lists of slots and states to build.
pub fn check_one(item: &Item<'_>, enforced: bool, now: f64) -> Verdict {
    let mut slot = slot(item, now);
    let stored = stored(item, &slot);
    let (v, tat) = judge_stored(item, &mut slot, stored, now);
    if v.admitted {
        commit(item, &mut slot, tat);
    } else if enforced && stored.is_some_and(|t| clamps(item, t, now)) {
        write_back_clamps(
            std::slice::from_ref(item),
            std::slice::from_mut(&mut slot),
            now,
        );
    }
    v
}

/// The slot `item` is counted in, locked.
fn slot<'a>(item: &Item<'a>, now: f64) -> Slot<'a> {
    match (&item.buckets.logs, &item.window) {
        (Some(logs), Some(w)) => Slot::Log(logs.lock(item.client, item.peer, w.now, w.len())),
        _ => {
            let floor = item.window.map_or(now, |w| w.floor());
            item.buckets.lock(item.key(), item.peer, floor)
        }
    }
}

/// One item's verdict from the slot it is counted in, and the state to store if admitted.
fn judge(item: &Item<'_>, slot: &mut Slot<'_>, now: f64) -> (Verdict, f64) {
    let stored = stored(item, slot);
    judge_stored(item, slot, stored, now)
}

/// The state `slot` holds for `item` (a bucket's theoretical arrival time, a window's count).
fn stored(item: &Item<'_>, slot: &Slot<'_>) -> Option<f64> {
    match slot {
        Slot::Map(m, _, key) => m.get(key).map(|e| e.tat),
        Slot::Peer(p) => p.get(&item.peer).and_then(|m| m.overflow),
        Slot::Overflow(o) => **o,
        Slot::Log(..) => None,
    }
}

/// `judge`, with the slot's state read already.
fn judge_stored(
    item: &Item<'_>,
    slot: &mut Slot<'_>,
    tat: Option<f64>,
    now: f64,
) -> (Verdict, f64) {
    if let (Slot::Log(counted), Some(w)) = (&mut *slot, &item.window) {
        let mut empty = std::collections::VecDeque::new();
        let log = Logs::times_mut(counted, &mut empty);
        return (window::exact(log, w, item.cost), w.now);
    }
    match &item.window {
        Some(w) if w.counting == Counting::Sliding => {
            // The last window's counter, under the other key; none in an overflow bucket,
            // which counts as a fixed window.
            let prev = match &*slot {
                Slot::Map(m, _, key) => m.get(&ClientId(key.0 ^ 1)).map(|e| e.tat),
                _ => None,
            };
            window::slide(tat, prev, w, item.cost)
        }
        Some(w) => window::step(tat, w, item.cost),
        None if item.buckets.owing => super::gcra::step_owing(tat, now, item.rate, item.cost),
        None => step(tat, now, item.rate, item.cost),
    }
}

/// Store an admitted item's new state in its slot.
fn commit(item: &Item<'_>, slot: &mut Slot<'_>, tat: f64) {
    match slot {
        Slot::Map(m, minted, key) => {
            m.insert(
                *key,
                Entry {
                    tat,
                    peer: item.peer,
                },
            );
            if let Some(minted) = minted {
                minted.entry(item.peer).or_default().live += 1;
            }
        }
        Slot::Log(counted) => Logs::commit(counted, item.peer, tat, item.cost),
        Slot::Peer(p) => p.entry(item.peer).or_default().overflow = Some(tat),
        Slot::Overflow(o) => **o = Some(tat),
    }
}

/// Whether a bucket's stored `tat` lies further ahead than `item`'s rate allows (its rate was
/// lowered since): `write_back_clamps` writes it back.
fn clamps(item: &Item<'_>, tat: f64, now: f64) -> bool {
    item.window.is_none() && tat - now > item.rate.window_us() + super::CLAMP_SLACK_US
}

/// A rejected check writes nothing, except a `tat` that `step` clamped to an empty bucket
/// (`now + tau`): written back, as `bucket.lua` does, so the bucket refills from now on. The
/// clock here is monotonic, so only a rate lowered's `tau` clamps: an operator's override
/// (`control`) raising a limit for a client whose bucket the old rate emptied.
fn write_back_clamps(items: &[Item<'_>], slots: &mut [Slot<'_>], now: f64) {
    for (item, slot) in items.iter().zip(slots) {
        if item.window.is_some() {
            continue;
        }
        let clamped = super::clamped(now, item.rate);
        let tat = match slot {
            Slot::Map(m, _, key) => m.get_mut(key).map(|e| &mut e.tat),
            Slot::Peer(p) => p.get_mut(&item.peer).and_then(|m| m.overflow.as_mut()),
            Slot::Overflow(o) => o.as_mut(),
            Slot::Log(..) => None,
        };
        if let Some(tat) = tat.filter(|t| clamps(item, **t, now)) {
            *tat = clamped;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(per_sec: f64, burst: u32) -> Rate {
        Rate { per_sec, burst }
    }

    fn one(b: &Buckets, client: u128, r: &Rate, now: f64) -> Verdict {
        check(
            &[Item {
                buckets: b,
                client: ClientId(client),
                peer: Peer::default(),
                rate: r,
                cost: 1,
                window: None,
            }],
            &[true],
            now,
        )[0]
    }

    #[test]
    fn clients_have_their_own_buckets() {
        let b = Buckets::new(1000);
        let r = rate(1.0, 2);
        assert!(one(&b, 1, &r, 0.0).admitted);
        assert!(one(&b, 1, &r, 0.0).admitted);
        assert!(!one(&b, 1, &r, 0.0).admitted);
        assert!(one(&b, 2, &r, 0.0).admitted);
    }

    #[test]
    fn a_rejection_by_one_limit_takes_nothing_from_the_other() {
        let (a, b) = (Buckets::new(100), Buckets::new(100));
        let (ra, rb) = (rate(1.0, 10), rate(1.0, 1));
        let items = [
            Item {
                buckets: &a,
                client: ClientId(7),
                peer: Peer::default(),
                rate: &ra,
                cost: 1,
                window: None,
            },
            Item {
                buckets: &b,
                client: ClientId(7),
                peer: Peer::default(),
                rate: &rb,
                cost: 1,
                window: None,
            },
        ];
        let v = check(&items, &[true, true], 0.0);
        assert!(v[0].admitted && v[1].admitted);
        for _ in 0..5 {
            let v = check(&items, &[true, true], 0.0);
            assert!(v[0].admitted && !v[1].admitted);
        }
        // Only the first request was charged to `a`.
        assert_eq!(one(&a, 7, &ra, 0.0).remaining, 8);
    }

    #[test]
    fn shadow_rejection_does_not_block() {
        let (a, b) = (Buckets::new(100), Buckets::new(100));
        let (ra, rb) = (rate(1.0, 10), rate(1.0, 1));
        let items = [
            Item {
                buckets: &a,
                client: ClientId(7),
                peer: Peer::default(),
                rate: &ra,
                cost: 1,
                window: None,
            },
            Item {
                buckets: &b,
                client: ClientId(7),
                peer: Peer::default(),
                rate: &rb,
                cost: 1,
                window: None,
            },
        ];
        check(&items, &[true, false], 0.0);
        let v = check(&items, &[true, false], 0.0);
        assert!(v[0].admitted && !v[1].admitted);
        assert_eq!(one(&a, 7, &ra, 0.0).remaining, 7);
    }

    #[test]
    fn sweep_forgets_only_full_buckets() {
        let b = Buckets::new(1000);
        let r = rate(1.0, 2);
        one(&b, 1, &r, 0.0);
        one(&b, 2, &r, 0.0);
        one(&b, 2, &r, 0.0);
        assert_eq!(
            b.sweep(1.5e6),
            1,
            "client 1 is full after 1 s, client 2 after 2 s"
        );
        assert_eq!(b.len(), 1);
        // Client 2 was not forgotten: it still has only what refill gave back.
        assert_eq!(one(&b, 2, &r, 1.5e6).remaining, 0);
        assert_eq!(b.sweep(10e6), 1);
        assert!(b.is_empty());
    }

    #[test]
    fn a_full_map_counts_newcomers_in_one_overflow_bucket() {
        let b = Buckets::new(SHARDS); // one client per shard
        let r = rate(1.0, 3);
        let mut admitted = 0;
        for client in 0..10_000u128 {
            if one(&b, client << 64, &r, 0.0).admitted {
                admitted += 1;
            }
        }
        assert!(b.len() <= SHARDS);
        assert!(b.overflowed() > 0);
        // SHARDS clients got their own burst; everyone else shared one bucket of 3.
        assert_eq!(admitted, SHARDS + 3);
    }

    /// One check of `client`'s bucket from `peer` (an IPv4 address, as text).
    fn from(b: &Buckets, peer: &str, client: u128, r: &Rate, now: f64) -> Verdict {
        check(
            &[Item {
                buckets: b,
                client: ClientId(client),
                peer: Peer::of(peer.parse().unwrap()),
                rate: r,
                cost: 1,
                window: None,
            }],
            &[true],
            now,
        )[0]
    }

    /// Client ids spread over every shard, as digests are.
    fn spread(i: u128) -> u128 {
        i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
    }

    #[test]
    fn a_peer_minting_identities_is_capped_and_others_are_not_locked_out() {
        let b = Buckets::capped_per_peer(64 * 100, 50);
        let r = rate(1.0 / 60.0, 2);
        // One address sends 10 000 random keys: 50 get a bucket, the rest share one.
        let mut admitted = 0;
        for i in 0..10_000u128 {
            admitted += usize::from(from(&b, "192.0.2.1", spread(i), &r, 0.0).admitted);
        }
        assert_eq!(admitted, 50 + 2);
        assert_eq!(b.len(), 50);
        assert_eq!(b.peer_overflowed(), 10_000 - 50);
        assert_eq!(b.overflowed(), 0);
        // Everyone else still gets a bucket of their own, a full burst each.
        for (n, peer) in ["198.51.100.1", "198.51.100.2"].iter().enumerate() {
            let key = spread(1_000_000 + n as u128);
            assert!(from(&b, peer, key, &r, 0.0).admitted);
            assert!(from(&b, peer, key, &r, 0.0).admitted);
            assert!(!from(&b, peer, key, &r, 0.0).admitted);
        }
        // The capped peer's own keys keep their buckets (nothing was evicted).
        assert_eq!(from(&b, "192.0.2.1", spread(0), &r, 0.0).remaining, 0);
    }

    #[test]
    fn a_map_filled_from_many_peers_gives_newcomers_their_peers_bucket() {
        // 6400 buckets in all, 100 a peer: 64 peers minting 200 keys each fill it.
        let b = Buckets::capped_per_peer(6400, 100);
        let r = rate(1.0 / 60.0, 2);
        for p in 0..64u128 {
            for k in 0..200u128 {
                from(&b, &format!("10.0.0.{p}"), spread(p * 1000 + k), &r, 0.0);
            }
        }
        assert!(b.len() <= 6400 && b.len() > 6000, "{}", b.len());
        assert_eq!(b.overflowed(), 0, "the peers had room in the peer map");
        // Newcomers from fresh addresses: a bucket of their own or their address's, a full
        // burst each either way; none is sent to the one shared overflow bucket.
        for n in 0..20u128 {
            let (peer, key) = (format!("203.0.113.{n}"), spread(9_000_000 + n));
            assert!(from(&b, &peer, key, &r, 0.0).admitted);
            assert!(from(&b, &peer, key, &r, 0.0).admitted);
            assert!(!from(&b, &peer, key, &r, 0.0).admitted);
        }
        assert_eq!(b.overflowed(), 0);
    }

    #[test]
    fn a_peers_count_falls_as_its_buckets_refill() {
        let b = Buckets::capped_per_peer(6400, 3);
        // 1/s, burst 1: a bucket is full again a second after its request.
        let r = rate(1.0, 1);
        for i in 0..3 {
            assert!(from(&b, "192.0.2.1", spread(i), &r, 0.0).admitted);
        }
        // At the cap: the next key shares the peer's bucket.
        assert!(from(&b, "192.0.2.1", spread(3), &r, 0.0).admitted);
        assert!(!from(&b, "192.0.2.1", spread(4), &r, 0.0).admitted);
        // A second later all of them refilled: swept, the peer mints afresh.
        assert_eq!(b.sweep(1.5e6), 3);
        for i in 10..13 {
            assert!(from(&b, "192.0.2.1", spread(i), &r, 1.5e6).admitted);
        }
        assert_eq!(b.len(), 3);
    }

    #[test]
    fn ipv6_peers_are_grouped_by_64() {
        let a = Peer::of("2001:db8:1:2::1".parse().unwrap());
        assert_eq!(a, Peer::of("2001:db8:1:2:ffff::9".parse().unwrap()));
        assert_ne!(a, Peer::of("2001:db8:1:3::1".parse().unwrap()));
        assert_eq!(
            Peer::of("192.0.2.1".parse().unwrap()),
            Peer::of("::ffff:192.0.2.1".parse().unwrap())
        );
    }

    #[test]
    fn concurrent_checks_never_over_admit() {
        let b = std::sync::Arc::new(Buckets::new(1000));
        let r = rate(0.001, 500);
        let admitted = std::sync::Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (b, admitted, r) = (b.clone(), admitted.clone(), r.clone());
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        if one(&b, 42, &r, 0.0).admitted {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(admitted.load(Ordering::Relaxed), 500);
    }

    #[test]
    fn a_bucket_emptied_at_a_slow_rate_refills_at_a_faster_one() {
        // Emptied at 1/min (burst 2: its tat is 2 minutes ahead), then counted at 100/s (tau
        // 1 s): clamped to one token left, so the raised rate admits the next request at once.
        let b = Buckets::new(1000);
        let (slow, fast) = (rate(1.0 / 60.0, 2), rate(100.0, 100));
        assert!(one(&b, 7, &slow, 0.0).admitted && one(&b, 7, &slow, 0.0).admitted);
        assert!(one(&b, 7, &fast, 0.0).admitted);
        // Then empty: it refills at 100/s from the clamp on.
        let v = one(&b, 7, &fast, 0.0);
        assert!(!v.admitted);
        assert!((v.retry_after_us - 10_000.0).abs() < 1.0, "{v:?}");
        assert!(one(&b, 7, &fast, 10_000.0).admitted);
        assert!(!one(&b, 7, &fast, 10_000.0).admitted);
    }
}
