//! A limit's `leasing`: the most one lease holds and its hold, checked against the limit.

use std::time::Duration;

use super::Problems;
use crate::config::file;
use crate::config::settings::{LeaseSpec, Rate};

/// How long unused leased tokens stay on a replica without a new lease (`hold`'s default).
pub(super) const DEFAULT_HOLD: Duration = Duration::from_secs(1);

/// `auto`'s most tokens per lease, per token a request costs: a lease is topped up when half
/// of it is left, so a hot identity costs Redis one call per 512 requests or fewer, and the
/// half left covers a top-up's round trip of 10 ms at 50,000 requests a second.
pub(super) const AUTO_PER_COST: u32 = 1024;

/// `l.leasing` of a limit of `rate` at `cost` tokens a request, over Redis when `redis`;
/// `None` when unset or wrong.
pub(super) fn spec(
    l: &file::Limit,
    path: &str,
    rate: &Rate,
    cost: u32,
    redis: bool,
    p: &mut Problems,
) -> Option<LeaseSpec> {
    let leasing = l.leasing.as_ref()?;
    let path = format!("{path}.leasing");
    if l.rate.is_none() {
        p.add(
            &path,
            "is for `rate` limits: quotas, windows and concurrency limits count every request in Redis",
        );
        return None;
    }
    if !redis {
        p.add(
            &path,
            "leases tokens from Redis: it needs `limiter.backend: redis` (in process every check is local already)",
        );
        return None;
    }
    let (tokens, hold) = match leasing {
        file::Leasing::Word(w) if w == "auto" => (None, DEFAULT_HOLD),
        file::Leasing::Word(w) => {
            p.add(
                &path,
                format!("`{w}` is not `auto` or a map like `{{ tokens: 100, hold: 1s }}`"),
            );
            return None;
        }
        file::Leasing::Sized(s) => {
            let hold = super::duration_or(p, format!("{path}.hold"), s.hold.as_ref(), DEFAULT_HOLD);
            (s.tokens, hold)
        }
    };
    if hold < Duration::from_millis(10) || hold > Duration::from_mins(1) {
        p.add(format!("{path}.hold"), "must be between 10ms and 60s");
        return None;
    }
    let most = auto_tokens(rate, cost, hold);
    // Without `tokens`, leases are sized as `auto`'s, with the hold given.
    let auto = tokens.is_none();
    let tokens = match tokens {
        None => most,
        Some(n) if n < cost || n > rate.burst => {
            p.add(
                format!("{path}.tokens"),
                format!(
                    "must be between the limit's cost ({cost}) and its burst ({})",
                    rate.burst
                ),
            );
            return None;
        }
        Some(n) => n,
    };
    Some(LeaseSpec { tokens, auto, hold })
}

/// The most one `auto` lease holds: `AUTO_PER_COST` requests' worth, at most a quarter of the
/// burst (so that a few replicas' leases leave the rest of the fleet most of the bucket) and
/// at most what the bucket refills in one hold (so that the tokens a replica takes with it
/// when it dies are at most one hold's worth); never less than one request's cost.
fn auto_tokens(rate: &Rate, cost: u32, hold: Duration) -> u32 {
    let per_hold = (rate.per_sec * hold.as_secs_f64())
        .floor()
        .min(f64::from(u32::MAX)) as u32;
    AUTO_PER_COST
        .saturating_mul(cost)
        .min(rate.burst / 4)
        .min(per_hold)
        .max(cost)
}
