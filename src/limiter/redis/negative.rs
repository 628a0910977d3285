//! The negative cache: rejections Redis has already decided, answered again without asking it.
//!
//! A client flooding a limit it has exhausted would otherwise cost one Redis round trip per
//! rejected request. But once Redis says a bucket's `tat` is T, no request anywhere can take a
//! token from it before `T + cost*tok - tau` (that is what "rejected" means), so until then the
//! answer is known: this cache keeps the last `tat` seen for each bucket of a rejected request
//! and replays `limiter::step` on it locally.
//!
//! Why this is exact in the safe direction: the `tat` kept is a lower bound of the real one.
//! It is placed on the local clock at the instant the request was *sent* (Redis read its clock
//! later), and a bucket's effective `tat` (`max(tat, now)`) only grows: admissions push it
//! forward, time never pulls it back. So a cached rejection is always a real rejection, and a
//! cached entry stops blocking no later than Redis would start admitting. Exceptions: a cluster
//! refund lowers a `tat` (so a refund makes the cache forget its buckets, though a rejection
//! computed before the refund and arriving after it is still learnt); Redis's wall clock may
//! step; and Redis may lose keys (a restart without persistence, a failover, a FLUSHALL), after
//! which the cache goes on rejecting a client Redis has forgotten, for at most that rejection's
//! retry-after.
//!
//! Whatever Redis answers, the cache never believes a bucket more than one refill period
//! (`tau`) ahead: the script already clamps a `tat` that a clock stepping back left too far
//! ahead, and the cache clamps again (a reply from a server running an older script, or a
//! step during the call), so a proxy never keeps a client locked out past `tau` on its own.
//!
//! A calendar quota that rejected stays rejected until its window ends (usage only grows within
//! a window), and a sliding or exact window until its retry time (its count only falls as time
//! passes, and other replicas' admissions only push that time later): the cache keeps that
//! time, placed on the local clock as `sent + retry` (a lower bound again, since Redis read its
//! clock after the request was sent), and the count left.
//!
//! A connection replaced (Redis restarted, or dropped an idle connection) empties the cache:
//! a Redis that restarted without persistence lost the counts its rejections came from, and
//! another replica would admit what this one still refused.
//!
//! A banned identity is held alike until its ban ends (`sent + retry`, the ban's remaining
//! time as Redis answered it): a flood from a banned client costs Redis nothing either. Before
//! the ban, the rejections of a limit with a ban are not cached: each is a strike Redis counts.
//!
//! Verdicts of the *other* buckets of a short-circuited request come from the same lower bound
//! (or a full bucket if nothing is known), so their `remaining` may be optimistic; the decision
//! and the numbers of the rejecting bucket are exact.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::Bucket;
use crate::limiter::ban::BanEvent;
use crate::limiter::{step, Small, Verdict};

/// How often a full map may be swept (µs): a sweep walks the whole map under the lock.
const SWEEP_EVERY_US: f64 = 100_000.0;

/// A map this small is also swept by lookups (as often), so that it empties when the clients
/// it holds stop being rejected.
const SMALL_SWEEP: usize = 1024;

/// What the cache knows about one bucket, and under which numbers it was learnt.
#[derive(Debug, Clone, Copy)]
struct Known {
    tat: f64,
    per_sec_bits: u64,
    burst: u32,
    cost: u32,
    /// A quota bucket: rejected until `tat` (its window's end), with this much left.
    quota_left: Option<u64>,
    /// Banned until `tat`.
    banned: bool,
}

impl Known {
    /// The entry was learnt under this bucket's rate and cost (a reload may change them).
    fn fits(&self, b: &Bucket<'_>) -> bool {
        self.per_sec_bits == b.rate.per_sec.to_bits()
            && self.burst == b.rate.burst
            && self.cost == b.cost
    }
}

#[derive(Debug, Default)]
struct Map {
    entries: HashMap<String, Known>,
    next_sweep_us: f64,
}

