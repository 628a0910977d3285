//! The identities each limit rejected most, for the dashboard: a bounded Space-Saving sketch
//! per limit, written only when a limit answers 429.
//!
//! Space-Saving (Metwally et al., 2005) keeps `ENTRIES` counters: an identity already held
//! counts up; a new one takes the smallest counter's place and inherits its count as `error`,
//! so every identity rejected more than `1/ENTRIES` of the time is held, and a held count
//! overstates the truth by at most its `error`.
//!
//! Each sketch is split by thread (the slots of `sharded`), so workers rejecting a flood at
//! once take uncontended locks, and has two windows: the sampler `rotate`s every
//! `WINDOW_SECS`, clearing the older one, so a report covers the last one to two windows.
//!
//! Memory: per limit, `2 × shards (≤ 16) × ENTRIES × 32` bytes, at most 32 KiB.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::identity::ClientId;
use crate::sharded;

/// Identities held per window and shard.
pub const ENTRIES: usize = 32;

/// The length of one of the two windows, in sampler ticks (seconds).
pub const WINDOW_SECS: u64 = 300;

/// One held identity.
#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    id: u128,
    count: u32,
    /// How much of `count` the entry may have inherited from the identity it replaced.
    error: u32,
}

/// One window's Space-Saving counters.
#[derive(Debug, Clone, Copy)]
struct Window {
    entries: [Entry; ENTRIES],
    len: usize,
}

impl Default for Window {
    fn default() -> Self {
        Self {
            entries: [Entry::default(); ENTRIES],
            len: 0,
        }
    }
}

impl Window {
    fn add(&mut self, id: u128) {
        let (mut smallest, mut least) = (0, u32::MAX);
        for (i, e) in self.entries[..self.len].iter_mut().enumerate() {
            if e.id == id {
                e.count = e.count.saturating_add(1);
                return;
            }
            if e.count < least {
                (smallest, least) = (i, e.count);
            }
        }
        if self.len < ENTRIES {
            self.entries[self.len] = Entry {
                id,
                count: 1,
                error: 0,
            };
            self.len += 1;
            return;
        }
        let e = &mut self.entries[smallest];
        *e = Entry {
            id,
            count: e.count.saturating_add(1),
            error: e.count,
        };
    }
}

/// One thread slot's two windows, on cache lines of their own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Shard(Mutex<[Window; 2]>);

/// An identity among the most limited, over the window reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Top {
    pub client: ClientId,
    /// Rejections counted (an upper bound: exact while `error` is 0).
    pub count: u64,
    /// How much of `count` may belong to identities it displaced.
    pub error: u64,
}

/// The most limited identities of one limit.
#[derive(Debug)]
pub struct MostLimited {
    shards: Box<[Shard]>,
    /// The window written now (0 or 1).
    current: AtomicUsize,
    /// Off until a sampler runs: without a dashboard a 429 pays one load.
    on: Arc<AtomicBool>,
}

impl MostLimited {
    fn new(on: Arc<AtomicBool>) -> Self {
        Self {
            shards: (0..sharded::slots()).map(|_| Shard::default()).collect(),
            current: AtomicUsize::new(0),
            on,
        }
    }

    /// Count a rejection of `client`.
    pub fn record(&self, client: ClientId) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let w = self.current.load(Ordering::Relaxed) & 1;
        if let Some(shard) = self.shards.get(sharded::slot()) {
            shard.0.lock()[w].add(client.0);
        }
    }

    /// Start a new window: the older one is cleared, then written.
    pub fn rotate(&self) {
        let next = (self.current.load(Ordering::Relaxed) + 1) & 1;
        for shard in &*self.shards {
            shard.0.lock()[next] = Window::default();
        }
        self.current.store(next, Ordering::Relaxed);
    }

    /// The `n` identities with the most rejections over both windows, most first.
    pub fn top(&self, n: usize) -> Vec<Top> {
        let mut merged: HashMap<u128, (u64, u64)> = HashMap::new();
        for shard in &*self.shards {
            let windows = *shard.0.lock();
            for w in &windows {
                for e in &w.entries[..w.len] {
                    let m = merged.entry(e.id).or_default();
                    m.0 += u64::from(e.count);
                    m.1 += u64::from(e.error);
                }
            }
        }
        let mut all: Vec<Top> = merged
            .into_iter()
            .map(|(id, (count, error))| Top {
                client: ClientId(id),
                count,
                error,
            })
            .collect();
        all.sort_unstable_by(|a, b| b.count.cmp(&a.count).then(a.client.0.cmp(&b.client.0)));
        all.truncate(n);
        all
    }
}

/// Every limit's sketch, by limit name (names are global), kept across reloads.
#[derive(Debug, Default)]
pub struct MostLimitedByLimit {
    by_limit: Mutex<HashMap<Arc<str>, Arc<MostLimited>>>,
    on: Arc<AtomicBool>,
}

impl MostLimitedByLimit {
    /// The sketch of limit `name`, made on first use.
    pub fn of(&self, name: &str) -> Arc<MostLimited> {
        let mut map = self.by_limit.lock();
        if let Some(s) = map.get(name) {
            return s.clone();
        }
        let s = Arc::new(MostLimited::new(self.on.clone()));
        map.insert(name.into(), s.clone());
        s
    }

    /// The sketch of limit `name`, if one was made.
    pub fn get(&self, name: &str) -> Option<Arc<MostLimited>> {
        self.by_limit.lock().get(name).cloned()
    }

    /// Count rejections from now on (a sampler reads them).
    pub fn enable(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    /// Start a new window in every sketch, and forget those of limits no runtime has.
    pub fn rotate(&self) {
        let mut map = self.by_limit.lock();
        map.retain(|_, s| Arc::strong_count(s) > 1);
        for s in map.values() {
            s.rotate();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sketch() -> MostLimited {
        MostLimited::new(Arc::new(AtomicBool::new(true)))
    }

    #[test]
    fn counts_are_exact_below_the_capacity() {
        let s = sketch();
        for _ in 0..5 {
            s.record(ClientId(7));
        }
        s.record(ClientId(9));
        let top = s.top(10);
        assert_eq!(top.len(), 2);
        assert_eq!(
            (top[0].client, top[0].count, top[0].error),
            (ClientId(7), 5, 0)
        );
        assert_eq!((top[1].client, top[1].count), (ClientId(9), 1));
    }

    #[test]
    fn a_heavy_identity_survives_a_flood_of_others() {
        let s = sketch();
        for i in 0..10_000u128 {
            s.record(ClientId(1000 + i));
            if i % 4 == 0 {
                s.record(ClientId(1));
            }
        }
        let top = s.top(3);
        assert_eq!(top[0].client, ClientId(1));
        // The true count is 2,500; Space-Saving never undercounts a held identity.
        assert!(top[0].count >= 2500 && top[0].count - top[0].error <= 2500);
    }

    #[test]
    fn two_rotations_forget_a_window() {
        let s = sketch();
        s.record(ClientId(3));
        s.rotate();
        assert_eq!(s.top(1)[0].count, 1, "the previous window still counts");
        s.rotate();
        assert!(s.top(1).is_empty());
    }

    #[test]
    fn off_records_nothing() {
        let s = MostLimited::new(Arc::new(AtomicBool::new(false)));
        s.record(ClientId(3));
        assert!(s.top(1).is_empty());
    }
}
