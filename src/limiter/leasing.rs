//! Leased tokens: this replica's share of a busy identity's Redis bucket, spent without a call.
//!
//! A limit with `leasing` keeps, per identity seen here, an entry: how often it came in this
//! hold and the last, the tokens this replica holds for it, and whether a lease call is in
//! flight. An identity seen fewer than `HOT` times in a hold keeps the exact path (one check
//! in Redis per request). A hot one asks, with one request's check, for up to a lease's size
//! of further tokens (`Plan::Take`); the script takes them only if the request is admitted,
//! and never more than the bucket holds. Later requests spend them here (`Plan::Spent`), and
//! the one that finds half of the lease left asks for a top-up beside its spend, so a
//! steady hot identity never waits for Redis. Tokens no new lease topped up within `hold` go
//! back to the bucket (`sweep`), as do the tokens of a lease taken at other numbers than the
//! request's (an operator's override changed).
//!
//! An identity over its limit would cost a call per request once its lease is empty: every
//! token the bucket refills is fought for. So once Redis refuses a leased identity, or hands
//! it fewer tokens than asked, this replica makes no lease call for it for a while, and
//! refuses here (`Plan::Refused`) what the lease cannot pay: until about `REFUSED_REQUESTS` of
//! its requests have come, at most half the time the bucket takes to fill and at most a hold.
//! The tokens refilled meanwhile stay in the bucket, for the next lease (here or elsewhere):
//! the fleet admits as many, later, never more.
//!
//! The bound: a replica holds at most `L` (`LeaseSpec::tokens`) of one identity's tokens,
//! and only ever takes them from the bucket, which hands out at most `burst + rate × t` in
//! any interval `t`. What the fleet admits in `t` is what it took in `t` plus what it held at
//! the start, minus what it holds at the end and gave back: at most
//! `burst + rate × t + R × L` for `R` replicas. A replica that dies holding a lease takes its
//! unused tokens with it (at most `L`, at most one hold's refill for `auto`): the fleet then
//! admits that much less, once.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::{Rate, Verdict};
use crate::config::settings::LeaseSpec;
use crate::identity::ClientId;

/// Requests of one identity here within a hold (this one and the last) before it leases.
pub const HOT: u32 = 4;

/// A lease is topped up once this fraction of its size is left (1/2): the other half covers
/// the top-up's round trip, which under load is many requests of a hot identity long.
const TOP_UP_SHIFT: u32 = 1;

/// Requests of a refused identity this replica refuses on its own before it asks again.
const REFUSED_REQUESTS: f64 = 256.0;

/// Identities one limit's table follows at most; past it new ones keep the exact path.
pub const MAX_ENTRIES: usize = 65_536;

const SHARDS: usize = 16;

type Map = HashMap<ClientId, Entry, BuildHasherDefault<super::local::DigestHasher>>;

/// One identity's lease on this replica.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Tokens held, not yet spent.
    tokens: u32,
    /// The numbers the tokens were taken at (the limit's, or an operator's override).
    per_sec: f64,
    burst: u32,
    /// When unused tokens go back: the last grant plus the hold (µs).
    until: f64,
    /// This hold's window: when it began, requests in it and in the one before.
    window: f64,
    seen: u32,
    seen_before: u32,
    /// A lease call in flight since (µs; `None`: none). Ignored after a hold, in case its
    /// request was dropped before the answer.
    asking: Option<f64>,
    /// The bucket's tokens left fleet-wide at the last grant, less what was spent here since,
    /// and when it is full again: the headers of a request answered here.
    left: u64,
    full_at: f64,
    /// No lease call before then (µs): Redis refused the identity, or had fewer tokens than
    /// asked. A request that finds the lease empty meanwhile is refused here.
    quiet_until: f64,
}

impl Entry {
    fn new(rate: &Rate, now: f64) -> Self {
        Self {
            tokens: 0,
            per_sec: rate.per_sec,
            burst: rate.burst,
            until: now,
            window: now,
            seen: 0,
            seen_before: 0,
            asking: None,
            left: 0,
            full_at: now,
            quiet_until: now,
        }
    }

    /// Take the numbers of `rate` when they differ from the lease's (exactly the same number,
    /// or another rate: an override came or went): its tokens, to give back.
    fn renumber(&mut self, client: ClientId, rate: &Rate, now: f64) -> Option<Returned> {
        if self.per_sec.to_bits() == rate.per_sec.to_bits() && self.burst == rate.burst {
            return None;
        }
        let back = (self.tokens > 0).then_some(Returned {
            client,
            tokens: self.tokens,
            per_sec: self.per_sec,
        });
        *self = Self {
            window: self.window,
            seen: self.seen,
            seen_before: self.seen_before,
            ..Self::new(rate, now)
        };
        back
    }

