//! A settled cost in process: a bucket charged or refunded the difference between what a
//! request reserved and what its response said it cost, into debt if need be.

use super::{commit, slot, stored, Buckets, Item, Peer};
use crate::identity::ClientId;
use crate::limiter::Rate;

impl Buckets {
    /// Take `tokens` more from `client`'s bucket at `rate` (fewer when negative: a refund,
    /// which never takes the bucket past full), at `now`.
    pub fn settle(&self, client: ClientId, peer: Peer, tokens: i64, rate: &Rate, now: f64) {
        let item = Item {
            buckets: self,
            client,
            peer,
            rate,
            cost: 0,
            window: None,
        };
        let mut slot = slot(&item, now);
        let tat = stored(&item, &slot);
        let moved = tokens.unsigned_abs() as f64 * rate.token_us();
        let new = if tokens >= 0 {
            tat.unwrap_or(now).max(now) + moved
        } else {
            match tat {
                Some(t) if t > now => (t - moved).max(now),
                _ => return,
            }
        };
        commit(&item, &mut slot, new);
    }

    /// The identities whose buckets owe tokens at `rate` now, and the tokens they owe in all
    /// (a walk over every bucket: for the dashboard, not the request path).
    pub fn owing_now(&self, rate: &Rate, now: f64) -> (usize, u64) {
        let (tau, tok) = (rate.window_us(), rate.token_us());
        let mut out = (0, 0);
        for shard in &self.shards {
            for e in shard.lock().values() {
                let over = e.tat - now - tau;
                if over > 0.0 {
                    out.0 += 1;
                    out.1 += (over / tok).ceil() as u64;
                }
            }
        }
        out
    }
}
