//! Checks whose buckets live in several Redis Cluster slots.
//!
//! A script may only touch keys of one slot, and the buckets of one request are keyed by
//! different identities (a per-client limit and a global one hash to different slots). So the
//! buckets are grouped by slot and every group is checked at once, each atomically and each
//! through the worker's batcher (shared with the other checks of its slot waiting at the same
//! moment): one round trip in all. When a group rejects, what the groups that admitted took is
//! refunded (the script's `refund` mode: `tat -= cost * tok`, never below now).
//!
//! The trade-off: over-admission stays impossible, since every bucket is only ever charged by
//! an atomic check against its own limit, and a refund only gives back what a check took. But
//! between a charge and its refund (one round trip) the admitting buckets hold one request's
//! cost too many, so a concurrent request may be rejected that would have passed: a hair of
//! under-admission, at most one cost per bucket for about a millisecond. A refund that fails
//! leaves its cost taken until refill, and so does a check whose future is dropped between its
//! answers and its refunds (its client went away). A refund is never retried: one that timed
//! out may still have run, and a second one would give back tokens that were never taken.

use futures_util::future::join_all;
use tokio::time::Instant;

use super::negative::NegativeCache;
use super::wire::{Mode, Reply};
use super::{bump, Bucket, Counters, Failure, RedisLimiter, Unavailable, Via, BUCKET_SCRIPT};
use crate::limiter::ban::BanEvent;
use crate::limiter::Clock;
use crate::limiter::{Rate, Small, Verdict};
use crate::log_gate::LogGate;

/// The Redis Cluster slot of `key`, as Redis computes it: CRC16 (XMODEM) of the key's hash tag
/// (the first `{...}` with something inside), or of the whole key without one, modulo 16384.
pub(super) fn slot_of(key: &str) -> u16 {
    let key = key.as_bytes();
    let tag = key.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&c| c == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    let crc = crc16::State::<crc16::XMODEM>::calculate(tag.unwrap_or(key));
    // 16384 slots: the low 14 bits.
    crc & 0x3fff
}

/// Indices of `buckets` grouped by cluster slot, groups in order of first appearance.
fn slot_groups(buckets: &[Bucket<'_>]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, b) in buckets.iter().enumerate() {
        let slot = b.slot;
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, members)) => members.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups.into_iter().map(|(_, members)| members).collect()
}

impl RedisLimiter {
    /// Check `buckets`, every slot group at once (see the module doc).
    pub(super) async fn ask_slots(
        &self,
        via: Via<'_>,
        buckets: &[Bucket<'_>],
        deadline: Instant,
    ) -> Result<Reply, Failure> {
        let groups = slot_groups(buckets);
        let parts: Vec<Vec<&Bucket<'_>>> = groups
            .iter()
            .map(|members| members.iter().map(|&i| &buckets[i]).collect())
            .collect();
        // `join_all` polls every group's check before awaiting any: all are queued (or sent)
        // in this turn of the event loop.
        let replies = join_all(
            parts
                .iter()
                .map(|group| self.check_group(via, group, deadline)),
        )
        .await;
        let mut charged: Vec<Vec<&Bucket<'_>>> = Vec::new();
        let (mut all_admitted, mut failure) = (true, None);
        for (group, reply) in parts.iter().zip(&replies) {
            match reply {
                // The script charged exactly the admitting buckets of this group.
                Ok(r) if r.all_admitted => charged.push(
                    group
                        .iter()
                        .zip(&r.verdicts)
                        .filter(|(_, v)| v.admitted)
                        .map(|(b, _)| *b)
                        .collect(),
                ),
                Ok(_) => all_admitted = false,
                Err(f) => {
                    failure = Some(Failure {
                        slot: group.first().map(|b| b.slot),
                        ..f.clone()
                    });
                }
            }
        }
        if failure.is_some() || !all_admitted {
            self.refund(via, charged, deadline).await;
        }
        if let Some(failure) = failure {
            return Err(failure);
        }
        let mut verdicts: Vec<Option<Verdict>> = vec![None; buckets.len()];
        let mut bans: Small<BanEvent> =
            std::iter::repeat_n(BanEvent::None, buckets.len()).collect();
        for (members, reply) in groups.iter().zip(replies.into_iter().flatten()) {
            for ((&i, v), ban) in members.iter().zip(reply.verdicts).zip(reply.bans) {
                verdicts[i] = Some(v);
                bans[i] = ban;
            }
        }
        let verdicts = verdicts.into_iter().collect::<Option<Small<_>>>();
        Ok(Reply {
            all_admitted,
            verdicts: verdicts
                .ok_or_else(|| Failure::new(Unavailable::Error, "a slot group went unanswered"))?,
            bans,
        })
    }

    /// Give back what `charged` took, one call per slot group, all at once, each attempted
    /// exactly once: inline while the check's deadline leaves time, else in the background. A
    /// refunded bucket is forgotten by the negative cache.
    async fn refund(&self, via: Via<'_>, charged: Vec<Vec<&Bucket<'_>>>, deadline: Instant) {
        let charged: Vec<_> = charged.into_iter().filter(|g| !g.is_empty()).collect();
        if deadline.saturating_duration_since(Instant::now()) < self.timeout / 4 {
            for group in &charged {
                self.refund_later(via, group);
            }
            return;
        }
        join_all(charged.iter().map(|group| async move {
            bump(&self.counters.refunds);
            let sent = self.send(via, Mode::Refund, group, deadline).await;
            refunded(
                sent.map_err(|f| f.detail),
                group.iter().map(|b| b.key.as_str()),
                &self.negative,
                &self.counters,
                &self.log_gate,
                self.clock,
            );
        }))
        .await;
    }

    /// Send a refund from a task of its own, with a deadline of its own.
    pub(super) fn refund_later(&self, via: Via<'_>, group: &[&Bucket<'_>]) {
        self.adjust_later(via, group, Mode::Refund);
    }

