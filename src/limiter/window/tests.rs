//! Quotas' calendar windows, and window limits against exact models of their counting.

use super::*;

fn quota(count: u32, period: Period, tz: &str) -> QuotaSpec {
    QuotaSpec {
        count,
        period,
        tz: TimeZone::get(tz).unwrap(),
        fallback_count: count,
        counting: Counting::Fixed,
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
fn a_fixed_window_admits_exactly_n_per_aligned_window_and_2n_across_a_boundary() {
    // Against an exact model: arrivals at pseudo-random instants (uniform, then bursts),
    // counted per aligned window; at most N each, exactly min(N, arrivals) each.
    for (n, secs) in [(5u32, 900u32), (10, 1), (1000, 3600)] {
        let spec = quota(n, Period::Every(secs), "UTC");
        let len = f64::from(secs) * 1e6;
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 11) as f64 / (1u64 << 53) as f64
        };
        let start = us("2026-06-01T00:00:00Z") as f64;
        let mut arrivals = Vec::new();
        for _ in 0..20 * n {
            arrivals.push(start + next() * 8.0 * len);
        }
        for _ in 0..4 * n {
            arrivals.push(start + 3.0 * len - 1.0 - next() * 1e3);
            arrivals.push(start + 3.0 * len + next() * 1e3);
        }
        arrivals.sort_by(f64::total_cmp);
        let mut tat = None;
        let mut admitted = std::collections::BTreeMap::<i64, (u32, u32)>::new();
        for &at in &arrivals {
            let w = window(&spec, at, n);
            assert!(w.start <= at && at < w.end && (w.start % len).abs() < 1e-3);
            let (v, t) = step(tat, &w, 1);
            let e = admitted.entry(w.start as i64).or_default();
            e.1 += 1;
            if v.admitted {
                e.0 += 1;
                tat = Some(t);
            } else {
                assert!(
                    (v.retry_after_us - (w.end - at)).abs() < 1.0,
                    "retry is the window's end"
                );
            }
        }
        for (start, (ok, seen)) in &admitted {
            assert_eq!(*ok, (*seen).min(n), "window at {start}: {ok} of {seen}");
        }
        // Across the boundary at 3 windows: N just before and N just after (2N in 2 ms).
        let boundary = start + 3.0 * len;
        let near = arrivals
            .iter()
            .filter(|a| (**a - boundary).abs() <= 1e3)
            .count();
        assert!(near as u32 >= 2 * n);
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

/// Pseudo-random numbers in [0, 1) (xorshift: the same sequence on every run).
fn uniform(seed: u64) -> impl FnMut() -> f64 {
    let mut rng = seed;
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Arrival times over `windows` windows of `len` µs: `uniform` ones at `per_window` a window
/// on average, or `bursty` ones (most of each window's arrivals in a burst at a random spot,
/// some at the window edges), sorted.
fn arrivals(len: f64, per_window: f64, windows: u32, bursty: bool, seed: u64) -> Vec<f64> {
    let mut next = uniform(seed);
    let start = us("2026-06-01T00:00:00Z") as f64;
    let total = (per_window * f64::from(windows)) as usize;
    let mut at: Vec<f64> = if bursty {
        (0..total)
            .map(|i| {
                let w = (i as f64 / per_window).floor();
                let spot = match i % 4 {
                    0 => 0.97 + 0.03 * next(),
                    1 => 0.03 * next(),
                    _ => ((w * 0.37) % 1.0) + 0.02 * next(),
                };
                start + (w + spot) * len
            })
            .collect()
    } else {
        (0..total)
            .map(|_| start + next() * f64::from(windows) * len)
            .collect()
    };
    at.sort_by(f64::total_cmp);
    at
}

/// Run `at` through a window limit of `n` per `secs` in process (the store's own path, keys
/// and logs included), one client; the verdicts in order.
fn run(counting: Counting, n: u32, secs: u32, at: &[f64]) -> Vec<Verdict> {
    let spec = QuotaSpec {
        counting,
        ..quota(n, Period::Every(secs), "UTC")
    };
    let buckets = crate::limiter::local::Buckets::new(1000).with_quota(Some(spec.clone()));
    let rate = crate::limiter::Rate {
        per_sec: 1.0,
        burst: 1,
    };
    at.iter()
        .map(|&t| {
            let item = crate::limiter::local::Item {
                buckets: &buckets,
                client: crate::identity::ClientId(0xfeed),
                peer: crate::limiter::local::Peer::default(),
                rate: &rate,
                cost: 1,
                window: Some(window(&spec, t, n)),
            };
            crate::limiter::local::check(&[item], &[true], 0.0)[0]
        })
        .collect()
}

/// The most admitted requests in any span of `len` (a window sliding over the admissions).
fn most_in_any_window(admitted: &[f64], len: f64) -> usize {
    let mut first = 0;
    let mut most = 0;
    for (i, t) in admitted.iter().enumerate() {
        while admitted[first] <= t - len {
            first += 1;
        }
        most = most.max(i + 1 - first);
    }
    most
}

#[test]
fn an_exact_window_admits_exactly_n_in_any_window_and_says_when() {
    for (n, secs) in [(5u32, 900u32), (10, 1), (100, 60), (1000, 3600)] {
        let len = f64::from(secs) * 1e6;
        for bursty in [false, true] {
            let at = arrivals(len, 3.0 * f64::from(n), 12, bursty, 7 + u64::from(n));
            let verdicts = run(Counting::Exact, n, secs, &at);
            let mut admitted = Vec::new();
            let mut first = 0;
            for (&t, v) in at.iter().zip(&verdicts) {
                // The model: the admissions in (t - len, t].
                while admitted.get(first).is_some_and(|a| *a <= t - len) {
                    first += 1;
                }
                let held = admitted.len() - first;
                assert_eq!(v.admitted, held < n as usize, "n={n} at {t}: {held} held");
                if v.admitted {
                    admitted.push(t);
                    assert_eq!(v.remaining, (n as usize - held - 1) as u64);
                } else {
                    // Room comes back exactly when the oldest counted request leaves.
                    let oldest = admitted[admitted.len() - n as usize];
                    assert!((t + v.retry_after_us - (oldest + len)).abs() <= 1.0);
                }
            }
            assert_eq!(most_in_any_window(&admitted, len), n as usize);
        }
    }
}

/// The most a sliding window admits in any span of its length, over N, on uniform and bursty
/// traffic at 3N offered per window; and how many of the exact window's admissions it makes.
fn sliding_error(n: u32, secs: u32, bursty: bool) -> (f64, f64) {
    let len = f64::from(secs) * 1e6;
    let at = arrivals(len, 3.0 * f64::from(n), 40, bursty, 11 + u64::from(n));
    let took = |c| -> Vec<f64> {
        at.iter()
            .zip(run(c, n, secs, &at))
            .filter(|(_, v)| v.admitted)
            .map(|(t, _)| *t)
            .collect()
    };
    let (sliding, exact) = (took(Counting::Sliding), took(Counting::Exact));
    let over = most_in_any_window(&sliding, len) as f64 / f64::from(n);
    (over, sliding.len() as f64 / exact.len() as f64)
}

#[test]
fn a_sliding_window_stays_within_its_documented_error() {
    // docs/configuration.md "Choosing an algorithm" gives these bounds: at most 1.5 N (bursty)
    // and 1.2 N (uniform) in any window; and at least 0.85 of what `exact` admits.
    for (n, secs) in [(5u32, 900u32), (100, 60), (1000, 3600)] {
        let (over, share) = sliding_error(n, secs, false);
        eprintln!("uniform n={n}: most in any window {over:.3} N, {share:.3} of exact");
        assert!(
            over <= 1.2 && share >= 0.85,
            "uniform n={n}: {over}, {share}"
        );
        let (over, share) = sliding_error(n, secs, true);
        eprintln!("bursty n={n}: most in any window {over:.3} N, {share:.3} of exact");
        assert!(
            over <= 1.5 && share >= 0.85,
            "bursty n={n}: {over}, {share}"
        );
    }
}

#[test]
fn a_sliding_window_answers_when_it_admits_again() {
    // Whenever it rejects, the retry time is the first instant it admits (to the µs).
    let (n, secs) = (10u32, 60u32);
    let len = f64::from(secs) * 1e6;
    let spec = QuotaSpec {
        counting: Counting::Sliding,
        ..quota(n, Period::Every(secs), "UTC")
    };
    let start = us("2026-06-01T00:00:00Z") as f64;
    for (cur, last, f) in [
        (10.0, 0.0, 0.5),
        (4.0, 10.0, 0.1),
        (0.0, 10.0, 0.0),
        (9.0, 3.0, 0.9),
    ] {
        let tok = len / f64::from(n);
        let w = window(&spec, start + len + f * len, n);
        let tat = Some(w.start + cur * tok);
        let prev = Some(w.start - len + last * tok);
        let (v, _) = slide(tat, prev, &w, 1);
        assert!(!v.admitted, "{cur} {last} {f}");
        let later = |dt: f64| {
            let t = w.now + dt;
            // Past the window's end, this window's count is the last one's.
            let w2 = window(&spec, t, n);
            if w2.start > w.start {
                slide(None, tat, &w2, 1).0.admitted
            } else {
                slide(tat, prev, &w2, 1).0.admitted
            }
        };
        assert!(later(v.retry_after_us), "{cur} {last} {f}: admits at retry");
        assert!(
            !later(v.retry_after_us - 2.0),
            "{cur} {last} {f}: not before"
        );
    }
}

#[test]
fn a_rejection_by_a_window_keeps_its_count() {
    let spec = QuotaSpec {
        counting: Counting::Sliding,
        ..quota(3, Period::Every(60), "UTC")
    };
    let at = [0.0, 1.0, 2.0, 3.0, 4.0].map(|s| us("2026-06-01T00:00:10Z") as f64 + s * 1e6);
    let v = run(Counting::Sliding, 3, 60, &at);
    assert_eq!(
        v.iter().map(|v| v.admitted).collect::<Vec<_>>(),
        [true, true, true, false, false]
    );
    assert_eq!(v[3].remaining, 0);
    let _ = spec;
}

#[test]
fn an_exact_log_from_a_clock_stepped_back_leaves_within_one_window() {
    let w = Window {
        start: 0.0,
        end: 5e6,
        now: 1e9,
        count: 3,
        counting: Counting::Exact,
    };
    // Three times an hour ahead of now, as a clock stepped back leaves them.
    let mut log: std::collections::VecDeque<f64> = [1e9 + 3.6e9; 3].into_iter().collect();
    let v = exact(&mut log, &w, 1);
    assert!(!v.admitted);
    assert!(v.retry_after_us <= w.len(), "{}", v.retry_after_us);
    let later = Window {
        now: 1e9 + w.len(),
        ..w
    };
    assert!(exact(&mut log, &later, 1).admitted);
}