    /// Count a request at `now` in its hold's window, starting a new window once it is over.
    fn count(&mut self, now: f64, hold_us: f64) {
        if now >= self.window + hold_us {
            self.seen_before = if now < self.window + 2.0 * hold_us {
                self.seen
            } else {
                0
            };
            (self.window, self.seen) = (now, 0);
        }
        self.seen = self.seen.saturating_add(1);
    }
}

/// What a check of a leased limit does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Plan {
    /// Not leased here (a cold identity, or a lease call in flight): Redis decides, as today.
    Exact,
    /// Redis decides, and takes up to `extra` more tokens for this replica if it admits.
    Take { extra: u32 },
    /// Admitted here from the lease; `top_up` more tokens asked of Redis beside (0: none).
    Spent { verdict: Verdict, top_up: u32 },
    /// Refused here: the lease is empty, and Redis refused the identity (or had fewer tokens
    /// than a lease asked) a moment ago.
    Refused { verdict: Verdict },
}

/// What a check asks of Redis for a lease, beside its own cost: `tokens` more, and for a
/// top-up (`top_up`: the request was spent here) nothing for itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ask {
    pub tokens: u32,
    pub top_up: bool,
}

/// Tokens to give back to the bucket at `per_sec` (their lease ended).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Returned {
    pub client: ClientId,
    pub tokens: u32,
    pub per_sec: f64,
}

/// One limit's leases on this replica.
#[derive(Debug)]
pub struct Leases {
    spec: LeaseSpec,
    hold_us: f64,
    shards: Box<[Mutex<Map>]>,
    entries: AtomicUsize,
}

impl Leases {
    pub fn new(spec: LeaseSpec) -> Self {
        Self {
            spec,
            hold_us: spec.hold.as_secs_f64() * 1e6,
            shards: (0..SHARDS).map(|_| Mutex::new(Map::default())).collect(),
            entries: AtomicUsize::new(0),
        }
    }

    pub fn spec(&self) -> &LeaseSpec {
        &self.spec
    }

    fn shard(&self, client: ClientId) -> &Mutex<Map> {
        &self.shards[(client.0 >> 64) as usize % SHARDS]
    }

    /// The plan for one request of `client` costing `cost` at `rate`, at `now` (µs), and
    /// tokens to give back first (a lease taken at other numbers).
    pub fn plan(
        &self,
        client: ClientId,
        cost: u32,
        rate: &Rate,
        now: f64,
    ) -> (Plan, Option<Returned>) {
        let mut map = self.shard(client).lock();
        let e = match map.get_mut(&client) {
            Some(e) => e,
            None => {
                if self.entries.load(Ordering::Relaxed) >= MAX_ENTRIES {
                    return (Plan::Exact, None);
                }
                self.entries.fetch_add(1, Ordering::Relaxed);
                map.entry(client).or_insert(Entry::new(rate, now))
            }
        };
        e.count(now, self.hold_us);
        let back = e.renumber(client, rate, now);
        let asking = e.asking.is_some_and(|t| now - t < self.hold_us);
        let size = self.size(e, cost);
        if e.tokens >= cost {
            e.tokens -= cost;
            e.left = e.left.saturating_sub(u64::from(cost));
            let verdict = Verdict {
                admitted: true,
                remaining: e.left,
                reset_us: (e.full_at - now).max(0.0),
                retry_after_us: 0.0,
            };
            let mut top_up = 0;
            if !asking && now >= e.quiet_until && e.tokens <= size >> TOP_UP_SHIFT {
                top_up = size.saturating_sub(e.tokens);
                e.asking = Some(now);
            }
            return (Plan::Spent { verdict, top_up }, back);
        }
        if now < e.quiet_until {
            let verdict = Verdict {
                admitted: false,
                remaining: 0,
                reset_us: (e.full_at - now).max(0.0),
                retry_after_us: e.quiet_until - now,
            };
            return (Plan::Refused { verdict }, back);
        }
        if asking || e.seen.saturating_add(e.seen_before) < HOT {
            return (Plan::Exact, back);
        }
        e.asking = Some(now);
        let extra = size.saturating_sub(e.tokens).saturating_sub(cost);
        (Plan::Take { extra }, back)
    }

