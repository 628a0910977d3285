//! In-process token buckets: a sharded map from client digest to `tat`, idle eviction, a cap.
//!
//! Every limit owns one `Buckets`. A check locks the one shard its client lives in, so two
//! cores contend only when two requests hash to the same shard. A multi-limit check locks the
//! shards of all its limits in route order (always the same order, so no deadlock), decides,
//! and commits only if every limit admits: a rejected request takes no token anywhere, and no
//! interleaving of concurrent requests can over-admit.
//!
//! Memory is bounded twice: a bucket is forgotten once it would be full again (so forgetting it
//! grants nothing), and each limit holds at most `max_buckets`. When a shard is full even after
//! dropping its full buckets, a new client is counted in the limit's one shared `overflow`
//! bucket: a flood of fresh identities then shares one limit instead of exhausting memory or
//! slipping through unlimited.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::time::Instant;

use parking_lot::{Mutex, MutexGuard};

use super::{step, Rate, Small, Verdict};
use crate::identity::ClientId;

const SHARDS: usize = 64;

/// A monotonic clock in microseconds, on tokio's clock (so a test that pauses time moves it);
/// unit tests construct buckets and pass their own `now`.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: Instant,
}

impl Clock {
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }

    /// Microseconds since this clock was made.
    pub fn now_us(&self) -> f64 {
        self.at_us(Instant::now())
    }

    /// `at` on this clock, in microseconds (for a caller that has just read the time).
    pub fn at_us(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.origin).as_secs_f64() * 1e6
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

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

type Shard = HashMap<ClientId, f64, BuildHasherDefault<DigestHasher>>;

/// The buckets of one limit.
#[derive(Debug)]
pub struct Buckets {
    shards: Vec<Mutex<Shard>>,
    overflow: Mutex<Option<f64>>,
    per_shard_cap: usize,
    overflowed: AtomicU64,
}

/// One bucket to check: whose buckets, which client, at what rate and cost.
#[derive(Debug, Clone, Copy)]
pub struct Item<'a> {
    pub buckets: &'a Buckets,
    pub client: ClientId,
    pub rate: &'a Rate,
    pub cost: u32,
}

enum Slot<'a> {
    Map(MutexGuard<'a, Shard>),
    Overflow(MutexGuard<'a, Option<f64>>),
}

impl Buckets {
    /// Buckets holding at most about `max_buckets` clients (rounded up to a multiple of the
    /// shard count).
    pub fn new(max_buckets: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            overflow: Mutex::new(None),
            per_shard_cap: max_buckets.div_ceil(SHARDS).max(1),
            overflowed: AtomicU64::new(0),
        }
    }

    fn shard(&self, client: ClientId) -> &Mutex<Shard> {
        &self.shards[(client.0 >> 64) as usize % SHARDS]
    }

    /// Lock the slot `client` is counted in, making room if the shard is full.
    fn lock(&self, client: ClientId, now: f64) -> Slot<'_> {
        let mut shard = self.shard(client).lock();
        if shard.len() >= self.per_shard_cap && !shard.contains_key(&client) {
            shard.retain(|_, tat| *tat > now);
            if shard.len() >= self.per_shard_cap {
                drop(shard);
                self.overflowed.fetch_add(1, Ordering::Relaxed);
                return Slot::Overflow(self.overflow.lock());
            }
        }
        Slot::Map(shard)
    }

    /// Forget every bucket that is full at `now`. Returns how many were dropped.
    pub fn sweep(&self, now: f64) -> usize {
        let mut dropped = 0;
        for shard in &self.shards {
            let mut shard = shard.lock();
            let before = shard.len();
            shard.retain(|_, tat| *tat > now);
            dropped += before - shard.len();
            if shard.capacity() > 64 && shard.len() < shard.capacity() / 4 {
                shard.shrink_to_fit();
            }
        }
        let mut overflow = self.overflow.lock();
        if overflow.is_some_and(|tat| tat <= now) {
            *overflow = None;
        }
        dropped
    }

    /// Buckets currently held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks that found the map full and were counted in the overflow bucket.
    pub fn overflowed(&self) -> u64 {
        self.overflowed.load(Ordering::Relaxed)
    }
}

/// Check several buckets as one: every verdict is returned, and tokens are taken from all of
/// them only if every one of them admits (`enforced[i] == false` marks a shadow bucket, whose
/// rejection does not block the others and which is only charged when it admits).
pub fn check(items: &[Item<'_>], enforced: &[bool], now: f64) -> Small<Verdict> {
    // Locks are taken in slice order; callers always pass a route's limits in route order, and
    // no two items share a `Buckets`, so the order is global and cannot deadlock.
    let mut slots: Small<Slot<'_>> = items
        .iter()
        .map(|i| i.buckets.lock(i.client, now))
        .collect();
    let mut verdicts: Small<Verdict> = Small::new();
    let mut tats: Small<f64> = Small::new();
    for (item, slot) in items.iter().zip(&slots) {
        let tat = match slot {
            Slot::Map(m) => m.get(&item.client).copied(),
            Slot::Overflow(o) => **o,
        };
        let (v, t) = step(tat, now, item.rate, item.cost);
        verdicts.push(v);
        tats.push(t);
    }
    let all_admit = verdicts
        .iter()
        .zip(enforced)
        .all(|(v, enforced)| v.admitted || !enforced);
    if all_admit {
        for (((item, slot), v), tat) in items.iter().zip(&mut slots).zip(&verdicts).zip(tats) {
            if !v.admitted {
                continue;
            }
            match slot {
                Slot::Map(m) => {
                    m.insert(item.client, tat);
                }
                Slot::Overflow(o) => **o = Some(tat),
            }
        }
    }
    verdicts
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
                rate: r,
                cost: 1,
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
                rate: &ra,
                cost: 1,
            },
            Item {
                buckets: &b,
                client: ClientId(7),
                rate: &rb,
                cost: 1,
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
                rate: &ra,
                cost: 1,
            },
            Item {
                buckets: &b,
                client: ClientId(7),
                rate: &rb,
                cost: 1,
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
}
