//! The in-process logs of `exact` window limits: per identity, the times of its requests in
//! the last window, bounded by the limit's N (at most `EXACT_MAX`) and by `max_buckets`.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::{DigestHasher, SHARDS};
use crate::identity::ClientId;

/// One shard of logs: request times in wall-clock microseconds, oldest first.
pub(super) type LogShard = HashMap<ClientId, VecDeque<f64>, BuildHasherDefault<DigestHasher>>;

/// Where an identity past the cap is counted, with everyone else past it: one log per shard.
const OVERFLOW: ClientId = ClientId(u128::MAX);

/// The logs of one `exact` limit.
#[derive(Debug)]
pub struct Logs {
    shards: Vec<Mutex<LogShard>>,
    per_shard_cap: usize,
    overflowed: AtomicU64,
}

impl Logs {
    pub(super) fn new(per_shard_cap: usize) -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(LogShard::default()))
                .collect(),
            per_shard_cap,
            overflowed: AtomicU64::new(0),
        }
    }

    /// The shard `client` lives in: the same as its buckets' (`Buckets::shard`).
    fn shard(&self, client: ClientId) -> &Mutex<LogShard> {
        &self.shards[super::shard_of(client)]
    }

    /// Lock `client`'s shard, and say which log it counts in: its own, or (the shard full of
    /// logs that still count at `now`, for windows of `len`) the shard's overflow log.
    pub(super) fn lock(
        &self,
        client: ClientId,
        now: f64,
        len: f64,
    ) -> (MutexGuard<'_, LogShard>, ClientId) {
        let mut shard = self.shard(client).lock();
        if shard.contains_key(&client) || shard.len() < self.per_shard_cap {
            return (shard, client);
        }
        prune(&mut shard, now, len);
        if shard.len() < self.per_shard_cap {
            return (shard, client);
        }
        self.overflowed.fetch_add(1, Ordering::Relaxed);
        (shard, OVERFLOW)
    }

    /// Forget the logs with nothing left in the window ending at `now`. Returns how many.
    pub(super) fn sweep(&self, now: f64, len: f64) -> usize {
        let mut dropped = 0;
        for shard in &self.shards {
            let mut shard = shard.lock();
            dropped += prune(&mut shard, now, len);
            super::shrink_if_sparse(&mut shard);
        }
        dropped
    }

    /// `client`'s request times, oldest first.
    pub(super) fn times(&self, client: ClientId) -> Vec<f64> {
        let shard = self.shard(client).lock();
        shard
            .get(&client)
            .map_or_else(Vec::new, |l| l.iter().copied().collect())
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

fn prune(shard: &mut LogShard, now: f64, len: f64) -> usize {
    let before = shard.len();
    shard.retain(|_, log| log.back().is_some_and(|t| *t > now - len));
    before - shard.len()
}