/// Known bucket states, keyed by Redis key, at most `cap` of them.
#[derive(Debug)]
pub(super) struct NegativeCache {
    cap: usize,
    map: Mutex<Map>,
    /// The map's length as of its last change: while it is 0 (no client is being rejected),
    /// a check skips the lock that every worker would otherwise take on every request.
    held: AtomicUsize,
    /// The limiter's reconnect count the entries were learnt under.
    generation: std::sync::atomic::AtomicU64,
}

impl NegativeCache {
    pub(super) fn new(cap: usize) -> Self {
        Self {
            cap,
            map: Mutex::new(Map::default()),
            held: AtomicUsize::new(0),
            generation: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Whether any entry is held (one atomic load).
    pub(super) fn holds_any(&self) -> bool {
        self.held.load(Ordering::Relaxed) > 0
    }

    /// Forget every entry if the limiter's connections were replaced since they were learnt
    /// (`generation`: its reconnect count): Redis may have restarted and lost the counts.
    pub(super) fn renew(&self, generation: u64) {
        let was = self.generation.swap(generation, Ordering::AcqRel);
        if was != generation {
            self.clear();
        }
    }

    /// Forget every entry.
    pub(super) fn clear(&self) {
        let mut map = self.map.lock();
        map.entries.clear();
        self.held.store(0, Ordering::Relaxed);
    }

    /// The verdicts for `buckets` at `now_us` when an enforced one of them is known to reject;
    /// `None` when Redis has to be asked.
    pub(super) fn answer(
        &self,
        buckets: &[Bucket<'_>],
        now_us: f64,
    ) -> Option<(Small<Verdict>, Small<BanEvent>)> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut map = self.map.lock();
        if map.entries.len() <= SMALL_SWEEP {
            // Once the floods are over, the map empties and checks skip the lock again.
            Self::sweep(&mut map, now_us);
            self.held.store(map.entries.len(), Ordering::Relaxed);
        }
        if map.entries.is_empty() {
            return None;
        }
        let known = |b: &Bucket<'_>| map.entries.get(&b.key).filter(|k| k.fits(b)).copied();
        let verdict = |b: &Bucket<'_>| match (known(b), b.quota) {
            // Banned, or a quota spent: refused until `tat`.
            (Some(k), _) if (k.banned || k.quota_left.is_some()) && k.tat > now_us => Verdict {
                admitted: false,
                remaining: k.quota_left.unwrap_or(0),
                reset_us: k.tat - now_us,
                retry_after_us: k.tat - now_us,
            },
            // A quota not known to reject: admitted as far as the cache knows.
            (_, Some(q)) => Verdict {
                admitted: true,
                remaining: u64::from(q.count),
                reset_us: 1.0,
                retry_after_us: 0.0,
            },
            (Some(k), None) if !k.banned => step(Some(k.tat), now_us, b.rate, b.cost).0,
            (_, None) => step(None, now_us, b.rate, b.cost).0,
        };
        let blocked = buckets
            .iter()
            .any(|b| b.enforced && known(b).is_some() && !verdict(b).admitted);
        if !blocked {
            return None;
        }
        let bans = buckets
            .iter()
            .map(|b| match known(b) {
                Some(k) if k.banned && k.tat > now_us => BanEvent::Refused,
                _ => BanEvent::None,
            })
            .collect();
        Some((buckets.iter().map(verdict).collect(), bans))
    }

    /// Learn the buckets of a request Redis rejected. `sent_us` is when it was sent (local
    /// clock); `verdicts` are what Redis answered, one per bucket.
    // One pass over a rejected batch's verdicts; its parts share the clock readings and the lock.
    #[allow(clippy::too_many_lines)]
    pub(super) fn remember(
        &self,
        buckets: &[Bucket<'_>],
        verdicts: &[Verdict],
        bans: &[BanEvent],
        sent_us: f64,
    ) {
        let mut map = self.map.lock();
        for (i, (b, v)) in buckets.iter().zip(verdicts).enumerate() {
            if matches!(bans.get(i), Some(BanEvent::Refused | BanEvent::Started(_))) {
                // Banned: refused until the ban ends, whatever the bucket holds.
                if map.entries.len() < self.cap || map.entries.contains_key(&b.key) {
                    let known = Known {
                        tat: sent_us + v.retry_after_us,
                        per_sec_bits: b.rate.per_sec.to_bits(),
                        burst: b.rate.burst,
                        cost: b.cost,
                        quota_left: None,
                        banned: true,
                    };
                    map.entries.insert(b.key.clone(), known);
                }
                continue;
            }
            if b.ban.is_some() {
                // A rejection by a limit with a ban is a strike: Redis must count each one.
                map.entries.remove(&b.key);
                continue;
            }
            if b.quota.is_some() {
                // Only a quota's or a window's rejection is worth knowing: it holds until its
                // retry time (a quota's window end), whatever the other replicas do.
                if v.admitted {
                    map.entries.remove(&b.key);
                } else if map.entries.len() < self.cap || map.entries.contains_key(&b.key) {
                    let known = Known {
                        tat: sent_us + v.retry_after_us.min(2.0 * b.rate.window_us()),
                        per_sec_bits: b.rate.per_sec.to_bits(),
                        burst: b.rate.burst,
                        cost: b.cost,
                        quota_left: Some(v.remaining),
                        banned: false,
                    };
                    map.entries.insert(b.key.clone(), known);
                }
                continue;
            }
            // Nothing was written: an admitting bucket still holds the `tat` its verdict was
            // computed from, one `cost` before the `reset` it reports.
            let charged = if v.admitted {
                f64::from(b.cost) * b.rate.token_us()
            } else {
                0.0
            };
            // At most one refill period ahead, whatever Redis's clock did (see the module doc).
            let tat = sent_us + v.reset_us.min(b.rate.window_us()) - charged;
            if tat <= sent_us {
                // A full bucket: knowing it is worth nothing.
                map.entries.remove(&b.key);
                continue;
            }
            if map.entries.len() >= self.cap && !map.entries.contains_key(&b.key) {
                Self::sweep(&mut map, sent_us);
                if map.entries.len() >= self.cap {
                    // Still full of live entries: those requests simply ask Redis.
                    continue;
                }
            }
            let known = Known {
                tat,
                per_sec_bits: b.rate.per_sec.to_bits(),
                burst: b.rate.burst,
                cost: b.cost,
                quota_left: None,
                banned: false,
            };
            map.entries.insert(b.key.clone(), known);
        }
        self.held.store(map.entries.len(), Ordering::Relaxed);
    }

    /// Forget what is known of `keys`: a cluster refund gave them tokens back, so a rejection
    /// learnt before it may no longer hold.
    pub(super) fn forget<'k>(&self, keys: impl Iterator<Item = &'k str>) {
        if self.held.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut map = self.map.lock();
        for key in keys {
            map.entries.remove(key);
        }
        self.held.store(map.entries.len(), Ordering::Relaxed);
    }

    /// Drop the buckets that are full again (at most once per `SWEEP_EVERY_US`).
    fn sweep(map: &mut Map, now_us: f64) {
        if now_us < map.next_sweep_us {
            return;
        }
        map.next_sweep_us = now_us + SWEEP_EVERY_US;
        map.entries.retain(|_, k| k.tat > now_us);
    }

    /// Entries held, for tests and metrics.
    pub(super) fn len(&self) -> usize {
        self.map.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Rate;

    fn rate_of(per_sec: f64, burst: u32) -> Rate {
        Rate { per_sec, burst }
    }

    fn bucket<'a>(key: &str, rate: &'a Rate, enforced: bool) -> Bucket<'a> {
        Bucket {
            key: key.to_owned(),
            slot: 0,
            rate,
            cost: 1,
            lease: 0,
            enforced,
            quota: None,
            ban: None,
            debt: false,
        }
    }

