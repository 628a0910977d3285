//! Costs settled from the response (`cost: { reserve, from_response }`): the reserve was taken
//! at admission; once the response head comes, the bucket is charged or refunded the
//! difference to the header's value.

use crate::limiter::store::Store;
use crate::limiter::{local, Decision, Limit, Moment};

/// Settle the costs of `decision` over `limits` (a route's) from the response `headers`:
/// each limit with `from_response` whose header holds a whole number is charged the
/// difference from what it reserved (refunded when less). A header missing or not a
/// non-negative whole number leaves the reserve charged (logged at DEBUG). A limit decided
/// without the shared store (its failure policy) is not settled. Returns the units settled,
/// by limit index, for the counters.
pub fn settle<S: Store>(
    store: &S,
    limits: &[std::sync::Arc<Limit>],
    decision: &Decision,
    headers: &http::HeaderMap,
    peer: local::Peer,
    now: Moment,
) -> Vec<(usize, u64)> {
    let mut settled = Vec::new();
    for r in &decision.results {
        let (Some(limit), Some(client)) = (limits.get(r.index), r.client) else {
            continue;
        };
        let Some(header) = &limit.settle else {
            continue;
        };
        if r.fallback || r.verdict.is_none_or(|v| !v.admitted) {
            continue;
        }
        let value = headers.get(header).and_then(|v| v.to_str().ok());
        let Some(cost) = value.and_then(|v| v.trim().parse::<u64>().ok()) else {
            tracing::debug!(limit = %limit.name, header = %header, value = ?value, "the response did not say what the request cost: the reserve is charged");
            settled.push((r.index, u64::from(limit.cost)));
            continue;
        };
        let delta = i64::try_from(cost).unwrap_or(i64::MAX) - i64::from(limit.cost);
        if delta != 0 {
            store.settle(limit, client, delta, peer, now);
        }
        settled.push((r.index, cost));
    }
    settled
}

/// A settlement waiting for the trailers: a response whose head did not say what it cost (its
/// trailers may; an end without them is settled from no headers: the reserve). Returns the
/// first limit's units, for the access log.
pub struct Deferred(pub Box<SettleFn>);

/// What a `Deferred` calls.
pub type SettleFn = dyn FnOnce(&http::HeaderMap) -> Option<u64> + Send + Sync;

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Deferred")
    }
}
