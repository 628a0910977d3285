//! A limit's `quota` and `timezone` (the count, the calendar period and the zone), its
//! `window` and `algorithm`, and its `ban`.

use std::time::Duration;

use super::Problems;
use crate::config::file;
use crate::config::settings::{BanSpec, Counting, Period, QuotaSpec, EXACT_MAX};
use crate::config::values::{self, RateValue};

/// What kind of limit `l` is: its rate and burst (for a quota, its count over the period's
/// nominal length) and its quota, each `None` where it is wrong (the problems are added).
pub(super) fn shape(
    l: &file::Limit,
    path: &str,
    divide_by: u32,
    p: &mut Problems,
) -> (Option<RateValue>, Option<u32>, Option<QuotaSpec>) {
    let quota = quota(l, path, divide_by, p);
    let rate = match (&l.rate, &quota) {
        (Some(r), Ok(None)) => p.take(format!("{path}.rate"), values::rate(r)),
        (None, Ok(Some(q))) => Some(as_rate(q)),
        (Some(_), Ok(Some(_)) | Err(())) => {
            let other = if l.window.is_some() {
                "window"
            } else {
                "quota"
            };
            p.add(
                path,
                format!("has both `rate` and `{other}`: a limit is a token bucket, a calendar quota or a window"),
            );
            None
        }
        (None, Err(())) => None,
        (None, Ok(None)) => {
            p.add(
                path,
                "needs `rate` (a token bucket, as `10/s`), `quota` (a calendar quota, as `1000/day`) or `concurrency` (requests in flight, as `4`)",
            );
            None
        }
    };
    let quota = quota.ok().flatten();
    let burst = match (l.burst, rate, &quota) {
        (Some(_), _, Some(_)) => {
            let what = if l.window.is_some() {
                "a window's"
            } else {
                "a quota's"
            };
            p.add(
                format!("{path}.burst"),
                format!("is for token buckets: {what} burst is its count"),
            );
            None
        }
        (Some(0), _, None) => {
            p.add(format!("{path}.burst"), "must be at least 1");
            None
        }
        (Some(b), _, None) => Some(b),
        (None, Some(r), _) => Some(r.count.ceil().clamp(1.0, f64::from(u32::MAX)) as u32),
        (None, None, _) => None,
    };
    (rate, burst, quota)
}

/// The quota of `l`: `Ok(None)` without `quota:`, `Err` when it is wrong (the problem is
/// added), else the quota (its fallback count divided by `divide_by`).
fn quota(
    l: &file::Limit,
    path: &str,
    divide_by: u32,
    p: &mut Problems,
) -> Result<Option<QuotaSpec>, ()> {
    if let Some(w) = &l.window {
        return window(l, w, path, divide_by, p).map(Some).ok_or(());
    }
    if l.algorithm.is_some() {
        p.add(
            format!("{path}.algorithm"),
            "is for `window` limits (a token bucket has no algorithm to choose)",
        );
    }
    let Some(raw) = &l.quota else {
        if l.timezone.is_some() {
            p.add(
                format!("{path}.timezone"),
                "is for calendar quotas: set `quota` as well, or remove it",
            );
        }
        return Ok(None);
    };
    let parsed = p.take(
        format!("{path}.quota"),
        parse(raw).and_then(|(count, period)| match period {
            Period::Every(_) => Err(format!(
                "quota `{raw}`: a calendar quota counts per hour, day, week or month; for a window of a duration write `window: {raw}`"
            )),
            _ => Ok((count, period)),
        }),
    );
    let tz = match l.timezone.as_deref() {
        None => Some(jiff::tz::TimeZone::UTC),
        Some(name) => p.take(
            format!("{path}.timezone"),
            jiff::tz::TimeZone::get(name).map_err(|_| {
                format!("`{name}` is not an IANA time zone name (as `UTC` or `Europe/Paris`)")
            }),
        ),
    };
    let (Some((count, period)), Some(tz)) = (parsed, tz) else {
        return Err(());
    };
    Ok(Some(QuotaSpec {
        count,
        period,
        tz,
        fallback_count: (count / divide_by.max(1)).max(1),
        counting: Counting::Fixed,
    }))
}

/// The shortest and longest `window`.
const WINDOW_RANGE: (u64, u64) = (1, 366 * 86_400);