    /// The size of `e`'s next lease: the spec's, or for `auto` what the identity asked here
    /// in a hold (at least two requests' worth), at most the spec's.
    fn size(&self, e: &Entry, cost: u32) -> u32 {
        if !self.spec.auto {
            return self.spec.tokens;
        }
        let asked = e.seen.max(e.seen_before).saturating_mul(cost);
        asked.max(cost.saturating_mul(2)).min(self.spec.tokens)
    }

    /// Redis admitted a request that asked for `asked` more tokens, with `remaining` whole
    /// tokens left after its own cost and the bucket full again in `reset_us`: the lease now
    /// holds `min(asked, remaining)` more (the script took exactly that many).
    pub fn granted(&self, client: ClientId, asked: u32, remaining: u64, reset_us: f64, now: f64) {
        let mut map = self.shard(client).lock();
        let Some(e) = map.get_mut(&client) else {
            return;
        };
        let got = u32::try_from(remaining.min(u64::from(asked))).unwrap_or(asked);
        e.tokens = e.tokens.saturating_add(got).min(self.spec.tokens);
        e.asking = None;
        if got < asked {
            // The bucket is nearly dry: asking again at once would cost a call a request.
            e.quiet_until = now + self.quiet(e);
        }
        e.until = now + self.hold_us;
        e.left = remaining;
        e.full_at = now + reset_us;
    }

    /// A lease call came back without tokens (refused, failed, or not charged).
    pub fn not_granted(&self, client: ClientId) {
        if let Some(e) = self.shard(client).lock().get_mut(&client) {
            e.asking = None;
        }
    }

    /// Redis refused a lease call of `client` at `now` with `refused`: no call (and requests
    /// the lease cannot pay refused here) for `quiet`, at least until Redis's retry time.
    pub fn refused(&self, client: ClientId, refused: &Verdict, now: f64) {
        let mut map = self.shard(client).lock();
        let Some(e) = map.get_mut(&client) else {
            return;
        };
        e.asking = None;
        e.quiet_until = now + self.quiet(e).max(refused.retry_after_us);
        e.full_at = now + refused.reset_us;
        e.left = refused.remaining;
    }

    /// How long `e` goes without a lease call once the bucket ran dry: until about
    /// `REFUSED_REQUESTS` more of its requests have come here, at most half the bucket's fill
    /// time and a hold.
    fn quiet(&self, e: &Entry) -> f64 {
        let per_hold = f64::from(e.seen.max(e.seen_before).max(1));
        let wait = REFUSED_REQUESTS * self.hold_us / per_hold;
        let fill_us = f64::from(e.burst) / e.per_sec.max(f64::MIN_POSITIVE) * 1e6;
        wait.min(self.hold_us).min(fill_us / 2.0)
    }

    /// End `client`'s lease (Redis refused the identity outright: a ban): its tokens, to give
    /// back.
    pub fn end(&self, client: ClientId) -> Option<Returned> {
        let mut map = self.shard(client).lock();
        let e = map.get_mut(&client)?;
        e.asking = None;
        let tokens = std::mem::take(&mut e.tokens);
        (tokens > 0).then_some(Returned {
            client,
            tokens,
            per_sec: e.per_sec,
        })
    }

    /// A request spent from the lease was refused by another limit: its tokens come back.
    pub fn put_back(&self, client: ClientId, cost: u32) {
        if let Some(e) = self.shard(client).lock().get_mut(&client) {
            e.tokens = e.tokens.saturating_add(cost).min(self.spec.tokens);
            e.left = e.left.saturating_add(u64::from(cost));
        }
    }

