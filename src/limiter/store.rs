//! The limiter's store interface: where a request's buckets are checked and their cost taken,
//! all or nothing, in one call (with the tokens leases take, and concurrency slots beside
//! them): in process (`Local`) or in Redis (`Shared`).
//!
//! A check commits as it decides (in process under the buckets' locks, in Redis in one
//! script): a separate commit step would cost Redis a second round trip per request. What a
//! store cannot answer is `decide`'s to settle by each limit's failure policy, so that policy
//! is tested (`decide/tests.rs`) with stores that fail or answer as told, for buckets, windows,
//! leases and slots alike.

use std::future::Future;

use super::ban::BanEvent;
use super::concurrency::SlotHeld;
use super::leasing::{Ask, Returned};
use super::redis::slots::Taken;
use super::redis::{RedisLimiter, Unavailable};
use super::{local, window, Check, Limit, Moment, Small, Tuning, Verdict};
use crate::config::settings::Rate;
use crate::identity::ClientId;

/// One request's checks as a store is asked them: aligned slices, one entry per bucket.
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    pub checks: &'a [Check<'a>],
    /// `false` for a shadow limit: counted, but it rejects nothing (and takes nothing from the
    /// others when it is over).
    pub enforced: &'a [bool],
    /// An operator's numbers for a check (aligned with `checks`; empty: none).
    pub tuned: &'a [Option<&'a Tuning>],
    /// Who minted a new in-process bucket: the exhaustion policy caps buckets per peer.
    pub peer: local::Peer,
    /// Now on the in-process clock.
    pub now: Moment,
    /// The wall-clock time quotas count in, when the caller knows it (a replay); else read.
    pub wall: Option<Moment>,
    /// The tokens each check takes for this replica's lease beside its own cost (aligned with
    /// `checks`; empty: none). Only a shared store leases (see `leasing`).
    pub leases: &'a [Ask],
}

/// A store's answer: per check its verdict, or the one check whose ban refused the request
/// before any bucket was asked; and per check what happened to its ban (started, refused,
/// lifted; empty when nothing did). Shaped so that the common answer, a verdict per check and
/// no ban, is the buckets' own list, not a copy of it.
#[derive(Debug, Default)]
pub struct Answer {
    /// In check order; empty when `banned` is set.
    pub verdicts: Small<Verdict>,
    /// The check an in-process ban refused the request for, with its verdict.
    pub banned: Option<(usize, Verdict)>,
    pub bans: Small<BanEvent>,
}

/// Where buckets, leases and concurrency slots are kept. `check` takes the cost of every check
/// only if every enforced one admits it; an error means nothing was taken and nothing is known.
pub trait Store {
    fn check<'s>(
        &'s self,
        asked: Asked<'s>,
    ) -> impl Future<Output = Result<Answer, Unavailable>> + Send + 's;

    /// Take one of `limit`'s concurrency slots for `client` while fewer than `max` are held:
    /// the slot and the count in flight with it, or the count in flight when all are taken.
    /// An error means no slot was taken.
    fn take_slot<'s>(
        &'s self,
        limit: &'s Limit,
        client: ClientId,
        max: u32,
    ) -> impl Future<Output = Result<SlotTake, Unavailable>> + Send + 's;

    /// `client`'s state under `limit` now, read and never charged: how a `count_when` limit
    /// is checked at admission.
    fn peek<'s>(
        &'s self,
        limit: &'s Limit,
        client: ClientId,
        peer: local::Peer,
        at: (Moment, Option<Moment>),
    ) -> impl Future<Output = Result<super::peek::Peeked, Unavailable>> + Send + 's;

    /// Return the tokens of a lease of `limit` that ended here to the shared bucket (nothing
    /// to do for a store that does not lease).
    fn give_back(&self, _limit: &Limit, _back: Returned) {}

    /// Count a request admitted from a lease held here, the store not asked.
    fn count_leased(&self) {}

    /// Take `tokens` more from `client`'s bucket of `limit` (give back when negative): a
    /// settled cost's difference, which may leave the bucket owing. Not awaited: what the
    /// store cannot take is lost, as a refund is.
    fn settle(&self, limit: &Limit, client: ClientId, tokens: i64, peer: local::Peer, now: Moment);
}