    #[test]
    fn a_known_rejection_is_replayed_until_a_token_is_back() {
        let cache = NegativeCache::new(100);
        let rate = rate_of(1.0, 2);
        let b = [bucket("k", &rate, true)];
        assert!(cache.answer(&b, 0.0).is_none());
        // Redis said: empty, full again in 2 s, a token in 1 s.
        let v = step(Some(2e6), 0.0, &rate, 1).0;
        cache.remember(&b, &[v], &[], 0.0);
        let again = cache.answer(&b, 0.4e6).expect("still rejected").0;
        assert_eq!(again[0], step(Some(2e6), 0.4e6, &rate, 1).0);
        assert!((again[0].retry_after_us - 0.6e6).abs() < 1e-3);
        assert!(
            cache.answer(&b, 1e6).is_none(),
            "a token is back: ask Redis"
        );
    }

    #[test]
    fn only_an_enforced_bucket_with_the_same_numbers_blocks() {
        let cache = NegativeCache::new(100);
        let rate = rate_of(1.0, 1);
        let v = step(Some(1e6), 0.0, &rate, 1).0;
        cache.remember(&[bucket("k", &rate, true)], &[v], &[], 0.0);
        assert!(cache.answer(&[bucket("k", &rate, false)], 0.0).is_none());
        let other = rate_of(2.0, 1);
        assert!(cache.answer(&[bucket("k", &other, true)], 0.0).is_none());
    }

