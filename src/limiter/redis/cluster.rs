//! Checks whose buckets live in several Redis Cluster slots.
//!
//! A script may only touch keys of one slot, and the buckets of one request are keyed by
//! different identities (a per-client limit and a global one hash to different slots). So the
//! slots are checked one after another, each atomically, in route order. When a later slot
//! rejects, what the earlier slots took is refunded (the script's `refund` mode: `tat -= cost *
//! tok`, never below now), and the slots after it are only peeked, for their verdicts.
//!
//! The trade-off: over-admission stays impossible, since every bucket is only ever charged by
//! an atomic check against its own limit, and a refund only gives back what a check took. But
//! between a charge and its refund (one round trip) the earlier buckets hold one request's
//! cost too many, so a concurrent request may be rejected that would have passed: a hair of
//! under-admission, at most one cost per bucket for about a millisecond. A refund that fails
//! leaves its cost taken until refill, and so does a check whose future is dropped between two
//! slots (its client went away). A refund is never retried: one that timed out may still have
//! run, and a second one would give back tokens that were never taken.

use ::redis::cluster_routing::Slot;
use tokio::time::Instant;

use super::conn::{Mode, Reply};
use super::{bump, Bucket, Failure, RedisLimiter, Unavailable, BUCKET_SCRIPT};
use crate::limiter::{Rate, Small, Verdict};

/// Indices of `buckets` grouped by cluster slot, groups in order of first appearance (so the
/// slots are asked in route order).
pub(super) fn slot_groups(buckets: &[Bucket<'_>]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(Slot, Vec<usize>)> = Vec::new();
    for (i, b) in buckets.iter().enumerate() {
        let slot = Slot::for_key(b.key.as_bytes());
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, members)) => members.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups.into_iter().map(|(_, members)| members).collect()
}

impl RedisLimiter {
    /// Check `buckets` slot group by slot group (see the module doc).
    pub(super) async fn ask_slots(
        &self,
        buckets: &[Bucket<'_>],
        groups: &[Vec<usize>],
        deadline: Instant,
    ) -> Result<Reply, Failure> {
        let mut verdicts: Vec<Option<Verdict>> = vec![None; buckets.len()];
        let mut charged: Vec<Vec<&Bucket<'_>>> = Vec::new();
        let mut rejected_at = None;
        for (g, members) in groups.iter().enumerate() {
            let group: Vec<&Bucket<'_>> = members.iter().map(|&i| &buckets[i]).collect();
            let reply = match self.call(Mode::Check, &group, deadline).await {
                Ok(reply) => reply,
                Err(failure) => {
                    self.refund(charged, deadline).await;
                    return Err(failure);
                }
            };
            for (&i, v) in members.iter().zip(&reply.verdicts) {
                verdicts[i] = Some(*v);
            }
            if !reply.all_admitted {
                rejected_at = Some(g);
                break;
            }
            // The script charged exactly the admitting buckets of this group.
            let took = group.into_iter().zip(&reply.verdicts);
            charged.push(took.filter(|(_, v)| v.admitted).map(|(b, _)| b).collect());
        }
        if let Some(g) = rejected_at {
            self.refund(charged, deadline).await;
            for members in &groups[g + 1..] {
                let group: Vec<&Bucket<'_>> = members.iter().map(|&i| &buckets[i]).collect();
                let reply = self.call(Mode::Peek, &group, deadline).await?;
                for (&i, v) in members.iter().zip(&reply.verdicts) {
                    verdicts[i] = Some(*v);
                }
            }
        }
        let verdicts = verdicts.into_iter().collect::<Option<Small<_>>>();
        Ok(Reply {
            all_admitted: rejected_at.is_none(),
            verdicts: verdicts.ok_or_else(|| Failure {
                kind: Unavailable::Error,
                detail: "a slot group went unanswered".into(),
            })?,
        })
    }

    /// Give back what `charged` took, one call per slot group, each attempted exactly once:
    /// inline while the check's deadline leaves time, else in the background.
    async fn refund(&self, charged: Vec<Vec<&Bucket<'_>>>, deadline: Instant) {
        for group in charged.into_iter().filter(|g| !g.is_empty()) {
            bump(&self.counters.refunds);
            let left = deadline.saturating_duration_since(Instant::now());
            if left < self.timeout / 4 {
                self.refund_later(&group);
            } else if let Err(failure) = self.send(Mode::Refund, &group, deadline).await {
                bump(&self.counters.refund_failures);
                if let Some(held_back) = self.log_gate.open(self.clock.now_us() as u64) {
                    tracing::warn!(
                        detail = %failure.detail,
                        similar_since_last = held_back,
                        "cluster refund failed: its tokens come back by refill only"
                    );
                }
            }
        }
    }

    /// Send a refund from a task of its own, with a deadline of its own.
    fn refund_later(&self, group: &[&Bucket<'_>]) {
        let owned: Vec<(String, Rate, u32)> = group
            .iter()
            .map(|b| (b.key.clone(), b.rate.clone(), b.cost))
            .collect();
        let (conn, counters, timeout) = (self.conn().clone(), self.counters.clone(), self.timeout);
        let (log_gate, clock) = (self.log_gate.clone(), self.clock);
        bump(&counters.redis_calls);
        tokio::spawn(async move {
            let buckets: Vec<Bucket<'_>> = owned
                .iter()
                .map(|(key, rate, cost)| Bucket {
                    key: key.clone(),
                    rate,
                    cost: *cost,
                    enforced: true,
                })
                .collect();
            let run = conn.run(&BUCKET_SCRIPT, Mode::Refund, buckets.iter());
            if !matches!(tokio::time::timeout(timeout, run).await, Ok(Ok(_))) {
                bump(&counters.refund_failures);
                if let Some(held_back) = log_gate.open(clock.now_us() as u64) {
                    tracing::warn!(
                        similar_since_last = held_back,
                        "cluster refund failed: its tokens come back by refill only"
                    );
                }
            }
        });
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
            rate: &rate,
            cost: 1,
            enforced: true,
        };
        let buckets = [
            bucket("t:per-ip:{aa}"),
            bucket("t:global:{bb}"),
            bucket("t:per-ip-slow:{aa}"),
        ];
        assert_eq!(slot_groups(&buckets), vec![vec![0, 2], vec![1]]);
    }
}
