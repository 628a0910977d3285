//! Micro-benchmarks of the request path's other pure stages: screening, route lookup, identity.
#![allow(clippy::disallowed_types)] // std's Instant: tests and benchmarks time the real world

use std::fmt::Write as _;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use http::{HeaderMap, Method, Uri};
use tollgate::identity::{client_ip, RequestView};

fn screening(c: &mut Criterion) {
    c.bench_function("path normalisation, clean path", |b| {
        b.iter(|| {
            black_box(tollgate::screen::normalize_path(black_box(
                "/api/v1/users/42",
            )))
        });
    });
    c.bench_function("path normalisation, dot segments and escapes", |b| {
        b.iter(|| {
            black_box(tollgate::screen::normalize_path(black_box(
                "//api/./v1/%75sers/../users/42",
            )))
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
        jwt: None,
    };
    c.bench_function("identity digest of header:X-API-Key", |b| {
        b.iter(|| black_box(view.resolve(&spec)));
    });
}

criterion_group!(benches, screening, routing, identity);
criterion_main!(benches);
