//! Calendar quotas and window limits: the window aligned to the calendar of a zone or to the
//! epoch, and the step of each way of counting (fixed, sliding, exact).
//!
//! A quota keeps the one-number state of a token bucket. In the window `[s, e)` of a quota of
//! `N`, with `tok = (e - s) / N`, a bucket's `tat` is `s + used * tok`:
//!
//! ```text
//! used    = clamp(round((tat - s) / tok), 0, N)     (a tat of an earlier window is <= s: 0)
//! admit   = used + cost <= N
//! new_tat = s + (used + cost) * tok                  (computed afresh: no error accumulates)
//! remaining = N - used - cost (admitted), N - used (rejected)
//! reset = retry = e - now                            (retry is 0 when admitted)
//! ```
//!
//! The count is rounded back from `tat`, so the float error of `s + used * tok` (far below a
//! token's `tok`, which is at least the 3.6 ms of a million an hour) never admits one more or
//! one fewer. A window starts afresh without touching the key: a `tat` from the window before
//! is at most its end, this window's start. The key can expire at `e`.

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

use super::Verdict;
use crate::config::settings::{Counting, Period, QuotaSpec};

/// Microseconds in an hour.
const HOUR_US: i64 = 3_600_000_000;

/// One quota's window at one instant: wall-clock microseconds since the UNIX epoch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub start: f64,
    pub end: f64,
    /// The instant the window was taken at.
    pub now: f64,
    /// Requests (of cost 1) the window holds.
    pub count: u32,
    pub counting: Counting,
}

impl Window {
    /// A `tat` at or below this counts nothing now: this window's start, or for a sliding
    /// window the last one's (its count still weighs).
    pub fn floor(&self) -> f64 {
        match self.counting {
            Counting::Sliding => self.start - (self.end - self.start),
            Counting::Fixed | Counting::Exact => self.start,
        }
    }

    /// The window's length in microseconds.
    pub fn len(&self) -> f64 {
        self.end - self.start
    }
}

/// The window of `q` holding the wall-clock instant `wall_us`, counting `count`.
pub fn window(q: &QuotaSpec, wall_us: f64, count: u32) -> Window {
    let (start, end) = bounds(q.period, &q.tz, wall_us as i64);
    Window {
        start: start as f64,
        end: end as f64,
        now: wall_us,
        count,
        counting: q.counting,
    }
}

/// Whether the window holding `wall_us` is an odd one since the epoch: a sliding window's
/// two counters are kept under two keys, this window's and the last one's.
pub fn odd(w: &Window) -> bool {
    (w.start / w.len()).round() as i64 % 2 != 0
}

/// The start of the window before the one holding `wall_us`, that window's start and end, and
/// the end of the one after: Redis picks, by its own clock, which of the three to count in.
pub fn around(q: &QuotaSpec, wall_us: f64) -> [i64; 4] {
    let (s1, s2) = bounds(q.period, &q.tz, wall_us as i64);
    let (s0, _) = bounds(q.period, &q.tz, s1 - 1);
    let (_, s3) = bounds(q.period, &q.tz, s2);
    [s0, s1, s2, s3]
}

/// `[start, end)` of the `period` holding `us` (µs since the UNIX epoch) on `tz`'s calendar.
/// An hour is the local clock's hour; days, weeks (from Monday) and months start at local
/// midnight (or the first instant after it, where a DST gap skips midnight).
fn bounds(period: Period, tz: &TimeZone, us: i64) -> (i64, i64) {
    if let Period::Every(secs) = period {
        let len = i64::from(secs) * 1_000_000;
        let start = us - us.rem_euclid(len);
        return (start, start + len);
    }
    let ts = Timestamp::from_microsecond(us).unwrap_or(Timestamp::UNIX_EPOCH);
    if period == Period::Hour {
        let offset = i64::from(tz.to_offset(ts).seconds()) * 1_000_000;
        let start = us - (us + offset).rem_euclid(HOUR_US);
        return (start, start + HOUR_US);
    }
    let date = ts.to_zoned_datetime(tz.clone()).date();
    let (first, next) = match period {
        Period::Day => (date, date.checked_add(1.day())),
        Period::Week => {
            let first = date
                .checked_sub(i64::from(date.weekday().to_monday_zero_offset()).days())
                .unwrap_or(date);
            (first, first.checked_add(7.days()))
        }
        // Fixed windows returned above; an hour is not a calendar date either.
        Period::Hour | Period::Month | Period::Every(_) => {
            let first = date.first_of_month();
            (first, first.checked_add(1.month()))
        }
    };
    let next = next.unwrap_or(date);
    let start = midnight(first, tz).unwrap_or(us);
    let end = midnight(next, tz).unwrap_or(start + 24 * HOUR_US);
    (start, end.max(start + 1))
}

/// The first instant of `date` on `tz`'s calendar, in µs since the UNIX epoch.
fn midnight(date: Date, tz: &TimeZone) -> Option<i64> {
    let day = date
        .to_zoned_datetime(tz.clone())
        .ok()?
        .start_of_day()
        .ok()?;
    Some(day.timestamp().as_microsecond())
}

