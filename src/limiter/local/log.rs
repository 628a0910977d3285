//! The in-process logs of `exact` window limits: per identity, the times of its requests in
//! the last window, bounded by the limit's N (at most `EXACT_MAX`) and by `max_buckets`.
//!
//! A limit whose identities a client can mint (see `local`) caps the logs one peer holds at
//! `max_buckets_per_peer`, as its buckets are capped: the peer's further new identities, or
//! all of them once the map is full, share one log of that peer's, so a flood of fresh keys
//! from one address counts as one client and leaves room for everyone else.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::peers::Peer;
use super::{DigestHasher, SHARDS};
use crate::identity::ClientId;

/// One identity's log: its request times in wall-clock microseconds, oldest first, and the
/// peer that minted it.
#[derive(Debug, Default)]
pub(super) struct Log {
    pub(super) times: VecDeque<f64>,
    peer: Peer,
}

/// One shard of logs.
pub(super) type LogShard = HashMap<ClientId, Log, BuildHasherDefault<DigestHasher>>;

/// Per peer: the logs it minted that are still held, and the one its further new identities
/// share.
#[derive(Debug, Default)]
pub(super) struct PeerLog {
    live: u32,
    pub(super) overflow: VecDeque<f64>,
}

/// Keyed with SipHash and a random key, as the buckets' peers are: clients choose addresses.
pub(super) type PeerLogs = HashMap<Peer, PeerLog, RandomState>;

/// Where a check of an `exact` window counts, its locks held.
pub(super) enum Counted<'a> {
    /// Under this identity (its own, or its shard's overflow); with the peer map when the log
    /// is new and counts against its peer once committed.
    Own(
        MutexGuard<'a, LogShard>,
        Option<MutexGuard<'a, PeerLogs>>,
        ClientId,
    ),
    /// In the peer's shared log.
    Peer(MutexGuard<'a, PeerLogs>, Peer),
}

/// Where an identity past the cap is counted, with everyone else past it: one log per shard.
const OVERFLOW: ClientId = ClientId(u128::MAX);

/// The logs of one `exact` limit.
#[derive(Debug)]
pub struct Logs {
    shards: Vec<Mutex<LogShard>>,
    per_shard_cap: usize,
    overflowed: AtomicU64,
    /// Who minted the logs, and the most one peer may hold (none: one identity per address).
    /// One map: it is locked only to open a new log or when old ones are forgotten, always
    /// after a shard.
    peers: Option<(Mutex<PeerLogs>, u32)>,
}

