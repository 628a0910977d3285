//! A limit's `concurrency` and `lease` keys: the alternative to `rate` and `burst`.

use std::time::Duration;

use super::{duration_or, values, Problems};
use crate::config::file;
use crate::config::settings::ConcurrencySpec;

/// How long a Redis lease lives unless its replica renews it.
pub(super) const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The limit's concurrency settings: `None` for a token bucket, `Some(None)` for a concurrency
/// limit with problems (recorded in `p`). A limit with none of `rate`, `quota` and
/// `concurrency` is `quota::shape`'s problem.
// Three cases, as `limit` reads them: a token bucket, a concurrency limit, a broken one.
#[allow(clippy::option_option)]
pub(super) fn spec(
    l: &file::Limit,
    path: &str,
    divide_by: u32,
    p: &mut Problems,
) -> Option<Option<ConcurrencySpec>> {
    let Some(max) = l.concurrency else {
        if l.lease.is_some() {
            p.add(format!("{path}.lease"), "is for `concurrency` limits only");
        }
        return None;
    };
    let mut ok = true;
    if l.rate.is_some() {
        p.add(
            path,
            "has both `rate` and `concurrency`: a limit counts requests per time or in flight, not both (use two limits)",
        );
        ok = false;
    }
    for (key, set) in [("burst", l.burst.is_some()), ("cost", l.cost.is_some())] {
        if set {
            p.add(
                format!("{path}.{key}"),
                "is for `rate` limits: a concurrency limit counts each request in flight once",
            );
            ok = false;
        }
    }
    if max == 0 {
        p.add(format!("{path}.concurrency"), "must be at least 1");
        ok = false;
    }
    let lease = duration_or(p, format!("{path}.lease"), l.lease.as_ref(), DEFAULT_LEASE);
    if lease < Duration::from_millis(100) {
        p.add(
            format!("{path}.lease"),
            "must be at least 100ms (it is renewed every third of it)",
        );
        ok = false;
    }
    Some(ok.then(|| ConcurrencySpec {
        max,
        fallback: (max / divide_by.max(1)).max(1),
        lease,
    }))
}

/// The `rate` a concurrency limit reports in headers: `max` a second.
pub(super) fn as_rate(c: ConcurrencySpec) -> values::RateValue {
    values::RateValue {
        count: f64::from(c.max),
        per: Duration::from_secs(1),
    }
}
