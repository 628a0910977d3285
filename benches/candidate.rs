//! Micro-benchmarks of the candidate config's part of a request: route lookup, identities and
//! the in-process decision of its limits, counted (`Candidate::evaluate`), and a request that
//! matches no candidate route.
#![allow(clippy::disallowed_types)] // std's Instant: tests and benchmarks time the real world

use std::sync::Arc;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tollgate::candidate::Candidate;
use tollgate::limiter::concurrency::Guard;
use tollgate::limiter::Clock;

const CANDIDATE: &str = "listeners: [{address: 127.0.0.1:0}]
routes:
  - name: api
    match: { path_prefix: /api/ }
    respond: { status: 200 }
    limits:
      - { name: per-ip, rate: 1000000/s, burst: 1000000, key: [ip] }
      - { name: everyone, rate: 1000000/s, burst: 1000000, key: [global] }
";

use tollgate::identity::Arrival;

fn evaluate(c: &mut Criterion) {
    let live = tollgate::config::parse("listeners: [{address: 127.0.0.1:0}]\n").expect("live");
    let state = tollgate::state::State::build(live, 1).expect("state");
    let settings = tollgate::config::parse(CANDIDATE).expect("candidate");
    let candidate = Candidate::build(Arc::new(settings), None, &state.metrics);
    let clock = Clock::new();
    let ip = "203.0.113.9".parse().unwrap();
    let mut slots = Guard::default();
    let hit = http::Request::get("/api/users/42").body(()).unwrap();
    c.bench_function("candidate evaluate, 2 limits (ip + global)", |b| {
        b.iter(|| {
            let arrival = Arrival::of(black_box(&hit), ip);
            candidate.evaluate(&arrival, clock.now(), &mut slots);
        });
    });
    let miss = http::Request::get("/static/app.js").body(()).unwrap();
    c.bench_function("candidate evaluate, no candidate route", |b| {
        b.iter(|| {
            let arrival = Arrival::of(black_box(&miss), ip);
            candidate.evaluate(&arrival, clock.now(), &mut slots);
        });
    });
}

criterion_group!(benches, evaluate);
criterion_main!(benches);