/// Apply a quota's step to one bucket at `w.now` (see the module doc). Returns the verdict and
/// the `tat` to store when admitted.
pub fn step(tat: Option<f64>, w: &Window, cost: u32) -> (Verdict, f64) {
    let n = f64::from(w.count);
    let tok = (w.end - w.start) / n;
    let used = used(tat, w.start, tok, n);
    let next = used + f64::from(cost);
    let reset = (w.end - w.now).max(1.0);
    if next <= n {
        let verdict = Verdict {
            admitted: true,
            remaining: (n - next) as u64,
            reset_us: reset,
            retry_after_us: 0.0,
        };
        (verdict, w.start + next * tok)
    } else {
        let verdict = Verdict {
            admitted: false,
            remaining: (n - used) as u64,
            reset_us: reset,
            retry_after_us: reset,
        };
        (verdict, w.start + used * tok)
    }
}

/// The count a `tat` holds in the window starting at `start` (see the module doc).
fn used(tat: Option<f64>, start: f64, tok: f64, n: f64) -> f64 {
    tat.map_or(0.0, |t| ((t - start) / tok).round().clamp(0.0, n))
}

/// The sliding window counter at `w.now`, from this window's `tat` and the last one's
/// (`prev`): the estimate `used + prev_used * (1 - elapsed)` plus `cost` must stay within N.
/// Returns the verdict and this window's `tat` to store when admitted. The estimate only
/// falls while nothing is admitted, so the retry time is when it first leaves room for `cost`:
/// later in this window, or in the next (where this window's count is the last one's).
pub fn slide(tat: Option<f64>, prev: Option<f64>, w: &Window, cost: u32) -> (Verdict, f64) {
    let (n, c, len) = (f64::from(w.count), f64::from(cost), w.len());
    let tok = len / n;
    let cur = used(tat, w.start, tok, n);
    let last = used(prev, w.start - len, tok, n);
    let left = 1.0 - (w.now - w.start) / len;
    let estimate = cur + last * left;
    // Full again once both counts (this window's with `held` in it) have slid out.
    let reset = |held: f64| {
        if held > 0.0 {
            w.end + len - w.now
        } else if last > 0.0 {
            w.end - w.now
        } else {
            1.0
        }
    };
    if estimate + c <= n + 1e-9 {
        let verdict = Verdict {
            admitted: true,
            remaining: (n - estimate - c + 1e-9).floor().max(0.0) as u64,
            reset_us: reset(cur + c).max(1.0),
            retry_after_us: 0.0,
        };
        return (verdict, w.start + (cur + c) * tok);
    }
    let at = if cur + c <= n {
        // Later in this window: last * (1 - f) <= n - cur - c.
        w.start + (1.0 - (n - cur - c) / last) * len
    } else if c <= n {
        // In the next one, where this window's count slides out: cur * (1 - f) <= n - c.
        w.end + (1.0 - (n - c) / cur).max(0.0) * len
    } else {
        // More than the window holds: never; say a full window.
        w.end + len
    };
    let verdict = Verdict {
        admitted: false,
        remaining: (n - estimate + 1e-9).floor().max(0.0) as u64,
        reset_us: reset(cur).max(1.0),
        retry_after_us: (at - w.now).ceil().max(1.0),
    };
    (verdict, w.start + cur * tok)
}

/// The sliding window log at `w.now`: the times of the requests counted in the last window,
/// oldest first (`log`, pruned here of those that left it). Admits when fewer than N minus
/// `cost` are left; the caller appends `cost` times `w.now` when everything admits.
pub fn exact(log: &mut std::collections::VecDeque<f64>, w: &Window, cost: u32) -> Verdict {
    let len = w.len();
    while log.front().is_some_and(|t| *t <= w.now - len) {
        log.pop_front();
    }
    // Times after now: the clock stepped back. Counted as now, so they leave within one
    // window (`bucket.lua` does the same).
    if log.back().is_some_and(|t| *t > w.now) {
        for t in log.iter_mut().filter(|t| **t > w.now) {
            *t = w.now;
        }
    }
    let (n, c, held) = (w.count as usize, cost as usize, log.len());
    // Nothing counted once the newest entry (this request's, if it takes any) leaves.
    let empty_in = |newest: Option<f64>| newest.map_or(1.0, |t| t + len - w.now).max(1.0);
    if held + c <= n {
        return Verdict {
            admitted: true,
            remaining: (n - held - c) as u64,
            reset_us: empty_in(if c > 0 {
                Some(w.now)
            } else {
                log.back().copied()
            }),
            retry_after_us: 0.0,
        };
    }
    // The oldest `held + c - n` times must leave the window first.
    let retry = match (held + c).checked_sub(n + 1).and_then(|k| log.get(k)) {
        Some(t) if c <= n => t + len - w.now,
        _ => len,
    };
    Verdict {
        admitted: false,
        remaining: n.saturating_sub(held) as u64,
        reset_us: empty_in(log.back().copied()),
        retry_after_us: retry.ceil().max(1.0),
    }
}

#[cfg(test)]
mod tests;
