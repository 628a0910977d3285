//! The token-bucket arithmetic: one bucket's step, as GCRA.
//!
//! Both backends run the same arithmetic, written as GCRA on a single number per bucket: the
//! *theoretical arrival time* (`tat`, microseconds as `f64`), the instant at which the bucket
//! would be full again. With `tok` = microseconds per token and `tau` = `burst * tok`:
//!
//! ```text
//! tat     = min(tat, now + tau)            (only after a clock step back: see `step`)
//! base    = max(tat, now)                  (a bucket never holds more than `burst`)
//! new_tat = base + cost * tok
//! admit   = new_tat - now <= tau           (enough tokens for `cost`)
//! tokens left after the request = (tau - (tat' - now)) / tok
//! ```
//!
//! This is exactly a token bucket with continuous refill (rate = 1/tok, capacity = burst), but
//! its state is one number, so Redis stores one string per bucket and can expire the key at
//! `tat`, the moment the bucket is full again and forgetting it grants nothing.

use crate::config::settings::Rate;

/// What one bucket says about one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    /// The bucket holds at least `cost` tokens.
    pub admitted: bool,
    /// Whole tokens left once this request is counted (if it is admitted and everything else
    /// admits it too), or left now if it is not.
    pub remaining: u64,
    /// Microseconds until the bucket is full again.
    pub reset_us: f64,
    /// Microseconds until `cost` tokens are available; 0 when admitted.
    pub retry_after_us: f64,
}

/// How far (µs) past `now + tau` a `tat` must be before `step` takes it for a clock step: the
/// float slack of a `tat` the arithmetic itself wrote (`bucket.lua` uses the same number).
pub(crate) const CLAMP_SLACK_US: f64 = 1.0;

/// Apply the GCRA step to one bucket. Returns the verdict and the new `tat` to store when the
/// request is admitted (the caller commits it only if every limit admits).
///
/// A `tat` more than `tau` ahead of `now` is clamped to `now + tau`, an empty bucket: no
/// admission ever leaves one there, so it means the clock that `now` is read from stepped back
/// (Redis's wall clock; this process's clock is monotonic), and taken as is it would withhold
/// tokens for as long as the step. Clamped, a rejection waits at most `cost` tokens' time, and
/// the bucket is full again within `tau`. Forward steps need nothing: `max(tat, now)` is a full
/// bucket, `burst` tokens and no more.
/// A `tat` further ahead than `rate` ever writes (an operator's override raised the limit of
/// a client the old rate had emptied, or the clock stepped back) is clamped to a bucket with
/// one token left: the raised limit admits the next request at once, rather than refusing it
/// for the one token's time with a `Retry-After: 1`. `bucket.lua` clamps alike.
pub fn clamped(now: f64, rate: &Rate) -> f64 {
    now + (rate.window_us() - rate.token_us()).max(0.0)
}

pub fn step(tat: Option<f64>, now: f64, rate: &Rate, cost: u32) -> (Verdict, f64) {
    step_from(tat, now, rate, cost, true)
}

/// `step` for a bucket that may owe tokens (a settled cost): a `tat` past a full window is a
/// debt to wait out, not clamped.
pub fn step_owing(tat: Option<f64>, now: f64, rate: &Rate, cost: u32) -> (Verdict, f64) {
    step_from(tat, now, rate, cost, false)
}

fn step_from(tat: Option<f64>, now: f64, rate: &Rate, cost: u32, clamp: bool) -> (Verdict, f64) {
    let tok = rate.token_us();
    let tau = rate.window_us();
    let base = tat.map_or(now, |t| {
        if clamp && t - now > tau + CLAMP_SLACK_US {
            clamped(now, rate)
        } else {
            t.max(now)
        }
    });
    let new_tat = base + f64::from(cost) * tok;
    if new_tat - now <= tau + 1e-6 {
        let remaining = whole_tokens(tau - (new_tat - now), tok);
        let verdict = Verdict {
            admitted: true,
            remaining,
            reset_us: new_tat - now,
            retry_after_us: 0.0,
        };
        (verdict, new_tat)
    } else {
        let verdict = Verdict {
            admitted: false,
            remaining: whole_tokens(tau - (base - now), tok),
            reset_us: base - now,
            retry_after_us: new_tat - now - tau,
        };
        (verdict, base)
    }
}

