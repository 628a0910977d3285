//! A request's checks as the bucket script's buckets: their keys, slots, numbers and lease
//! asks; and a lease's unused tokens handed back.

use super::{cluster, Bucket, RedisLimiter};
use crate::identity::ClientId;
use crate::limiter::{Check, Limit, Rate, Small};

impl RedisLimiter {
    /// The Redis key of `client`'s bucket of `limit`.
    pub fn key(&self, limit: &Limit, client: ClientId) -> String {
        let mut key = String::with_capacity(self.key_prefix.len() + limit.name.len() + 35);
        key.push_str(&self.key_prefix);
        key.push_str(&limit.name);
        key.push_str(":{");
        client.push_hex(&mut key);
        key.push('}');
        key
    }

    /// Charge `client`'s bucket of `limit` `tokens` more (refund it when negative): a settled
    /// cost's difference, in worker `worker`'s next batch, else from a task of its own on the
    /// shared connection. Nobody waits for it.
    pub fn settle(
        &self,
        worker: Option<usize>,
        limit: &crate::limiter::Limit,
        client: ClientId,
        tokens: i64,
    ) {
        let key = self.key(limit, client);
        let bucket = Bucket {
            slot: if self.cluster {
                cluster::slot_of(&key)
            } else {
                0
            },
            key,
            rate: &limit.rate,
            cost: u32::try_from(tokens.unsigned_abs()).unwrap_or(u32::MAX),
            lease: 0,
            enforced: true,
            quota: None,
            ban: None,
            debt: true,
        };
        let mode = if tokens >= 0 {
            super::wire::Mode::Charge
        } else {
            super::wire::Mode::Refund
        };
        let deadline = tokio::time::Instant::now() + self.timeout;
        let batched =
            (self.worker(worker)).is_some_and(|w| w.batcher.settle(&bucket, mode, deadline));
        if !batched {
            self.adjust_later(None, &[&bucket], mode);
        }
    }

    /// Give a lease's unused tokens (`back`) of `limit`'s bucket back, counted at the rate they
    /// were leased at, from a task of its own on the shared connection.
    pub fn give_back(
        &self,
        limit: &crate::limiter::Limit,
        back: crate::limiter::leasing::Returned,
    ) {
        let (client, tokens) = (back.client, back.tokens);
        let rate = &Rate {
            per_sec: back.per_sec,
            burst: limit.rate.burst,
        };
        let key = self.key(limit, client);
        let bucket = Bucket {
            slot: if self.cluster {
                cluster::slot_of(&key)
            } else {
                0
            },
            key,
            rate,
            cost: tokens,
            lease: 0,
            enforced: true,
            quota: None,
            ban: None,
            debt: false,
        };
        self.counters
            .lease_tokens_returned
            .fetch_add(u64::from(tokens), std::sync::atomic::Ordering::Relaxed);
        self.refund_later(None, &[&bucket]);
    }

    pub(super) fn buckets<'a>(
        &self,
        checks: &[Check<'a>],
        enforced: &[bool],
        tuned: &[Option<&'a crate::limiter::Tuning>],
        asks: &[crate::limiter::leasing::Ask],
    ) -> Small<Bucket<'a>> {
        // Quotas' windows come from the wall clock (read once, and only for them).
        let wall = checks
            .iter()
            .any(|c| c.limit.quota.is_some())
            .then(crate::limiter::clock::wall_us);
        checks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let tuning = tuned.get(i).copied().flatten();
                let ask = asks.get(i).copied().unwrap_or_default();
                let key = self.key(c.limit, c.client);
                let slot = if self.cluster {
                    cluster::slot_of(&key)
                } else {
                    0
                };
                Bucket {
                    key,
                    slot,
                    // A tuned quota's rate differs from the limit's too, so the negative
                    // cache does not answer it from what it learnt under the other count.
                    rate: tuning.map_or(&c.limit.rate, |t| &t.rate),
                    cost: if ask.top_up {
                        0
                    } else {
                        crate::limiter::Tuning::cost_of(c, tuning)
                    },
                    lease: ask.tokens,
                    enforced: enforced.get(i).copied().unwrap_or(true),
                    quota: c.limit.quota.as_ref().zip(wall).map(|(q, wall)| {
                        let mut args = super::wire::QuotaArgs::of(q, wall);
                        if let Some(count) = tuning.and_then(|t| t.quota) {
                            args.count = count;
                        }
                        args
                    }),
                    ban: c.limit.ban,
                    debt: c.limit.settle.is_some(),
                }
            })
            .collect()
    }
}
