//! What the request path's metric writes cost when every worker thread writes them: one
//! prometheus-client `Counter` (an atomic) or `Histogram` (a mutex) shared by all threads,
//! against `tollgate::sharded`'s per-thread lines. Two threads write at once, as tollgate's two
//! workers do on a 2-core machine; each iteration is one write per thread.
#![allow(clippy::disallowed_types)] // std's Instant: tests and benchmarks time the real world

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use tollgate::sharded;

const THREADS: usize = 2;

/// Time `iters` calls of `write` on each of THREADS threads running at once.
fn contended(iters: u64, write: &(dyn Fn() + Sync)) -> Duration {
    let start = std::sync::Barrier::new(THREADS + 1);
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                start.wait();
                for _ in 0..iters {
                    write();
                }
            });
        }
        start.wait();
        let t = Instant::now();
        // The scope joins the threads before it returns.
        t
    })
    .elapsed()
}

fn writes(c: &mut Criterion) {
    let mut g = c.benchmark_group("metric write, 2 threads at once");
    let shared = Counter::<u64>::default();
    g.bench_function("counter, prometheus-client (shared atomic)", |b| {
        b.iter_custom(|n| {
            contended(n, &|| {
                shared.inc();
            })
        });
    });
    let ours = sharded::Counter::default();
    g.bench_function("counter, sharded (a line per thread)", |b| {
        b.iter_custom(|n| contended(n, &|| ours.inc()));
    });
    let shared = Histogram::new(exponential_buckets(0.000_05, 2.0, 20));
    g.bench_function("histogram, prometheus-client (shared mutex)", |b| {
        b.iter_custom(|n| contended(n, &|| shared.observe(0.000_3)));
    });
    let ours = sharded::Histogram::new(exponential_buckets(0.000_05, 2.0, 20));
    g.bench_function("histogram, sharded (lines per thread)", |b| {
        b.iter_custom(|n| contended(n, &|| ours.observe(0.000_3)));
    });
    g.finish();
}

criterion_group!(benches, writes);
criterion_main!(benches);
