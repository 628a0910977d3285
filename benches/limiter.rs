//! Micro-benchmarks of the request path's pure stages: limit checks, route lookup, identity.

use std::fmt::Write as _;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use http::{HeaderMap, Method, Uri};
use tollgate::identity::{client_ip, ClientId, RequestView};
use tollgate::limiter::local::{check, Buckets, Item};
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
                rate: &rate,
                cost: 1,
            };
            black_box(check(&[item], &[true], 0.0))
        });
    });
}

fn routing(c: &mut Criterion) {
    for n in [10usize, 100, 1000] {
        let mut yaml = String::from("listeners: [{address: 127.0.0.1:0}]\nroutes:\n");
        for r in 0..n {
            let _ = writeln!(
                yaml,
                "  - {{ name: r{r}, match: {{ path_prefix: /svc{r}/ }}, respond: {{ status: 200 }} }}"
            );
        }
        let settings = tollgate::config::parse(&yaml).expect("bench config");
        let uri: Uri = format!("/svc{}/x", n - 1).parse().unwrap();
        let headers = HeaderMap::new();
        c.bench_function(&format!("route find, last of {n}"), |b| {
            b.iter(|| black_box(settings.table.find_parts(&Method::GET, &uri, &headers)));
        });
    }
}

fn identity(c: &mut Criterion) {
    let trusted: Vec<ipnet::IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
    let mut headers = HeaderMap::new();
    headers.insert(
        "x-forwarded-for",
        "203.0.113.9, 10.1.2.3, 10.4.5.6".parse().unwrap(),
    );
    headers.insert("x-api-key", "k-0123456789abcdef".parse().unwrap());
    let peer = "10.0.0.1".parse().unwrap();
    c.bench_function("client ip through a trusted XFF chain", |b| {
        b.iter(|| black_box(client_ip(black_box(peer), &headers, &trusted)));
    });
    let spec = tollgate::identity::KeySpec(vec![
        tollgate::identity::Alternative::parse("header:X-API-Key").unwrap(),
        tollgate::identity::Alternative::parse("ip").unwrap(),
    ]);
    let (method, uri) = (Method::GET, Uri::from_static("/v1/x"));
    let view = RequestView {
        method: &method,
        uri: &uri,
        headers: &headers,
        client_ip: peer,
    };
    c.bench_function("identity digest of header:X-API-Key", |b| {
        b.iter(|| black_box(view.resolve(&spec)));
    });
}

criterion_group!(benches, limit_checks, routing, identity);
criterion_main!(benches);