/// A concurrency slot taken (held until dropped) with the count in flight, or the count when
/// all are taken.
pub type SlotTake = Result<(SlotHeld, u32), u32>;

// === impl Local ===

/// This process's buckets (each limit's `local`), at each limit's own numbers (or its
/// operator's), or at its stricter fallback numbers when standing in for a failed `Shared`.
#[derive(Debug, Clone, Copy)]
pub struct Local {
    pub fallback: bool,
}

impl Store for Local {
    fn check<'s>(
        &'s self,
        asked: Asked<'s>,
    ) -> impl Future<Output = Result<Answer, Unavailable>> + Send + 's {
        std::future::ready(Ok(self.decide(asked)))
    }

    fn peek<'s>(
        &'s self,
        limit: &'s Limit,
        client: ClientId,
        peer: local::Peer,
        (now, wall): (Moment, Option<Moment>),
    ) -> impl Future<Output = Result<super::peek::Peeked, Unavailable>> + Send + 's {
        let at = (now.us(), wall.map(Moment::us));
        let peeked = super::peek::in_process_at(limit, client, peer, at, self.fallback);
        std::future::ready(Ok(peeked))
    }

    fn settle(&self, limit: &Limit, client: ClientId, tokens: i64, peer: local::Peer, now: Moment) {
        limit
            .local
            .settle(client, peer, tokens, &limit.rate, now.us());
    }

    fn take_slot<'s>(
        &'s self,
        limit: &'s Limit,
        client: ClientId,
        max: u32,
    ) -> impl Future<Output = Result<SlotTake, Unavailable>> + Send + 's {
        std::future::ready(Ok(Self::slot(limit, client, max)))
    }
}

impl Local {
    /// `take_slot` in process, at once.
    pub(super) fn slot(limit: &Limit, client: ClientId, max: u32) -> SlotTake {
        let Some(slots) = &limit.slots else {
            return Err(0);
        };
        slots
            .try_take(client, max)
            .map(|(slot, n)| (SlotHeld::Local(slot), n))
    }

    /// A banned identity is refused before any bucket is asked, then the buckets all or
    /// nothing, then strikes for the limits with a ban that rejected the request.
    pub(super) fn decide(self, asked: Asked<'_>) -> Answer {
        // Most routes have no ban: their answer is the buckets' verdicts alone.
        let bans = !self.fallback && asked.checks.iter().any(|c| c.limit.bans.is_some());
        if !bans {
            return Answer {
                verdicts: self.buckets(asked),
                ..Answer::default()
            };
        }
        let mut answer = Answer {
            bans: asked.checks.iter().map(|_| BanEvent::None).collect(),
            ..Answer::default()
        };
        if Self::banned(asked, &mut answer) {
            return answer;
        }
        answer.verdicts = self.buckets(asked);
        strikes(asked, &mut answer);
        answer
    }

    /// Whether an in-process ban holds one of the identities: that check's verdict says so,
    /// and nothing is checked. Notes the bans seen lifted.
    fn banned(asked: Asked<'_>, answer: &mut Answer) -> bool {
        for (i, c) in asked.checks.iter().enumerate() {
            let Some(bans) = &c.limit.bans else {
                continue;
            };
            let (left, event) = bans.banned(c.client, asked.now.us());
            answer.bans[i] = event;
            if let Some(left) = left {
                let refused = Verdict {
                    admitted: false,
                    remaining: 0,
                    reset_us: left,
                    retry_after_us: left,
                };
                answer.banned = Some((i, refused));
                return true;
            }
        }
        false
    }

