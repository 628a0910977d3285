//! The Redis check round trip, against a `redis-server` this bench starts on a free loopback
//! port (and stops): one EVALSHA of the bucket script per check, one and two buckets, and one
//! sliding and one fixed window limit.
#![allow(clippy::disallowed_types)] // std's Instant: tests and benchmarks time the real world

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tollgate::identity::{Alternative, ClientId, KeySpec};
use tollgate::limiter::redis::{RedisConfig, RedisLimiter};
use tollgate::limiter::{test_util, Check, Counting, Limit, Period, QuotaSpec, Rate};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis() -> Option<(Server, u16)> {
    let port = TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
        .ok()?;
    let server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some((server, port))
}

fn limit(name: &str) -> Limit {
    let key = KeySpec(vec![Alternative::parse("ip").expect("a source")]);
    test_util::limit(name, (1e6, 1_000_000), 1, key).with_fallback(Rate {
        per_sec: 1e6,
        burst: 1_000_000,
    })
}

fn redis_round_trip(c: &mut Criterion) {
    let Some((_server, port)) = start_redis() else {
        eprintln!("redis-server not available: skipping the Redis benchmarks");
        return;
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let cfg = RedisConfig {
        url: Some(format!("redis://127.0.0.1:{port}")),
        cluster: Vec::new(),
        timeout: Duration::from_millis(500),
        key_prefix: "bench:".into(),
        ..RedisConfig::default()
    };
    let limiter = rt
        .block_on(async { RedisLimiter::new(&cfg) })
        .expect("a limiter");
    let (per_key, global) = (limit("per-key"), limit("global"));
    let one = [Check {
        limit: &per_key,
        client: ClientId(7),
    }];
    let two = [
        one[0],
        Check {
            limit: &global,
            client: ClientId(1),
        },
    ];
    // Connect and load the script before measuring.
    rt.block_on(limiter.check(&one, &[true]))
        .expect("Redis answers");
    c.bench_function("redis check, one bucket", |b| {
        b.iter(|| black_box(rt.block_on(limiter.check(&one, &[true]))));
    });
    c.bench_function("redis check, two buckets", |b| {
        b.iter(|| black_box(rt.block_on(limiter.check(&two, &[true, true]))));
    });
    windows(c, &rt, &limiter);
}

/// One sliding and one fixed window limit, each admitting, over the same connection.
fn windows(c: &mut Criterion, rt: &tokio::runtime::Runtime, limiter: &RedisLimiter) {
    // Admitting windows: a refused check is answered by the negative cache, not Redis (the
    // Redis side of `exact` is measured with redis-benchmark, docs/performance.md).
    for (counting, count) in [(Counting::Sliding, 1_000_000), (Counting::Fixed, 1_000_000)] {
        let spec = QuotaSpec {
            count,
            period: Period::Every(3600),
            tz: jiff::tz::TimeZone::UTC,
            fallback_count: count,
            counting,
        };
        let name = format!("{}-{count}", counting.as_str());
        let window = limit(&name).with_quota(spec);
        let one = [Check {
            limit: &window,
            client: ClientId(9),
        }];
        c.bench_function(
            &format!(
                "redis check, one window ({}, N = {count})",
                counting.as_str()
            ),
            |b| {
                b.iter(|| black_box(rt.block_on(limiter.check(&one, &[true]))));
            },
        );
    }
}

criterion_group!(benches, redis_round_trip);
criterion_main!(benches);