impl Logs {
    /// `per_peer`: the logs one peer may hold, for a limit whose identities it can mint.
    pub(super) fn new(per_shard_cap: usize, per_peer: Option<u32>) -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(LogShard::default()))
                .collect(),
            per_shard_cap,
            overflowed: AtomicU64::new(0),
            peers: per_peer.map(|n| (Mutex::new(PeerLogs::default()), n)),
        }
    }

    /// The shard `client` lives in: the same as its buckets' (`Buckets::shard`).
    fn shard(&self, client: ClientId) -> &Mutex<LogShard> {
        &self.shards[super::shard_of(client)]
    }

    /// Lock `client`'s shard, and say which log it counts in: its own; its peer's shared one
    /// (the peer holds its cap of logs, or the shard is full of logs that still count at
    /// `now`, for windows of `len`); or, the peer map full too, the shard's overflow log.
    pub(super) fn lock(&self, client: ClientId, peer: Peer, now: f64, len: f64) -> Counted<'_> {
        let mut shard = self.shard(client).lock();
        if shard.contains_key(&client) {
            return Counted::Own(shard, None, client);
        }
        if shard.len() >= self.per_shard_cap {
            self.prune(&mut shard, now, len);
        }
        let room = shard.len() < self.per_shard_cap;
        let Some((peers, cap)) = &self.peers else {
            if room {
                return Counted::Own(shard, None, client);
            }
            self.overflowed.fetch_add(1, Ordering::Relaxed);
            return Counted::Own(shard, None, OVERFLOW);
        };
        let mut minted = peers.lock();
        if !minted.contains_key(&peer) && minted.len() >= self.per_shard_cap * SHARDS {
            minted.retain(|_, p| !idle(p, now, len));
            if minted.len() >= self.per_shard_cap * SHARDS {
                drop(minted);
                self.overflowed.fetch_add(1, Ordering::Relaxed);
                return Counted::Own(shard, None, OVERFLOW);
            }
        }
        let live = minted.get(&peer).map_or(0, |p| p.live);
        if room && live < *cap {
            return Counted::Own(shard, Some(minted), client);
        }
        drop(shard);
        self.overflowed.fetch_add(1, Ordering::Relaxed);
        Counted::Peer(minted, peer)
    }

    /// The log `counted` holds for the identity (an empty one when it has none yet).
    pub(super) fn times_mut<'c>(
        counted: &'c mut Counted<'_>,
        empty: &'c mut VecDeque<f64>,
    ) -> &'c mut VecDeque<f64> {
        match counted {
            Counted::Own(shard, _, id) => shard.get_mut(id).map_or(empty, |l| &mut l.times),
            Counted::Peer(peers, peer) => peers.get_mut(peer).map_or(empty, |p| &mut p.overflow),
        }
    }

    /// Append `cost` times `at` to the log `counted` holds (opening it, from `peer`, if new).
    pub(super) fn commit(counted: &mut Counted<'_>, peer: Peer, at: f64, cost: u32) {
        let times = std::iter::repeat_n(at, cost as usize);
        match counted {
            Counted::Own(shard, minted, id) => {
                let log = shard.entry(*id).or_insert_with(|| {
                    if let Some(m) = minted {
                        m.entry(peer).or_default().live += 1;
                    }
                    Log {
                        times: VecDeque::new(),
                        peer,
                    }
                });
                log.times.extend(times);
            }
            Counted::Peer(peers, peer) => peers.entry(*peer).or_default().overflow.extend(times),
        }
    }

    /// Forget the logs of `shard` with nothing left in the window ending at `now`, releasing
    /// them from their peers. Returns how many.
    fn prune(&self, shard: &mut LogShard, now: f64, len: f64) -> usize {
        let before = shard.len();
        let mut gone = Vec::new();
        shard.retain(|_, log| {
            let keep = log.times.back().is_some_and(|t| *t > now - len);
            if !keep && self.peers.is_some() {
                gone.push(log.peer);
            }
            keep
        });
        if let (Some((peers, _)), false) = (&self.peers, gone.is_empty()) {
            let mut minted = peers.lock();
            for peer in gone {
                if let Some(p) = minted.get_mut(&peer) {
                    p.live = p.live.saturating_sub(1);
                    if idle(p, now, len) {
                        minted.remove(&peer);
                    }
                }
            }
        }
        before - shard.len()
    }

    /// Forget the logs with nothing left in the window ending at `now`. Returns how many.
    pub(super) fn sweep(&self, now: f64, len: f64) -> usize {
        let mut dropped = 0;
        for shard in &self.shards {
            let mut shard = shard.lock();
            dropped += self.prune(&mut shard, now, len);
            super::shrink_if_sparse(&mut shard);
        }
        if let Some((peers, _)) = &self.peers {
            peers.lock().retain(|_, p| !idle(p, now, len));
        }
        dropped
    }

    /// `client`'s request times, oldest first.
    pub(super) fn times(&self, client: ClientId) -> Vec<f64> {
        let shard = self.shard(client).lock();
        shard
            .get(&client)
            .map_or_else(Vec::new, |l| l.times.iter().copied().collect())
    }

    /// Identities with a log.
    pub(super) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Checks counted in an overflow log.
    pub(super) fn overflowed(&self) -> u64 {
        self.overflowed.load(Ordering::Relaxed)
    }
}

/// A peer holding no log, whose shared log has nothing left in the window ending at `now`.
fn idle(p: &PeerLog, now: f64, len: f64) -> bool {
    p.live == 0 && p.overflow.back().is_none_or(|t| *t <= now - len)
}
