//! What a `jwt:CLAIM` identity costs per request: one token verified (HS256, RS256 2048-bit,
//! ES256 P-256) and its claim digested, and what a second limit reading the same token adds.
#![allow(clippy::disallowed_types)] // std's Instant: tests and benchmarks time the real world

use std::time::{SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use http::{HeaderMap, Method, Uri};
use ring::rand::SystemRandom;
use ring::signature::{
    EcdsaKeyPair, KeyPair as _, RsaKeyPair, RsaPublicKeyComponents,
    ECDSA_P256_SHA256_FIXED_SIGNING, RSA_PKCS1_SHA256,
};
use serde_json::json;
use tollgate::identity::jwt::{Context, Options, Verifier};
use tollgate::identity::{Alternative, KeySpec, RequestView};

const SECRET: &[u8] = b"an HS256 secret of at least 32 bytes, for benches";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!(
        "{}/tests/fixtures/jwt/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

fn b64(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// A token of `alg` and `kid`, signed by `sign`, for subject `alice`, valid for an hour.
fn token(alg: &str, kid: &str, sign: impl Fn(&[u8]) -> Vec<u8>) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let header = json!({ "alg": alg, "typ": "JWT", "kid": kid });
    let claims = json!({ "sub": "alice", "tenant": "acme", "exp": now + 3600, "iat": now });
    let input = format!(
        "{}.{}",
        b64(header.to_string().as_bytes()),
        b64(claims.to_string().as_bytes())
    );
    let sig = sign(input.as_bytes());
    format!("{input}.{}", b64(&sig))
}

// One benchmark group: each case is a few lines of setup beside its measurement.
#[allow(clippy::too_many_lines)]
fn jwt(c: &mut Criterion) {
    let rng = SystemRandom::new();
    let rsa = RsaKeyPair::from_der(&fixture("rsa1.pkcs1.der")).unwrap();
    let ec = EcdsaKeyPair::from_pkcs8(
        &ECDSA_P256_SHA256_FIXED_SIGNING,
        &fixture("ec1.pk8.der"),
        &rng,
    )
    .unwrap();
    let parts = RsaPublicKeyComponents::<Vec<u8>>::from(rsa.public());
    let point = ec.public_key().as_ref();
    let jwks = json!({ "keys": [
        { "kty": "RSA", "alg": "RS256", "kid": "r1", "n": b64(&parts.n), "e": b64(&parts.e) },
        { "kty": "EC", "crv": "P-256", "alg": "ES256", "kid": "e1",
          "x": b64(&point[1..33]), "y": b64(&point[33..]) },
    ]})
    .to_string();
    let verifier = Verifier::new(&Options {
        hs256_secret: Some(SECRET),
        jwks: Some(jwks.as_bytes()),
        ..Options::default()
    })
    .unwrap();
    let tokens = [
        (
            "HS256",
            token("HS256", "h", |m| {
                let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, SECRET);
                ring::hmac::sign(&key, m).as_ref().to_vec()
            }),
        ),
        (
            "RS256",
            token("RS256", "r1", |m| {
                let mut sig = vec![0; rsa.public().modulus_len()];
                rsa.sign(&RSA_PKCS1_SHA256, &rng, m, &mut sig).unwrap();
                sig
            }),
        ),
        (
            "ES256",
            token("ES256", "e1", |m| {
                ec.sign(&rng, m).unwrap().as_ref().to_vec()
            }),
        ),
    ];
    let by_sub = KeySpec(vec![
        Alternative::parse("jwt:sub").unwrap(),
        Alternative::parse("ip").unwrap(),
    ]);
    let by_tenant = KeySpec(vec![Alternative::parse("jwt:tenant").unwrap()]);
    let (method, uri) = (Method::GET, Uri::from_static("/v1/x"));
    for (alg, token) in &tokens {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", format!("Bearer {token}").parse().unwrap());
        let ctx = Context::new(&verifier, tollgate::identity::bearer(&headers));
        assert!(ctx.claims().is_some(), "the {alg} token verifies");
        // A fresh context per iteration: the token is verified every time, as per request.
        c.bench_function(&format!("jwt:sub identity, {alg} verified"), |b| {
            b.iter(|| {
                let ctx = Context::new(&verifier, tollgate::identity::bearer(&headers));
                black_box(view(&method, &uri, &headers, &ctx).resolve(&by_sub))
            });
        });
        c.bench_function(
            &format!("jwt:sub and jwt:tenant, {alg} verified once"),
            |b| {
                b.iter(|| {
                    let ctx = Context::new(&verifier, tollgate::identity::bearer(&headers));
                    let v = view(&method, &uri, &headers, &ctx);
                    black_box((v.resolve(&by_sub), v.resolve(&by_tenant)))
                });
            },
        );
    }
}

fn view<'a>(
    method: &'a Method,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    ctx: &'a Context<'a>,
) -> RequestView<'a> {
    RequestView {
        method,
        uri,
        headers,
        client_ip: "192.0.2.1".parse().unwrap(),
        jwt: Some(ctx),
    }
}

criterion_group!(benches, jwt);
criterion_main!(benches);
