//! `jwt:CLAIM` identities against real sockets: a verified token gets a bucket per claim
//! value; a forged, expired, not-yet-valid, wrong-issuer or wrong-audience token is absent, so
//! `[jwt:sub, ip]` counts it in the client address's bucket. HS256, RS256 and ES256; a JWKS
//! file replaced and the config reloaded verifies with the new key.
//!
//! Tokens are signed here with ring directly (not through the crate tollgate verifies with),
//! with the RSA (PKCS#1) and P-256 (PKCS#8) keys of `tests/fixtures/jwt`, made once with
//! `openssl genpkey`. Times are relative to now.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{
    EcdsaKeyPair, KeyPair as _, RsaKeyPair, RsaPublicKeyComponents,
    ECDSA_P256_SHA256_FIXED_SIGNING, RSA_PKCS1_SHA256,
};
use serde_json::{json, Value};

use common::{config, Http, TestProxy};

const SECRET: &[u8] = b"an HS256 secret of at least 32 bytes, for tests";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/jwt")
            .join(name),
    )
    .expect("read a key fixture")
}

fn rsa(name: &str) -> RsaKeyPair {
    RsaKeyPair::from_der(&fixture(name)).expect("an RSA PKCS#1 key")
}

fn ec(name: &str) -> EcdsaKeyPair {
    EcdsaKeyPair::from_pkcs8(
        &ECDSA_P256_SHA256_FIXED_SIGNING,
        &fixture(name),
        &SystemRandom::new(),
    )
    .expect("a P-256 PKCS#8 key")
}