/// A `window: N/DURATION` limit, counted like a quota over epoch-aligned windows.
fn window(
    l: &file::Limit,
    raw: &str,
    path: &str,
    divide_by: u32,
    p: &mut Problems,
) -> Option<QuotaSpec> {
    if l.quota.is_some() {
        p.add(
            path,
            "has both `quota` and `window`: a limit counts one way",
        );
    }
    if l.timezone.is_some() {
        p.add(
            format!("{path}.timezone"),
            "is for calendar quotas: windows are aligned to the UNIX epoch (for a day from local midnight, write `quota: N/day` with `timezone`)",
        );
    }
    let counting = match l.algorithm.as_deref() {
        None | Some("sliding") => Some(Counting::Sliding),
        Some("exact") => Some(Counting::Exact),
        Some("fixed") => Some(Counting::Fixed),
        Some(other) => {
            p.add(
                format!("{path}.algorithm"),
                format!("`{other}` is not a window algorithm (sliding, exact or fixed)"),
            );
            None
        }
    };
    let (count, secs) = p.take(format!("{path}.window"), parse_window(raw))?;
    let counting = counting?;
    if counting == Counting::Exact && count > EXACT_MAX {
        p.add(
            format!("{path}.algorithm"),
            format!(
                "`exact` keeps the time of every request in the window, at most {EXACT_MAX} per identity; \
                 {count} is more: write `algorithm: sliding` (two counters, a small documented error)"
            ),
        );
        return None;
    }
    Some(QuotaSpec {
        count,
        period: Period::Every(secs),
        tz: jiff::tz::TimeZone::UTC,
        fallback_count: (count / divide_by.max(1)).max(1),
        counting,
    })
}

/// `N/DURATION`, N a whole number of at least 1, the duration whole seconds from 1s to 366d.
fn parse_window(s: &str) -> Result<(u32, u32), String> {
    let (count, per) = s
        .trim()
        .split_once('/')
        .ok_or_else(|| format!("window `{s}` must look like `5/15m` or `1000/1h`"))?;
    let count: u32 = count
        .trim()
        .parse()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| {
            format!(
                "window `{s}`: `{}` is not a whole number of at least 1",
                count.trim()
            )
        })?;
    let d = crate::config::values::duration(per.trim())?;
    let secs = d.as_secs();
    if d.subsec_nanos() != 0 || secs < WINDOW_RANGE.0 || secs > WINDOW_RANGE.1 {
        return Err(format!(
            "window `{s}`: the duration must be whole seconds from 1s to 366d"
        ));
    }
    Ok((count, u32::try_from(secs).unwrap_or(u32::MAX)))
}

/// A limit's `ban` block, or `None` with the problems added.
pub(super) fn ban(b: &file::Ban, shadow: bool, path: &str, p: &mut Problems) -> Option<BanSpec> {
    let path = format!("{path}.ban");
    if shadow {
        p.add(&path, "a shadow limit refuses nobody: it cannot ban");
        return None;
    }
    if b.after == 0 {
        p.add(format!("{path}.after"), "must be at least 1");
    }
    let mut d = |key: &str, s: &str| {
        let d = p.take(format!("{path}.{key}"), crate::config::values::duration(s))?;
        if d.is_zero() {
            p.add(format!("{path}.{key}"), "must be longer than zero");
            return None;
        }
        Some(d)
    };
    let (within, first, max) = (d("within", &b.within), d("for", &b.first), d("max", &b.max));
    let (within, first, max) = (within?, first?, max?);
    if max < first {
        p.add(format!("{path}.max"), "must be at least `for`");
        return None;
    }
    (b.after > 0).then_some(BanSpec {
        after: b.after,
        within,
        first,
        max,
    })
}

/// `N/hour`, `N/day`, `N/week` or `N/month`, N a whole number of at least 1.
pub(crate) fn parse(s: &str) -> Result<(u32, Period), String> {
    let wrong = || {
        format!("quota `{s}` must look like `100/hour`, `1000/day`, `5000/week` or `20000/month`")
    };
    let (count, per) = s.trim().split_once('/').ok_or_else(wrong)?;
    let count: u32 = count
        .trim()
        .parse()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| {
            format!(
                "quota `{s}`: `{}` is not a whole number of at least 1",
                count.trim()
            )
        })?;
    let period = match per.trim() {
        "hour" => Period::Hour,
        "day" => Period::Day,
        "week" => Period::Week,
        "month" => Period::Month,
        // A window limit's count, in an operator's override (`quota: 10/15m`).
        _ => Period::Every(parse_window(s).map_err(|_| wrong())?.1),
    };
    Ok((count, period))
}

/// The quota as a rate over its period's nominal length: what headers and reloads compare.
fn as_rate(q: &QuotaSpec) -> RateValue {
    RateValue {
        count: f64::from(q.count),
        per: Duration::from_secs(u64::from(q.period.nominal_secs())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_parse() {
        assert_eq!(parse("1000/day"), Ok((1000, Period::Day)));
        assert_eq!(parse(" 5 / month "), Ok((5, Period::Month)));
        assert!(parse("0/day").is_err());
        assert!(parse("1.5/day").is_err());
        assert!(parse("10/fortnight").is_err());
        assert_eq!(parse("10/15m"), Ok((10, Period::Every(900))));
        assert!(parse("10").is_err());
        assert_eq!(parse_window("5/15m"), Ok((5, 900)));
        assert_eq!(parse_window("1000/1h"), Ok((1000, 3600)));
        assert!(parse_window("0/1m").is_err());
        assert!(parse_window("5/0s").is_err());
        assert!(parse_window("5/500ms").is_err());
        assert!(parse_window("5/367d").is_err());
        assert_eq!(parse_window("5/365d"), Ok((5, 365 * 86_400)));
    }
}