    /// The buckets checked together, all or nothing.
    fn buckets(self, asked: Asked<'_>) -> Small<Verdict> {
        // Quotas count in calendar windows, on the wall clock (read once, and only for them).
        let wall = (asked.checks.iter())
            .any(|c| c.limit.quota.is_some())
            .then(|| asked.wall.map_or_else(super::clock::wall_us, Moment::us));
        let items: Small<local::Item<'_>> = (asked.checks.iter())
            .enumerate()
            .map(|(i, c)| {
                let tuning = (!self.fallback)
                    .then(|| asked.tuned.get(i).copied().flatten())
                    .flatten();
                local::Item {
                    buckets: &c.limit.local,
                    client: c.client,
                    peer: asked.peer,
                    rate: self.rate(c, tuning),
                    cost: Tuning::cost_of(c, asked.tuned.get(i).copied().flatten()),
                    window: c.limit.quota.as_ref().zip(wall).map(|(q, wall)| {
                        let count = match tuning.and_then(|t| t.quota) {
                            Some(n) => n,
                            None if self.fallback => q.fallback_count,
                            None => q.count,
                        };
                        window::window(q, wall, count)
                    }),
                }
            })
            .collect();
        local::check(&items, asked.enforced, asked.now.us())
    }

    fn rate<'a>(self, c: &Check<'a>, tuning: Option<&'a Tuning>) -> &'a Rate {
        match tuning {
            Some(t) => &t.rate,
            None if self.fallback => &c.limit.fallback,
            None => &c.limit.rate,
        }
    }
}

/// Count a strike for each limit with a ban that rejected the request; the one that bans
/// answers with the ban's length as its retry time.
fn strikes(asked: Asked<'_>, answer: &mut Answer) {
    for (i, c) in asked.checks.iter().enumerate() {
        let Some(bans) = &c.limit.bans else {
            continue;
        };
        let rejected = answer.verdicts.get(i).is_some_and(|v| !v.admitted);
        if !rejected || c.limit.shadow {
            continue;
        }
        let event = bans.strike(c.client, asked.now.us());
        if let BanEvent::Started(length) = event {
            answer.bans[i] = event;
            if let Some(v) = answer.verdicts.get_mut(i) {
                v.retry_after_us = length as f64;
                v.reset_us = v.reset_us.max(length as f64);
            }
        }
    }
}

// === impl Shared ===

/// The buckets in Redis, asked through worker `worker`'s connection (`None`: the shared one).
/// Bans live in the same script's keys and come back with the verdicts.
#[derive(Debug, Clone, Copy)]
pub struct Shared<'r> {
    pub redis: &'r RedisLimiter,
    pub worker: Option<usize>,
}

impl Store for Shared<'_> {
    async fn check<'s>(&'s self, asked: Asked<'s>) -> Result<Answer, Unavailable> {
        // Boxed so that the Redis call's state does not inflate every request's future.
        let call = crate::boxed(|| {
            let (checks, enforced, tuned) = (asked.checks, asked.enforced, asked.tuned);
            (self.redis).check_tuned(self.worker, checks, enforced, tuned, asked.leases)
        });
        let (verdicts, bans) = call.await?;
        Ok(Answer {
            verdicts,
            banned: None,
            bans,
        })
    }

    async fn take_slot<'s>(
        &'s self,
        limit: &'s Limit,
        client: ClientId,
        max: u32,
    ) -> Result<SlotTake, Unavailable> {
        let (Some(spec), Some(slots)) = (limit.concurrency, &limit.slots) else {
            return Ok(Err(0));
        };
        let leases = slots.leases(|| self.redis.leases(spec.lease));
        let taken = (self.redis)
            .take_lease(self.worker, leases, limit, client, max)
            .await?;
        Ok(match taken {
            Taken::Slot(lease, n) => Ok((SlotHeld::SlotLease(lease), n)),
            Taken::Full(n) => Err(n),
        })
    }

    async fn peek<'s>(
        &'s self,
        limit: &'s Limit,
        client: ClientId,
        _: local::Peer,
        _: (Moment, Option<Moment>),
    ) -> Result<super::peek::Peeked, Unavailable> {
        let peeked = self.redis.peek(limit, client).await;
        peeked.map_err(|_| Unavailable::Error)
    }

    fn give_back(&self, limit: &Limit, back: Returned) {
        self.redis.give_back(limit, back);
    }

    fn count_leased(&self) {
        self.redis.count_leased();
    }

    fn settle(&self, limit: &Limit, client: ClientId, tokens: i64, _: local::Peer, _: Moment) {
        self.redis.settle(self.worker, limit, client, tokens);
    }
}
