//! Micro-benchmarks of the in-process limiter: a check of one hot bucket, and of a million;
//! a calendar quota's check (its window computed per check, as a request does); window limits
//! (sliding, fixed, exact at N = 10, 100, 1,000) against the token bucket; a ban's look-up and
//! strike.
#![allow(clippy::disallowed_types)] // std's Instant: tests and benchmarks time the real world

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tollgate::identity::ClientId;
use tollgate::limiter::ban::Bans;
use tollgate::limiter::clock::wall_us;
use tollgate::limiter::local::{check, Buckets, Item, Peer};
use tollgate::limiter::window::window;
use tollgate::limiter::{BanSpec, Counting, Period, QuotaSpec, Rate};

fn limit_checks(c: &mut Criterion) {
    let rate = Rate {
        per_sec: 1e6,
        burst: 1_000_000,
    };
    let hot = Buckets::new(1_000_000);
    c.bench_function("local check, one hot key", |b| {
        b.iter(|| {
            let item = Item {
                buckets: &hot,
                client: ClientId(42),
                peer: Peer::default(),
                rate: &rate,
                cost: 1,
                window: None,
            };
            black_box(check(&[item], &[true], 0.0))
        });
    });
    let many = Buckets::new(2_000_000);
    let mut i: u128 = 0;
    c.bench_function("local check, 1M distinct keys", |b| {
        b.iter(|| {
            // Cycle through 1M ids spread like BLAKE3 digests (all 128 bits vary, so clients
            // fall into every shard as real identities do).
            i = (i + 1) % 1_000_000;
            let client = ClientId(i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835));
            let item = Item {
                buckets: &many,
                client,
                peer: Peer::default(),
                rate: &rate,
                cost: 1,
                window: None,
            };
            black_box(check(&[item], &[true], 0.0))
        });
    });
}

fn quota_checks(c: &mut Criterion) {
    let quota = QuotaSpec {
        count: u32::MAX,
        period: Period::Day,
        tz: jiff::tz::TimeZone::get("Europe/Paris").expect("a zone"),
        fallback_count: u32::MAX,
        counting: Counting::Fixed,
    };
    let rate = Rate {
        per_sec: 1e6,
        burst: u32::MAX,
    };
    let hot = Buckets::new(1_000_000).with_quota(Some(quota.clone()));
    c.bench_function("local quota check (day, Europe/Paris), one hot key", |b| {
        b.iter(|| {
            let item = Item {
                buckets: &hot,
                client: ClientId(42),
                peer: Peer::default(),
                rate: &rate,
                cost: 1,
                window: Some(window(&quota, wall_us(), quota.count)),
            };
            black_box(check(&[item], &[true], 0.0))
        });
    });
    c.bench_function("quota window only (day, Europe/Paris)", |b| {
        b.iter(|| black_box(window(&quota, wall_us(), quota.count)));
    });
    let utc = QuotaSpec {
        tz: jiff::tz::TimeZone::UTC,
        ..quota.clone()
    };
    c.bench_function("quota window only (day, UTC)", |b| {
        b.iter(|| black_box(window(&utc, wall_us(), utc.count)));
    });
}

/// A window limit's check of one key whose window is always full (every check counted and
/// rejected: the log stays at N), as a request does it: the window taken from the wall clock.
fn window_checks(c: &mut Criterion) {
    let rate = Rate {
        per_sec: 1.0,
        burst: 1,
    };
    let cases = [
        (Counting::Sliding, 100),
        (Counting::Fixed, 100),
        (Counting::Exact, 10),
        (Counting::Exact, 100),
        (Counting::Exact, 1000),
    ];
    for (counting, count) in cases {
        let spec = QuotaSpec {
            count,
            period: Period::Every(60),
            tz: jiff::tz::TimeZone::UTC,
            fallback_count: count,
            counting,
        };
        let buckets = Buckets::new(1_000_000).with_quota(Some(spec.clone()));
        let name = format!(
            "local window check ({}, N = {count}), one hot key",
            counting.as_str()
        );
        c.bench_function(&name, |b| {
            b.iter(|| {
                let item = Item {
                    buckets: &buckets,
                    client: ClientId(42),
                    peer: Peer::default(),
                    rate: &rate,
                    cost: 1,
                    window: Some(window(&spec, wall_us(), spec.count)),
                };
                black_box(check(&[item], &[true], 0.0))
            });
        });
    }
}

fn ban_checks(c: &mut Criterion) {
    let spec = BanSpec {
        after: 10,
        within: std::time::Duration::from_mins(1),
        first: std::time::Duration::from_mins(5),
        max: std::time::Duration::from_hours(1),
    };
    let bans = Bans::new(&spec, 1_000_000);
    // What a request on a limit with a ban adds: the look-up before the check.
    c.bench_function("ban look-up, identity not banned", |b| {
        b.iter(|| black_box(bans.banned(ClientId(42), 0.0)));
    });
    let mut now = 0.0;
    for _ in 0..10 {
        bans.strike(ClientId(7), now);
    }
    c.bench_function("ban look-up, identity banned", |b| {
        b.iter(|| black_box(bans.banned(ClientId(7), 1.0)));
    });
    // And a rejection by it: one strike.
    c.bench_function("ban strike", |b| {
        b.iter(|| {
            now += 1.0;
            black_box(bans.strike(ClientId(9), now))
        });
    });
}

criterion_group!(
    benches,
    limit_checks,
    quota_checks,
    window_checks,
    ban_checks
);
criterion_main!(benches);
