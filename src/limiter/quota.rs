//! Calendar quotas: the window aligned to the calendar of a zone, and the quota's step.
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
use crate::config::settings::{Period, QuotaSpec};

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
}

/// The window of `q` holding the wall-clock instant `wall_us`, counting `count`.
pub fn window(q: &QuotaSpec, wall_us: f64, count: u32) -> Window {
    let (start, end) = bounds(q.period, &q.tz, wall_us as i64);
    Window {
        start: start as f64,
        end: end as f64,
        now: wall_us,
        count,
    }
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
        Period::Hour | Period::Month => {
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
    let used = tat.map_or(0.0, |t| ((t - w.start) / tok).round().clamp(0.0, n));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(count: u32, period: Period, tz: &str) -> QuotaSpec {
        QuotaSpec {
            count,
            period,
            tz: TimeZone::get(tz).unwrap(),
            fallback_count: count,
        }
    }

    fn us(s: &str) -> i64 {
        s.parse::<Timestamp>().unwrap().as_microsecond()
    }

    #[test]
    fn windows_follow_the_calendar() {
        let at = us("2026-03-04T15:30:00Z") as f64; // a Wednesday
        let utc = |p| bounds(p, &TimeZone::UTC, at as i64);
        assert_eq!(
            utc(Period::Hour),
            (us("2026-03-04T15:00:00Z"), us("2026-03-04T16:00:00Z"))
        );
        assert_eq!(
            utc(Period::Day),
            (us("2026-03-04T00:00:00Z"), us("2026-03-05T00:00:00Z"))
        );
        assert_eq!(
            utc(Period::Week),
            (us("2026-03-02T00:00:00Z"), us("2026-03-09T00:00:00Z"))
        );
        assert_eq!(
            utc(Period::Month),
            (us("2026-03-01T00:00:00Z"), us("2026-04-01T00:00:00Z"))
        );
        // Tokyo is 9 hours ahead: its day began at 15:00 UTC.
        let tokyo = quota(1, Period::Day, "Asia/Tokyo");
        let w = window(&tokyo, at, 1);
        assert_eq!(w.start as i64, us("2026-03-04T15:00:00Z"));
        assert_eq!(w.end as i64, us("2026-03-05T15:00:00Z"));
        // India's hours start at half past, UTC.
        let kolkata = TimeZone::get("Asia/Kolkata").unwrap();
        let (s, _) = bounds(Period::Hour, &kolkata, us("2026-03-04T15:20:00Z"));
        assert_eq!(s, us("2026-03-04T14:30:00Z"));
    }

    #[test]
    fn a_dst_day_is_23_or_25_hours() {
        let paris = TimeZone::get("Europe/Paris").unwrap();
        let (s, e) = bounds(Period::Day, &paris, us("2026-03-29T12:00:00Z"));
        assert_eq!(e - s, 23 * HOUR_US);
        let (s, e) = bounds(Period::Day, &paris, us("2026-10-25T12:00:00Z"));
        assert_eq!(e - s, 25 * HOUR_US);
        assert_eq!(s, us("2026-10-24T22:00:00Z"));
    }

    #[test]
    fn around_gives_the_neighbours() {
        let q = quota(1, Period::Month, "UTC");
        let [s0, s1, s2, s3] = around(&q, us("2026-02-10T00:00:00Z") as f64);
        assert_eq!(s0, us("2026-01-01T00:00:00Z"));
        assert_eq!(s1, us("2026-02-01T00:00:00Z"));
        assert_eq!(s2, us("2026-03-01T00:00:00Z"));
        assert_eq!(s3, us("2026-04-01T00:00:00Z"));
    }

    #[test]
    fn exactly_n_per_window_then_afresh() {
        for (n, period) in [
            (7, Period::Day),
            (1_000_000, Period::Hour),
            (3, Period::Month),
        ] {
            let q = quota(n, period, "UTC");
            let at = us("2026-01-31T23:59:59Z") as f64;
            let w = window(&q, at, n);
            let mut tat = None;
            for left in (0..n).rev() {
                let (v, t) = step(tat, &w, 1);
                assert!(v.admitted, "{n}/{period:?}");
                assert_eq!(v.remaining, u64::from(left));
                tat = Some(t);
            }
            let (v, _) = step(tat, &w, 1);
            assert!(!v.admitted);
            assert!((v.retry_after_us - (w.end - at)).abs() < 1e-6);
            // The next window, same tat: a full quota.
            let next = window(&q, w.end, n);
            let (v, _) = step(tat, &next, 1);
            assert!(v.admitted);
            assert_eq!(v.remaining, u64::from(n - 1));
        }
    }

    #[test]
    fn cost_counts_and_a_rejection_keeps_what_is_left() {
        let q = quota(10, Period::Day, "UTC");
        let w = window(&q, us("2026-05-05T10:00:00Z") as f64, 10);
        let (v, t) = step(None, &w, 4);
        assert_eq!(v.remaining, 6);
        let (v, t) = step(Some(t), &w, 4);
        assert_eq!(v.remaining, 2);
        let (v, kept) = step(Some(t), &w, 4);
        assert!(!v.admitted);
        assert_eq!(v.remaining, 2);
        assert!((kept - t).abs() < 1e-6);
    }
}