    /// `refund_later`, or with `Mode::Charge` the buckets charged `cost` more (a settled
    /// cost's difference), going into debt if they must.
    pub(super) fn adjust_later(&self, via: Via<'_>, group: &[&Bucket<'_>], mode: Mode) {
        type Owned = (String, u16, Rate, u32, Option<super::wire::QuotaArgs>, bool);
        let owned: Vec<Owned> = group
            .iter()
            .map(|b| {
                (
                    b.key.clone(),
                    b.slot,
                    b.rate.clone(),
                    b.cost,
                    b.quota,
                    b.debt,
                )
            })
            .collect();
        let (on, counters, timeout) = (self.link(via).now(), self.counters.clone(), self.timeout);
        let (negative, log_gate, clock) =
            (self.negative.clone(), self.log_gate.clone(), self.clock);
        bump(&counters.refunds);
        bump(&counters.redis_calls);
        tokio::spawn(async move {
            let buckets: Vec<Bucket<'_>> = owned
                .iter()
                .map(|(key, slot, rate, cost, quota, debt)| Bucket {
                    key: key.clone(),
                    slot: *slot,
                    rate,
                    cost: *cost,
                    lease: 0,
                    enforced: true,
                    quota: *quota,
                    ban: None,
                    debt: *debt,
                })
                .collect();
            let run = on.conn.run(&BUCKET_SCRIPT, mode, buckets.iter());
            let sent = match tokio::time::timeout(timeout, run).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {timeout:?}")),
            };
            let keys = buckets.iter().map(|b| b.key.as_str());
            refunded(sent, keys, &negative, &counters, &log_gate, clock);
        });
    }
}

/// After a refund of the buckets `keys` was sent: forget them in the negative cache if it went
/// through, else count and log (at most once a second) the failure.
fn refunded<'k, T>(
    sent: Result<T, String>,
    keys: impl Iterator<Item = &'k str>,
    negative: &NegativeCache,
    counters: &Counters,
    log_gate: &LogGate,
    clock: Clock,
) {
    match sent {
        Ok(_) => negative.forget(keys),
        Err(detail) => {
            bump(&counters.refund_failures);
            if let Some(held_back) = log_gate.open(clock.now().us() as u64) {
                tracing::warn!(
                    %detail,
                    similar_since_last = held_back,
                    "cluster refund failed: its tokens come back by refill only"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_grouped_by_hash_tag_in_order() {
        let rate = Rate {
            per_sec: 1.0,
            burst: 1,
        };
        let bucket = |key: &str| Bucket {
            key: key.to_owned(),
            slot: slot_of(key),
            rate: &rate,
            cost: 1,
            lease: 0,
            enforced: true,
            quota: None,
            ban: None,
            debt: false,
        };
        let buckets = [
            bucket("t:per-ip:{aa}"),
            bucket("t:global:{bb}"),
            bucket("t:per-ip-slow:{aa}"),
        ];
        assert_eq!(slot_groups(&buckets), vec![vec![0, 2], vec![1]]);
    }

    #[test]
    fn slots_are_the_ones_redis_computes() {
        // `CLUSTER KEYSLOT` of Redis 7.0 for each key.
        for (key, slot) in [
            ("foo", 12182),
            ("bar", 5061),
            ("{user1000}.following", 3443),
            ("t:per-ip:{aa}", 1180),
            ("a{}b", 13694),
            ("{}{x}", 3257),
            ("x{y", 2740),
            ("t:global:{0123456789abcdef0123456789abcdef}", 1829),
            ("", 0),
        ] {
            assert_eq!(slot_of(key), slot, "{key}");
        }
    }
}
