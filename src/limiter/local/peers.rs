//! Who minted a limit's buckets: per client peer, how many it holds and its overflow bucket.
//!
//! A peer is the client address a request came from (through trusted proxies), IPv6 grouped
//! by /64 as the `ip` key groups it: one host can rotate through its subnet's addresses, not
//! out of its peer. Its entry counts the buckets of the limit it minted and still holds (the
//! per-peer cap) and holds its overflow bucket, where its new identities are counted once it
//! is at the cap or the limit's map is full. An entry goes when its peer holds no bucket and
//! its overflow bucket is full again.

use std::collections::HashMap;
use std::hash::RandomState;
use std::net::IpAddr;

use parking_lot::{Mutex, MutexGuard};

/// Shards of the peer map, as many as the bucket map's.
const SHARDS: usize = super::SHARDS;

/// A client peer: an IPv4 address, or an IPv6 /64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Peer(u64);

impl Peer {
    /// The peer of a request from `ip`.
    pub fn of(ip: IpAddr) -> Self {
        Peer(crate::identity::peer_key(ip))
    }

    fn shard(self) -> usize {
        // Fibonacci hashing: the top bits of the product mix every bit of the address.
        (self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize % SHARDS
    }
}

/// One peer's entry.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Minted {
    /// Buckets of the limit this peer minted that the map still holds.
    pub(super) live: u32,
    /// The `tat` of its overflow bucket (`None`: full).
    pub(super) overflow: Option<f64>,
}

/// Keyed with SipHash and a random key: peers are addresses, which clients choose within their
/// ranges, so a fixed hash could be steered into one bucket chain.
pub(super) type PeerShard = HashMap<Peer, Minted, RandomState>;

/// The peer entries of one limit, sharded like its buckets, at most `per_shard_cap` a shard.
#[derive(Debug)]
pub(super) struct Peers {
    shards: Vec<Mutex<PeerShard>>,
    per_shard_cap: usize,
}

impl Peers {
    pub(super) fn new(per_shard_cap: usize) -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(PeerShard::default()))
                .collect(),
            per_shard_cap,
        }
    }

    /// `peer`'s shard, locked, holding an entry for it; `None` when the shard is full of peers
    /// that hold buckets or a non-full overflow bucket.
    pub(super) fn entry(&self, peer: Peer, now: f64) -> Option<MutexGuard<'_, PeerShard>> {
        let mut shard = self.shards[peer.shard()].lock();
        if !shard.contains_key(&peer) {
            if shard.len() >= self.per_shard_cap {
                shard.retain(|_, m| !idle(m, now));
                if shard.len() >= self.per_shard_cap {
                    return None;
                }
            }
            shard.insert(peer, Minted::default());
        }
        Some(shard)
    }

    /// `peer`'s entry as a check would find it, without making one (for `explain`): a fresh
    /// one when it has none, `None` when its shard has no room for it.
    pub(super) fn peek(&self, peer: Peer, now: f64) -> Option<Minted> {
        let shard = self.shards[peer.shard()].lock();
        if let Some(m) = shard.get(&peer) {
            return Some(*m);
        }
        let room = shard.len() < self.per_shard_cap || shard.values().any(|m| idle(m, now));
        room.then(Minted::default)
    }

    /// The map let go of buckets these peers minted.
    pub(super) fn release(&self, peers: impl Iterator<Item = Peer>, now: f64) {
        for peer in peers {
            let mut shard = self.shards[peer.shard()].lock();
            if let Some(m) = shard.get_mut(&peer) {
                m.live = m.live.saturating_sub(1);
                if idle(m, now) {
                    shard.remove(&peer);
                }
            }
        }
    }

    /// Forget peers that hold nothing. Returns how many entries are left.
    pub(super) fn sweep(&self, now: f64) -> usize {
        let mut left = 0;
        for shard in &self.shards {
            let mut shard = shard.lock();
            shard.retain(|_, m| !idle(m, now));
            if shard.capacity() > 64 && shard.len() < shard.capacity() / 4 {
                shard.shrink_to_fit();
            }
            left += shard.len();
        }
        left
    }
}

/// An entry worth nothing at `now`: no bucket, and its overflow bucket full again.
fn idle(m: &Minted, now: f64) -> bool {
    m.live == 0 && m.overflow.is_none_or(|tat| tat <= now)
}
