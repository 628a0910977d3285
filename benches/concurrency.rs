//! Micro-benchmarks of the in-process concurrency check: a slot taken and given back, for one
//! hot identity and among 100k identities with requests in flight.
#![allow(clippy::disallowed_types)] // std's Instant: tests and benchmarks time the real world

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tollgate::identity::ClientId;
use tollgate::limiter::concurrency::Slots;

/// Ids spread like BLAKE3 digests (all 128 bits vary), as real identities are.
fn spread(i: u128) -> ClientId {
    ClientId(i.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
}

fn slot_take_and_release(c: &mut Criterion) {
    let slots = Slots::new();
    c.bench_function("concurrency take+release, one hot key", |b| {
        b.iter(|| black_box(slots.try_take(ClientId(42), 8).ok()));
    });
    let busy = Slots::new();
    // 100k identities with a request in flight each: the map at its working size.
    let held: Vec<_> = (0..100_000u128)
        .filter_map(|i| busy.try_take(spread(i), 8).ok())
        .collect();
    let mut i: u128 = 0;
    c.bench_function("concurrency take+release, 100k keys in flight", |b| {
        b.iter(|| {
            i = (i + 1) % 100_000;
            black_box(busy.try_take(spread(i), 8).ok())
        });
    });
    drop(held);
}

criterion_group!(benches, slot_take_and_release);
criterion_main!(benches);
