//! The bucket script's wire format: its arguments (`bucket.lua`'s KEYS and ARGV, one
//! bucket's key and five arguments each) and the parsing of its packed reply.

use ::redis::{ScriptInvocation, Value};

use super::Bucket;
use crate::limiter::ban::BanEvent;
use crate::limiter::{Counting, Period, Small, Verdict};
use std::fmt::Write as _;

/// The atomic N-bucket check; its header documents KEYS, ARGV and the reply.
pub(super) const BUCKET_LUA: &str = include_str!("bucket.lua");

/// What the script is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Charge every admitting bucket if every enforced one admits.
    Check,
    /// Give back what a `Check` took.
    Refund,
    /// Take `cost` more from token buckets, into debt if need be (a settled cost).
    Charge,
}

impl Mode {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Mode::Check => "check",
            Mode::Refund => "refund",
            Mode::Charge => "charge",
        }
    }
}

/// The script's epoch (`EPOCH` in `bucket.lua`), in microseconds since the UNIX epoch.
pub(super) const SCRIPT_EPOCH_US: i64 = 1_700_000_000_000_000;

/// A quota bucket's script arguments: its count, and the bounds of the windows around the
/// proxy's now (see `bucket.lua`'s `window`), in microseconds since the script's epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct QuotaArgs {
    pub(super) count: u32,
    pub(super) bounds: [i64; 4],
    /// A sliding or exact window's length in µs: Redis finds its windows by its own clock.
    pub(super) slides: Option<(Counting, i64)>,
}

impl QuotaArgs {
    pub(super) fn of(q: &crate::limiter::QuotaSpec, wall_us: f64) -> Self {
        let slides = match (q.counting, q.period) {
            (Counting::Sliding | Counting::Exact, Period::Every(secs)) => {
                Some((q.counting, i64::from(secs) * 1_000_000))
            }
            _ => None,
        };
        Self {
            count: q.count,
            bounds: crate::limiter::window::around(q, wall_us).map(|b| b - SCRIPT_EPOCH_US),
            slides,
        }
    }
}

/// Each bucket's key and its five script arguments (see `bucket.lua`).
pub(super) fn push_buckets<'b, 'a: 'b>(
    call: &mut ScriptInvocation<'_>,
    buckets: impl Iterator<Item = &'b Bucket<'a>>,
) {
    for b in buckets {
        call.key(b.key.as_str());
        match &b.quota {
            Some(q) => {
                call.arg(q.count).arg(0);
            }
            None => {
                exact(call, b.rate.token_us());
                exact(call, b.rate.window_us());
            }
        }
        call.arg(b.cost).arg(u8::from(b.enforced));
        if b.quota.is_none() && b.ban.is_none() && b.lease == 0 && !b.debt {
            call.arg("-");
            continue;
        }
        let mut w = String::with_capacity(96);
        // First: the script reads it as the first letter (a settled cost's bucket has no
        // window and no lease, whose parts are read from the start too).
        if b.debt {
            w.push('d');
        }
        if b.lease > 0 {
            let _ = write!(w, "l {}", b.lease);
        }
        match b.quota.as_ref().map(|q| (q, q.slides)) {
            Some((_, Some((Counting::Exact, len)))) => {
                let _ = write!(w, "x {len}");
            }
            Some((_, Some((_, len)))) => {
                let _ = write!(w, "s {len}");
            }
            Some((q, None)) => {
                let [s0, s1, s2, s3] = q.bounds;
                let _ = write!(w, "q {s0} {s1} {s2} {s3}");
            }
            None => {}
        }
        if let Some(ban) = &b.ban {
            let sep = if w.is_empty() { "" } else { " " };
            let _ = write!(
                w,
                "{sep}b {} {} {} {}",
                ban.after, ban.within_us, ban.first_us, ban.max_us
            );
        }
        call.arg(w);
    }
}

/// `x` as a script argument that parses back to the same double, so Lua computes with exactly
/// the numbers `limiter::step` uses: a whole number (most rates give whole microseconds) in
/// plain digits, anything else by ryu (the shortest string that round-trips), which costs
/// several times more.
pub(super) fn exact(call: &mut ScriptInvocation<'_>, x: f64) {
    // Below 2^53 every whole double is exact as an integer.
    const WHOLE: f64 = 9_007_199_254_740_992.0;
    if x.fract() == 0.0 && x.abs() < WHOLE {
        // Whole and within i64 (checked above): the conversion is exact.
        #[allow(clippy::cast_possible_truncation)]
        call.arg(x as i64);
    } else {
        call.arg(x);
    }
}