/// `floor(us / tok)`, tolerant of the float error of a value that is a whole number of tokens.
fn whole_tokens(us: f64, tok: f64) -> u64 {
    let n = (us / tok + 1e-9).floor();
    if n > 0.0 {
        n as u64
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(per_sec: f64, burst: u32) -> Rate {
        Rate { per_sec, burst }
    }

    #[test]
    fn burst_then_reject_then_refill() {
        let r = rate(1.0, 3);
        let mut tat = None;
        for left in [2, 1, 0] {
            let (v, t) = step(tat, 0.0, &r, 1);
            assert!(v.admitted);
            assert_eq!(v.remaining, left);
            tat = Some(t);
        }
        let (v, _) = step(tat, 0.0, &r, 1);
        assert!(!v.admitted);
        assert!((v.retry_after_us - 1e6).abs() < 1e-3);
        assert!((v.reset_us - 3e6).abs() < 1e-3);
        // Half a second later still nothing; one second later exactly one token.
        assert!(!step(tat, 0.5e6, &r, 1).0.admitted);
        let (v, _) = step(tat, 1e6, &r, 1);
        assert!(v.admitted);
        assert_eq!(v.remaining, 0);
    }

    #[test]
    fn a_long_idle_bucket_holds_no_more_than_burst() {
        let r = rate(10.0, 5);
        let (_, t) = step(None, 0.0, &r, 1);
        let (v, _) = step(Some(t), 3_600e6, &r, 1);
        assert_eq!(v.remaining, 4);
    }

    #[test]
    fn cost_takes_several_tokens() {
        let r = rate(1.0, 10);
        let (v, t) = step(None, 0.0, &r, 4);
        assert_eq!(v.remaining, 6);
        let (v, t) = step(Some(t), 0.0, &r, 4);
        assert_eq!(v.remaining, 2);
        let (v, _) = step(Some(t), 0.0, &r, 4);
        assert!(!v.admitted);
        assert_eq!(v.remaining, 2);
        assert!((v.retry_after_us - 2e6).abs() < 1e-3);
    }

    #[test]
    fn a_tat_left_ahead_by_a_clock_step_back_withholds_one_period_at_most() {
        // 1/s, burst 3: tau = 3 s. A bucket emptied on a clock an hour ahead, read on the
        // corrected clock: its `tat` is 3603 s ahead of `now`.
        let r = rate(1.0, 3);
        let now = 10e6;
        // Clamped to one token left: that one is taken, the bucket empty.
        let (v, kept) = step(Some(now + 3_603e6), now, &r, 1);
        assert!(v.admitted, "{v:?}");
        assert!((v.reset_us - 3e6).abs() < 1e-3, "full within tau: {v:?}");
        assert!((kept - (now + 3e6)).abs() < 1e-3);
        // From there, refill runs as usual: a token a second later.
        assert!(!step(Some(kept), now, &r, 1).0.admitted);
        assert!(step(Some(kept), now + 1e6, &r, 1).0.admitted);
        // Cost never waits longer than the period either: cost 3 of burst 3 waits 2 s.
        let (v, _) = step(Some(now + 3_603e6), now, &r, 3);
        assert!((v.retry_after_us - 2e6).abs() < 1e-3, "{v:?}");
        // A `tat` the arithmetic wrote itself (at most tau ahead) is not touched.
        let (v, t) = step(Some(now + 2e6), now, &r, 1);
        assert!(v.admitted && (t - (now + 3e6)).abs() < 1e-3);
    }

    #[test]
    fn a_clock_step_forward_mints_one_bucket() {
        let r = rate(1.0, 3);
        let (_, mut tat) = step(None, 0.0, &r, 3);
        // An hour later on a clock that jumped: exactly `burst` admissions, then a rejection.
        let now = 3_600e6;
        for left in [2, 1, 0] {
            let (v, t) = step(Some(tat), now, &r, 1);
            assert!(v.admitted);
            assert_eq!(v.remaining, left);
            tat = t;
        }
        assert!(!step(Some(tat), now, &r, 1).0.admitted);
    }

    #[test]
    fn fractional_rates() {
        // 5/min: one token every 12 s.
        let r = rate(5.0 / 60.0, 5);
        let mut tat = None;
        for _ in 0..5 {
            let (v, t) = step(tat, 0.0, &r, 1);
            assert!(v.admitted);
            tat = Some(t);
        }
        let (v, _) = step(tat, 0.0, &r, 1);
        assert!((v.retry_after_us - 12e6).abs() < 1.0);
    }
}
