//! What `tollgate.keys` costs a request with a JSON access log: the digests of the identity
//! sources its route's limits read, rendered for the line (one header key, and a header key
//! with a cookie the request does not carry), against the resolve the limit does anyway.
#![allow(clippy::disallowed_types)] // std's Instant: tests and benchmarks time the real world

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use http::{HeaderMap, Method, Uri};
use tollgate::access_log::KeySources;
use tollgate::identity::{Alternative, KeySpec, RequestView, Source};

fn keys(c: &mut Criterion) {
    let (method, uri) = (Method::GET, Uri::from_static("/api/v1/items"));
    let mut headers = HeaderMap::new();
    headers.insert("x-api-key", "k-7f3a9c21e4b04d8f".parse().unwrap());
    headers.insert("user-agent", "bench/1.0".parse().unwrap());
    let view = RequestView {
        method: &method,
        uri: &uri,
        headers: &headers,
        client_ip: "192.0.2.7".parse().unwrap(),
        jwt: None,
    };
    let one = [
        Source::parse("header:X-API-Key").unwrap(),
        Source::parse("ip").unwrap(),
    ];
    let two = [
        Source::parse("header:X-API-Key").unwrap(),
        Source::parse("ip").unwrap(),
        Source::parse("cookie:session").unwrap(),
        Source::parse("header:X-API-Key").unwrap(),
    ];
    let mut g = c.benchmark_group("access_keys");
    // What the request path does (`digests`), then the line's writing (`render`).
    let both = |sources: &KeySources| {
        let digests = black_box(sources).digests(black_box(&view));
        sources.render(&digests)
    };
    let (one, two) = (KeySources::of(one.iter()), KeySources::of(two.iter()));
    g.bench_function("header key", |b| b.iter(|| both(&one)));
    g.bench_function("header key, absent cookie", |b| b.iter(|| both(&two)));
    g.bench_function("header key, digests alone", |b| {
        b.iter(|| black_box(&one).digests(black_box(&view)));
    });
    // For scale: the digest the limit computes for the same key.
    let spec = KeySpec(vec![
        Alternative::parse("header:X-API-Key").unwrap(),
        Alternative::parse("ip").unwrap(),
    ]);
    g.bench_function("resolve of the limit (for scale)", |b| {
        b.iter(|| black_box(&view).resolve(black_box(&spec)));
    });
    g.finish();
}

criterion_group!(benches, keys);
criterion_main!(benches);