fn b64(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

enum Key<'a> {
    Hs(&'a [u8]),
    Rs(&'a RsaKeyPair),
    Es(&'a EcdsaKeyPair),
}

/// A compact JWS of `claims`, its header saying `alg` (and `kid`), signed with `key`.
fn sign(key: &Key<'_>, alg: &str, kid: Option<&str>, claims: &Value) -> String {
    let mut header = json!({ "alg": alg, "typ": "JWT" });
    if let Some(kid) = kid {
        header["kid"] = json!(kid);
    }
    let input = format!(
        "{}.{}",
        b64(header.to_string().as_bytes()),
        b64(claims.to_string().as_bytes())
    );
    let sig = match key {
        Key::Hs(secret) => {
            let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
            ring::hmac::sign(&key, input.as_bytes()).as_ref().to_vec()
        }
        Key::Rs(pair) => {
            let mut sig = vec![0; pair.public().modulus_len()];
            pair.sign(
                &RSA_PKCS1_SHA256,
                &SystemRandom::new(),
                input.as_bytes(),
                &mut sig,
            )
            .unwrap();
            sig
        }
        Key::Es(pair) => pair
            .sign(&SystemRandom::new(), input.as_bytes())
            .unwrap()
            .as_ref()
            .to_vec(),
    };
    format!("{input}.{}", b64(&sig))
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Claims valid for an hour, with `extra` merged in.
fn claims(extra: &Value) -> Value {
    let mut c = json!({ "exp": now() + 3600, "iat": now() });
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

fn rsa_jwk(pair: &RsaKeyPair, kid: &str) -> Value {
    let c = RsaPublicKeyComponents::<Vec<u8>>::from(pair.public());
    json!({ "kty": "RSA", "alg": "RS256", "use": "sig", "kid": kid, "n": b64(&c.n), "e": b64(&c.e) })
}

fn ec_jwk(pair: &EcdsaKeyPair, kid: &str) -> Value {
    let point = pair.public_key().as_ref();
    json!({ "kty": "EC", "crv": "P-256", "alg": "ES256", "kid": kid,
            "x": b64(&point[1..33]), "y": b64(&point[33..]) })
}

/// A temporary directory holding `secret` and `jwks.json`.
struct Keys {
    dir: tempfile::TempDir,
}

impl Keys {
    fn new(jwks: &[Value]) -> Self {
        let keys = Self {
            dir: tempfile::tempdir().unwrap(),
        };
        std::fs::write(keys.secret(), [SECRET, b"\n"].concat()).unwrap();
        keys.write_jwks(jwks);
        keys
    }

    fn secret(&self) -> PathBuf {
        self.dir.path().join("secret")
    }

    fn jwks(&self) -> PathBuf {
        self.dir.path().join("jwks.json")
    }

    /// Replace the JWKS file as a deploy does: a new file renamed over the old one.
    fn write_jwks(&self, keys: &[Value]) {
        let tmp = self.dir.path().join("jwks.json.new");
        std::fs::write(&tmp, json!({ "keys": keys }).to_string()).unwrap();
        std::fs::rename(tmp, self.jwks()).unwrap();
    }

    /// The `identity:` section, `extra` lines added under `jwt:`.
    fn identity(&self, extra: &str) -> String {
        format!(
            "identity:\n  jwt:\n    hs256_secret_file: {}\n    jwks_file: {}\n{extra}",
            self.secret().display(),
            self.jwks().display()
        )
    }
}

/// A proxy with `identity` and one route `/api/` answering 200, limited to one request a
/// minute per `key`.
fn proxy(identity: &str, key: &str) -> TestProxy {
    TestProxy::start(&config(&format!(
        "{identity}routes:\n  - name: api\n    match: {{ path_prefix: /api/ }}\n    \
         respond: {{ status: 200 }}\n    limits:\n      \
         - {{ name: per-user, rate: 1/min, burst: 1, key: {key} }}\n"
    )))
}

fn bearer(token: &str) -> [(&'static str, String); 1] {
    [("authorization", format!("Bearer {token}"))]
}

async fn status(http: &Http, url: &str, token: &str) -> u16 {
    let h = bearer(token);
    http.get_with(url, &[(h[0].0, h[0].1.as_str())])
        .await
        .code()
}

#[tokio::test]
async fn hs256_tokens_get_a_bucket_per_subject_and_failed_ones_the_address_bucket() {
    let keys = Keys::new(&[]);
    let proxy = proxy(&keys.identity(""), "[jwt:sub, ip]");
    let url = proxy.url("/api/");
    let (a, b) = (Http::new(), Http::from_ip("127.0.0.2"));
    let hs = Key::Hs(SECRET);
    let alice = sign(&hs, "HS256", None, &claims(&json!({ "sub": "alice" })));
    let bob = sign(&hs, "HS256", None, &claims(&json!({ "sub": "bob" })));
    assert_eq!(status(&a, &url, &alice).await, 200);
    assert_eq!(status(&a, &url, &alice).await, 429);
    // Another address, the same subject: the same bucket.
    assert_eq!(status(&b, &url, &alice).await, 429);
    assert_eq!(status(&a, &url, &bob).await, 200);
    // Within the 60 s leeway an expired token still verifies: alice's bucket.
    let late = sign(
        &hs,
        "HS256",
        None,
        &json!({ "sub": "alice", "exp": now() - 20 }),
    );
    assert_eq!(status(&b, &url, &late).await, 429);

    // 127.0.0.2 has not spent its address bucket: the first failed token takes it, and every
    // other failure from that address is counted there too.
    let other_secret = Key::Hs(b"not the configured secret, 32 bytes or more");
    let failed = [
        sign(
            &other_secret,
            "HS256",
            None,
            &claims(&json!({ "sub": "carol" })),
        ),
        sign(
            &hs,
            "HS256",
            None,
            &json!({ "sub": "dave", "exp": now() - 3600 }),
        ),
        sign(
            &hs,
            "HS256",
            None,
            &claims(&json!({ "sub": "erin", "nbf": now() + 3600 })),
        ),
        sign(&hs, "HS256", None, &json!({ "sub": "frank" })),
        format!(
            "{}.{}.",
            b64(br#"{"alg":"none","typ":"JWT"}"#),
            b64(claims(&json!({ "sub": "gina" })).to_string().as_bytes())
        ),
        // The HS256 secret never checks a token that claims RS256.
        sign(&hs, "RS256", None, &claims(&json!({ "sub": "hank" }))),
        "not.a.token".to_owned(),
        format!("{alice}x"),
    ];
    assert_eq!(status(&b, &url, &failed[0]).await, 200);
    for token in &failed {
        assert_eq!(status(&b, &url, token).await, 429, "{token}");
    }
    assert_eq!(b.get(&url).await.code(), 429);
    // A claim that is not a string or number is absent.
    let c = Http::from_ip("127.0.0.3");
    let odd = sign(&hs, "HS256", None, &claims(&json!({ "sub": ["x"] })));
    assert_eq!(status(&c, &url, &odd).await, 200);
    assert_eq!(c.get(&url).await.code(), 429);
}

#[tokio::test]
async fn rs256_and_es256_keys_are_chosen_by_kid() {
    let (r1, r2, e1) = (
        rsa("rsa1.pkcs1.der"),
        rsa("rsa2.pkcs1.der"),
        ec("ec1.pk8.der"),
    );
    let keys = Keys::new(&[rsa_jwk(&r1, "r1"), ec_jwk(&e1, "e1")]);
    let proxy = proxy(&keys.identity(""), "[jwt:tenant, ip]");
    let url = proxy.url("/api/");
    let http = Http::new();
    let tenant = |t: Value| claims(&json!({ "tenant": t }));
    let rs = sign(&Key::Rs(&r1), "RS256", Some("r1"), &tenant(json!("acme")));
    assert_eq!(status(&http, &url, &rs).await, 200);
    assert_eq!(status(&http, &url, &rs).await, 429);
    // ES256, and a numeric claim: its own bucket.
    let es = sign(&Key::Es(&e1), "ES256", Some("e1"), &tenant(json!(42)));
    assert_eq!(status(&http, &url, &es).await, 200);
    assert_eq!(status(&http, &url, &es).await, 429);
    // No `kid`: the keys of its algorithm are tried.
    let bare = sign(&Key::Es(&e1), "ES256", None, &tenant(json!("globex")));
    assert_eq!(status(&http, &url, &bare).await, 200);
    assert_eq!(status(&http, &url, &bare).await, 429);
    // Forged: a key the JWKS does not have, under a kid it does.
    let forged = sign(
        &Key::Rs(&r2),
        "RS256",
        Some("r1"),
        &tenant(json!("initech")),
    );
    assert_eq!(
        status(&http, &url, &forged).await,
        200,
        "the address bucket"
    );
    assert_eq!(http.get(&url).await.code(), 429);
    // RS256 signature bytes claimed as ES256, and HS256 signed with the RSA modulus.
    let c = RsaPublicKeyComponents::<Vec<u8>>::from(r1.public());
    let confused = [
        sign(
            &Key::Rs(&r1),
            "ES256",
            Some("e1"),
            &tenant(json!("umbrella")),
        ),
        sign(
            &Key::Hs(&c.n),
            "HS256",
            Some("r1"),
            &tenant(json!("umbrella")),
        ),
    ];
    for token in &confused {
        assert_eq!(status(&http, &url, token).await, 429, "{token}");
    }
}

#[tokio::test]
async fn issuers_and_audiences_are_checked_when_configured() {
    let keys = Keys::new(&[]);
    let identity = keys.identity(
        "    issuers: [https://auth.example.com]\n    audiences: [api, admin]\n    leeway: 5s\n",
    );
    let proxy = proxy(&identity, "[jwt:sub, ip]");
    let url = proxy.url("/api/");
    let hs = Key::Hs(SECRET);
    let token = |extra: Value| sign(&hs, "HS256", None, &claims(&extra));
    let good =
        token(json!({ "sub": "alice", "iss": "https://auth.example.com", "aud": ["x", "api"] }));
    let http = Http::new();
    assert_eq!(status(&http, &url, &good).await, 200);
    assert_eq!(status(&http, &url, &good).await, 429);
    let other = Http::from_ip("127.0.0.2");
    let failed = [
        token(json!({ "sub": "bob", "iss": "https://auth.example.com", "aud": "billing" })),
        token(json!({ "sub": "bob", "iss": "https://evil.example.com", "aud": "api" })),
        token(json!({ "sub": "bob", "aud": "api" })),
        token(json!({ "sub": "bob", "iss": "https://auth.example.com" })),
        // Past the 5 s leeway.
        sign(
            &hs,
            "HS256",
            None,
            &json!({ "sub": "bob", "iss": "https://auth.example.com", "aud": "api", "exp": now() - 30 }),
        ),
    ];
    assert_eq!(status(&other, &url, &failed[0]).await, 200);
    for t in &failed {
        assert_eq!(status(&other, &url, t).await, 429, "{t}");
    }
    let bob = token(json!({ "sub": "bob", "iss": "https://auth.example.com", "aud": "admin" }));
    assert_eq!(status(&other, &url, &bob).await, 200);
}

#[tokio::test]
async fn a_replaced_jwks_file_verifies_with_the_new_key_after_a_reload() {
    let (r1, r2) = (rsa("rsa1.pkcs1.der"), rsa("rsa2.pkcs1.der"));
    let keys = Keys::new(&[rsa_jwk(&r1, "2026-01")]);
    let proxy = proxy(&keys.identity(""), "[jwt:sub, ip]");
    let url = proxy.url("/api/");
    let http = Http::new();
    let old = sign(
        &Key::Rs(&r1),
        "RS256",
        Some("2026-01"),
        &claims(&json!({ "sub": "old" })),
    );
    let new = sign(
        &Key::Rs(&r2),
        "RS256",
        Some("2026-02"),
        &claims(&json!({ "sub": "new" })),
    );
    assert_eq!(status(&http, &url, &old).await, 200);
    // Not yet known: the address bucket.
    assert_eq!(status(&http, &url, &new).await, 200);
    assert_eq!(status(&http, &url, &new).await, 429);

    keys.write_jwks(&[rsa_jwk(&r2, "2026-02")]);
    proxy.reload();
    assert!(proxy.wait_for_generation(2, Duration::from_secs(10)).await);
    assert_eq!(status(&http, &url, &new).await, 200, "its own bucket");
    assert_eq!(status(&http, &url, &new).await, 429);
    // The retired key no longer verifies: the (spent) address bucket.
    let old2 = sign(
        &Key::Rs(&r1),
        "RS256",
        Some("2026-01"),
        &claims(&json!({ "sub": "old2" })),
    );
    assert_eq!(status(&http, &url, &old2).await, 429);

    // A broken JWKS fails the reload and the running keys stay.
    std::fs::write(keys.jwks(), "{ not json").unwrap();
    proxy.reload();
    assert!(
        !proxy
            .wait_for_generation(3, Duration::from_millis(500))
            .await
    );
    let newer = sign(
        &Key::Rs(&r2),
        "RS256",
        Some("2026-02"),
        &claims(&json!({ "sub": "newer" })),
    );
    assert_eq!(status(&http, &url, &newer).await, 200);
}

#[test]
fn missing_or_bad_key_files_are_config_errors_naming_the_key() {
    let keys = Keys::new(&[]);
    let route = "routes:\n  - name: api\n    respond: { status: 200 }\n    limits:\n      \
                 - { name: l, rate: 1/s, key: [jwt:sub, ip] }\n";
    let problems = |identity: &str| {
        let text = config(&format!("{identity}{route}"));
        match tollgate::config::parse(&text) {
            Ok(_) => Vec::new(),
            Err(p) => p
                .into_iter()
                .map(|p| format!("{}: {}", p.path, p.message))
                .collect(),
        }
    };
    assert!(problems(&keys.identity("")).is_empty());
    let missing = keys.dir.path().join("nope.json");
    let p = problems(&format!(
        "identity:\n  jwt:\n    jwks_file: {}\n",
        missing.display()
    ));
    assert!(
        p[0].starts_with("identity.jwt.jwks_file: cannot read"),
        "{p:?}"
    );
    std::fs::write(keys.jwks(), "[]").unwrap();
    let p = problems(&keys.identity(""));
    assert!(
        p[0].starts_with("identity.jwt.jwks_file: not a JWKS"),
        "{p:?}"
    );
    std::fs::write(keys.secret(), "short").unwrap();
    let p = problems(&format!(
        "identity:\n  jwt:\n    hs256_secret_file: {}\n",
        keys.secret().display()
    ));
    assert!(
        p[0].starts_with("identity.jwt.hs256_secret_file: the HS256 secret has 5 bytes"),
        "{p:?}"
    );
    // A `jwt:` source without `identity.jwt` would never be present.
    let p = problems("");
    assert!(
        p[0].contains("key[0]") && p[0].contains("needs `identity.jwt`"),
        "{p:?}"
    );
}
