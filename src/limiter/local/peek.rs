//! A read-only look at one bucket of a limit, for `explain`: where a check would count the
//! client and that bucket's `tat`, taking and minting nothing.

use super::{Buckets, Peer};
use crate::identity::ClientId;

/// Where a check of a client would be counted (see the exhaustion policy in `local`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// The client's own bucket.
    Own,
    /// A new bucket of its own (none yet: it is full).
    New,
    /// Its peer's overflow bucket: the peer holds `max_buckets_per_peer` buckets, or the map
    /// is full.
    PeerOverflow,
    /// The limit's one shared overflow bucket: the map and the peer map are full.
    Overflow,
}

impl Counted {
    pub fn as_str(self) -> &'static str {
        match self {
            Counted::Own => "own",
            Counted::New => "new",
            Counted::PeerOverflow => "peer_overflow",
            Counted::Overflow => "overflow",
        }
    }
}

impl Buckets {
    /// Where a check of `client` from `peer` at `now` (for a quota: its window's start) would
    /// be counted, and that bucket's `tat` (`None`: full). Locks one bucket shard, then one
    /// peer shard, never both at once; writes nothing, so a look at a full map costs a scan of
    /// one shard and changes no one's bucket.
    pub fn peek(&self, client: ClientId, peer: Peer, now: f64) -> (Counted, Option<f64>) {
        let shard = self.shard(client).lock();
        if let Some(e) = shard.get(&client) {
            return (Counted::Own, Some(e.tat));
        }
        // A check would reclaim the buckets that refilled first.
        let room = shard.len() < self.per_shard_cap || shard.values().any(|e| e.tat <= now);
        drop(shard);
        let Some(peers) = &self.peers else {
            return if room {
                (Counted::New, None)
            } else {
                (Counted::Overflow, *self.overflow.lock())
            };
        };
        match peers.peek(peer, now) {
            None => (Counted::Overflow, *self.overflow.lock()),
            Some(m) if room && m.live < self.per_peer_cap => (Counted::New, None),
            Some(m) => (Counted::PeerOverflow, m.overflow),
        }
    }
}

impl Buckets {
    /// The `tat` held under `key`, if any.
    pub fn tat_of(&self, key: ClientId) -> Option<f64> {
        self.shard(key).lock().get(&key).map(|e| e.tat)
    }

    /// The request times an `exact` window holds for `client` (empty for other limits).
    pub fn log_of(&self, client: ClientId) -> Vec<f64> {
        self.logs
            .as_ref()
            .map_or_else(Vec::new, |l| l.times(client))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{check, Item};
    use super::*;
    use crate::limiter::Rate;

    #[test]
    fn a_peek_takes_nothing_and_sees_what_a_check_would_count() {
        let b = Buckets::capped_per_peer(64 * 10, 1);
        let rate = Rate {
            per_sec: 1.0,
            burst: 3,
        };
        let peer = Peer::of("192.0.2.1".parse().unwrap());
        let item = |client| Item {
            buckets: &b,
            client: ClientId(client),
            peer,
            rate: &rate,
            cost: 1,
            window: None,
        };
        assert_eq!(b.peek(ClientId(1), peer, 0.0), (Counted::New, None));
        let tat = check(&[item(1)], &[true], 0.0);
        assert_eq!(tat[0].remaining, 2);
        for _ in 0..10 {
            assert_eq!(b.peek(ClientId(1), peer, 0.0), (Counted::Own, Some(1e6)));
        }
        assert_eq!(check(&[item(1)], &[true], 0.0)[0].remaining, 1);
        // The peer is at its cap of one bucket: its next key shares the peer's bucket.
        assert_eq!(
            b.peek(ClientId(2), peer, 0.0),
            (Counted::PeerOverflow, None)
        );
        assert_eq!(b.len(), 1);
    }
}