/// What the script answered for a "check".
#[derive(Debug)]
pub(super) struct Reply {
    pub(super) all_admitted: bool,
    pub(super) verdicts: Small<Verdict>,
    /// What each bucket's ban did (`BanEvent::None` for a bucket without one).
    pub(super) bans: Small<BanEvent>,
}

/// Parse the script's reply for buckets whose enforcement `enforced` yields, in order;
/// `None` if it is not what the script returns.
pub(super) fn parse_reply(
    value: &Value,
    enforced: impl ExactSizeIterator<Item = bool>,
) -> Option<Reply> {
    parse_items(reply_bytes(value)?, enforced)
}

/// The packed reply of a "check" or "batch" (see `bucket.lua`).
pub(super) fn reply_bytes(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        _ => None,
    }
}

/// Bytes of one bucket's reply: four big-endian doubles.
pub(super) const BUCKET_REPLY: usize = 32;

/// Parse one check's reply (`n` buckets of `BUCKET_REPLY` bytes) for the `n` buckets whose
/// enforcement `enforced` yields. A bucket admits when its retry time is 0; the check, when
/// every enforced one does.
pub(super) fn parse_items(
    bytes: &[u8],
    enforced: impl ExactSizeIterator<Item = bool>,
) -> Option<Reply> {
    if bytes.len() != BUCKET_REPLY * enforced.len() {
        return None;
    }
    let mut all_admitted = true;
    let mut bans = Small::new();
    let verdicts = bytes
        .chunks_exact(BUCKET_REPLY)
        .zip(enforced)
        .map(|(b, enforced)| {
            let value = |i: usize| {
                let mut be = [0u8; 8];
                be.copy_from_slice(&b[8 * i..8 * i + 8]);
                f64::from_be_bytes(be)
            };
            let (remaining, reset_us, retry_after_us) = (value(0), value(1), value(2));
            if !(remaining >= 0.0 && reset_us.is_finite() && retry_after_us >= 0.0) {
                return None;
            }
            bans.push(match value(3) {
                1.0 => BanEvent::Refused,
                2.0 => BanEvent::Lifted,
                // The retry of the check that began a ban is the ban's length.
                3.0 => BanEvent::Started(retry_after_us as u64),
                _ => BanEvent::None,
            });
            let admitted = retry_after_us == 0.0;
            all_admitted &= admitted || !enforced;
            Some(Verdict {
                admitted,
                // Whole and non-negative (checked above); `as` saturates beyond u64.
                remaining: remaining as u64,
                reset_us,
                retry_after_us,
            })
        })
        .collect::<Option<Small<_>>>()?;
    Some(Reply {
        all_admitted,
        verdicts,
        bans,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(values: &[f64]) -> Value {
        Value::BulkString(values.iter().flat_map(|v| v.to_be_bytes()).collect())
    }

    #[test]
    fn parses_the_scripts_reply() {
        let reply = packed(&[4.0, 333_334.0, 0.0, 0.0, 0.0, 1_000_000.0, 250_001.0, 0.0]);
        let r = parse_reply(&reply, [true, true].into_iter()).unwrap();
        assert!(!r.all_admitted);
        assert!(r.verdicts[0].admitted && r.verdicts[0].remaining == 4);
        assert!((r.verdicts[0].reset_us - 333_334.0).abs() < 1e-9);
        assert!(!r.verdicts[1].admitted);
        assert!((r.verdicts[1].retry_after_us - 250_001.0).abs() < 1e-9);
        // A shadow bucket's rejection does not reject the check.
        assert!(
            parse_reply(&reply, [true, false].into_iter())
                .unwrap()
                .all_admitted
        );
        assert!(parse_reply(&reply, [true; 3].into_iter()).is_none());
        assert!(parse_reply(&Value::Okay, [].into_iter()).is_none());
        assert!(parse_reply(&Value::Array(vec![Value::Int(4)]), [true].into_iter()).is_none());
        assert!(parse_reply(&packed(&[-1.0, 0.0, 0.0, 0.0]), [true].into_iter()).is_none());
        assert!(parse_reply(&packed(&[f64::NAN, 0.0, 0.0, 0.0]), [true].into_iter()).is_none());
        let banned = parse_reply(&packed(&[0.0, 9e6, 9e6, 3.0]), [true].into_iter()).unwrap();
        assert_eq!(banned.bans[0], BanEvent::Started(9_000_000));
    }
}