    #[test]
    fn the_map_empties_once_its_buckets_are_full_again() {
        let cache = NegativeCache::new(100);
        let rate = rate_of(1.0, 2);
        let b = [bucket("k", &rate, true)];
        cache.remember(&b, &[step(Some(2e6), 0.0, &rate, 1).0], &[], 0.0);
        assert_eq!(cache.held.load(Ordering::Relaxed), 1);
        assert!(cache.answer(&b, 0.5e6).is_some());
        // Full again at 2 s: the next lookup drops it, and later ones skip the lock.
        assert!(cache.answer(&b, 2.5e6).is_none());
        assert_eq!((cache.len(), cache.held.load(Ordering::Relaxed)), (0, 0));
    }

    #[test]
    fn a_rejection_is_believed_for_one_period_at_most() {
        let cache = NegativeCache::new(100);
        // 1/s, burst 3: tau = 3 s. A Redis whose clock stepped back an hour says so.
        let rate = rate_of(1.0, 3);
        let b = [bucket("k", &rate, true)];
        let told = Verdict {
            admitted: false,
            remaining: 0,
            reset_us: 3_603e6,
            retry_after_us: 3_601e6,
        };
        cache.remember(&b, &[told], &[], 0.0);
        let replayed = cache.answer(&b, 0.0).expect("a known rejection").0;
        assert!(
            replayed[0].retry_after_us <= 1e6 + 1e-3,
            "{:?}",
            replayed[0]
        );
        assert!(replayed[0].reset_us <= 3e6 + 1e-3, "{:?}", replayed[0]);
        assert!(
            cache.answer(&b, 1e6).is_none(),
            "a token is back: ask Redis"
        );
    }

    #[test]
    fn memory_is_capped() {
        let cache = NegativeCache::new(10);
        let rate = rate_of(1.0, 1);
        let v = step(Some(1e6), 0.0, &rate, 1).0;
        for i in 0..100 {
            cache.remember(&[bucket(&i.to_string(), &rate, true)], &[v], &[], 0.0);
        }
        assert_eq!(cache.len(), 10);
        // Once those are full again a sweep makes room.
        cache.remember(&[bucket("late", &rate, true)], &[v], &[], 5e6);
        assert_eq!(cache.len(), 1);
    }
}