    /// Tokens held (all identities), for `/metrics` and tests.
    pub fn held(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.lock().values().map(|e| u64::from(e.tokens)).sum::<u64>())
            .sum()
    }

    /// Take out the tokens whose hold ended, to give back to the bucket, and forget the
    /// identities quiet for two holds.
    pub fn sweep(&self, now: f64) -> Vec<Returned> {
        let mut back = Vec::new();
        for shard in &self.shards {
            let mut map = shard.lock();
            let before = map.len();
            map.retain(|&client, e| {
                if e.tokens > 0 && now >= e.until {
                    back.push(Returned {
                        client,
                        tokens: e.tokens,
                        per_sec: e.per_sec,
                    });
                    e.tokens = 0;
                }
                e.tokens > 0 || now < e.window + 2.0 * self.hold_us
            });
            self.entries
                .fetch_sub(before - map.len(), Ordering::Relaxed);
        }
        back
    }

    /// Give every token back (the limit is being replaced).
    pub fn drain(&self) -> Vec<Returned> {
        self.sweep(f64::INFINITY)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const HOLD: f64 = 1e6;

    fn r(per_sec: f64) -> Rate {
        Rate {
            per_sec,
            burst: 1_000,
        }
    }

    fn leases(tokens: u32, auto: bool) -> Leases {
        Leases::new(LeaseSpec {
            tokens,
            auto,
            hold: Duration::from_secs(1),
        })
    }

    #[test]
    fn cold_identities_stay_exact_then_lease_and_spend_locally() {
        let l = leases(100, false);
        let c = ClientId(7);
        for i in 0..HOT - 1 {
            assert_eq!(l.plan(c, 1, &r(10.0), f64::from(i)).0, Plan::Exact);
        }
        assert_eq!(l.plan(c, 1, &r(10.0), 5.0).0, Plan::Take { extra: 99 });
        // In flight: the others keep the exact path.
        assert_eq!(l.plan(c, 1, &r(10.0), 6.0).0, Plan::Exact);
        l.granted(c, 99, 500, 1e5, 7.0);
        let mut spent = 0;
        let mut top_ups = 0;
        for i in 0..99 {
            match l.plan(c, 1, &r(10.0), 8.0 + f64::from(i)).0 {
                Plan::Spent { top_up, .. } => {
                    spent += 1;
                    if top_up > 0 {
                        top_ups += 1;
                    }
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!((spent, top_ups), (99, 1));
        assert_eq!(l.held(), 0);
    }

    #[test]
    fn a_lease_never_holds_more_than_its_size() {
        let l = leases(10, false);
        let c = ClientId(1);
        l.plan(c, 1, &r(10.0), 0.0);
        l.granted(c, 1_000, 1_000, 0.0, 1.0);
        assert_eq!(l.held(), 10);
        l.put_back(c, 5);
        assert_eq!(l.held(), 10);
    }

    #[test]
    fn unused_tokens_go_back_after_the_hold_and_on_a_new_rate() {
        let l = leases(10, false);
        let c = ClientId(2);
        l.plan(c, 1, &r(10.0), 0.0);
        l.granted(c, 10, 100, 0.0, 1.0);
        assert!(l.sweep(HOLD / 2.0).is_empty());
        let back = l.sweep(HOLD + 2.0);
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].tokens, 10);
        l.granted(c, 10, 100, 0.0, 2.0 * HOLD);
        let (_, back) = l.plan(c, 1, &r(20.0), 2.0 * HOLD + 1.0);
        assert_eq!(back.map(|r| (r.tokens, r.per_sec)), Some((10, 10.0)));
        assert_eq!(l.held(), 0);
        // Quiet for two holds: forgotten.
        l.sweep(10.0 * HOLD);
        assert_eq!(l.entries.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn auto_sizes_from_what_the_identity_asked_in_a_hold() {
        let l = leases(128, true);
        let c = ClientId(3);
        for i in 0..10 {
            l.plan(c, 1, &r(1e6), f64::from(i));
        }
        // 11 requests in this hold: a lease of 11 at most (10 more beside this request's).
        l.not_granted(c);
        assert_eq!(l.plan(c, 1, &r(1e6), 20.0).0, Plan::Take { extra: 10 });
    }

    #[test]
    fn a_refused_identity_is_refused_here_for_a_while_then_asks_again() {
        let l = leases(100, true);
        let c = ClientId(4);
        let rate = Rate {
            per_sec: 1_000.0,
            burst: 1_000,
        };
        // 2,560 requests in this hold: 256 of them take a tenth of it.
        for i in 0..2_560 {
            l.plan(c, 1, &rate, f64::from(i));
        }
        l.not_granted(c);
        assert!(matches!(l.plan(c, 1, &rate, 2_600.0).0, Plan::Take { .. }));
        let refusal = Verdict {
            admitted: false,
            remaining: 0,
            reset_us: 1e6,
            retry_after_us: 1_000.0,
        };
        l.refused(c, &refusal, 3_000.0);
        match l.plan(c, 1, &rate, 4_000.0).0 {
            Plan::Refused { verdict } => {
                assert!(!verdict.admitted);
                // 256 requests at 2,561 a hold of 1 s: about 0.1 s.
                assert!(
                    (verdict.retry_after_us - 98_960.0).abs() < 1_000.0,
                    "{verdict:?}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            l.plan(c, 1, &rate, 103_000.0).0,
            Plan::Take { .. }
        ));
    }
}
