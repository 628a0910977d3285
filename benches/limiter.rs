//! Micro-benchmarks of the in-process limiter: a check of one hot bucket, and of a million.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tollgate::identity::ClientId;
use tollgate::limiter::local::{check, Buckets, Item, Peer};
use tollgate::limiter::Rate;

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
            };
            black_box(check(&[item], &[true], 0.0))
        });
    });
}

criterion_group!(benches, limit_checks);
criterion_main!(benches);
