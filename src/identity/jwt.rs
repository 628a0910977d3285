//! Verified identities: the claims of a bearer JWT whose signature, `exp`/`nbf` and, when
//! configured, `iss`/`aud` check out, read by the `jwt:CLAIM` key sources.
//!
//! `jsonwebtoken` parses and validates tokens and JWKS; its signature checks run on ring
//! through the small `CryptoProvider` below, because its own backends (aws-lc-rs, RustCrypto)
//! would be a second crypto library next to the ring rustls already uses.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use jsonwebtoken::crypto::{CryptoProvider, JwtSigner, JwtVerifier, KeyUtils};
use jsonwebtoken::errors::{Error, ErrorKind};
use jsonwebtoken::jwk::{JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey, DecodingKeyKind, Validation};
use serde_json::{Map, Value};

/// Longest token verified: a longer one is absent (bounds the cost a client can make us pay).
pub const MAX_TOKEN_BYTES: usize = 8 << 10;

/// How far `exp` and `nbf` may be off when `leeway` is not configured.
pub const DEFAULT_LEEWAY: Duration = Duration::from_mins(1);

/// The algorithms tokens may be signed with.
const ALGORITHMS: [Algorithm; 3] = [Algorithm::HS256, Algorithm::RS256, Algorithm::ES256];

/// One key a token can be verified with.
struct Key {
    kid: Option<String>,
    alg: Algorithm,
    decoding: DecodingKey,
    /// `alg` alone, the leeway, issuers and audiences.
    validation: Validation,
}

/// The configured keys and checks (`identity.jwt`). Built when the config is compiled, so a
/// reload re-reads the secret and JWKS files.
pub struct Verifier {
    keys: Vec<Key>,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<_> = self.keys.iter().map(|k| (&k.kid, k.alg)).collect();
        f.debug_struct("Verifier").field("keys", &keys).finish()
    }
}

/// What `identity.jwt` says, its files already read.
#[derive(Debug, Default)]
pub struct Options<'a> {
    /// The HS256 shared secret (the file's bytes, one trailing newline removed).
    pub hs256_secret: Option<&'a [u8]>,
    /// A JWKS document (`{"keys": [...]}`) of RS256 and ES256 (P-256) public keys.
    pub jwks: Option<&'a [u8]>,
    pub issuers: &'a [String],
    pub audiences: &'a [String],
    pub leeway: Option<Duration>,
}

impl Verifier {
    /// The verifier of `options`, or why its keys cannot be used.
    // Each key source (secret, JWKS file) with its validation, in the order they apply.
    #[allow(clippy::too_many_lines)]
    pub fn new(options: &Options<'_>) -> Result<Self, String> {
        install_provider();
        let mut keys = Vec::new();
        let validation = |alg| {
            let mut v = Validation::new(alg);
            v.leeway = options.leeway.unwrap_or(DEFAULT_LEEWAY).as_secs();
            v.validate_nbf = true;
            // A configured check needs its claim: a token without `iss` or `aud` fails it.
            let mut required = vec!["exp"];
            if options.issuers.is_empty() {
                v.iss = None;
            } else {
                v.set_issuer(options.issuers);
                required.push("iss");
            }
            if options.audiences.is_empty() {
                // No audience asked for: a token's `aud`, if any, is not checked.
                v.validate_aud = false;
            } else {
                v.set_audience(options.audiences);
                required.push("aud");
            }
            v.set_required_spec_claims(&required);
            v
        };
        if let Some(secret) = options.hs256_secret {
            let secret = secret.strip_suffix(b"\n").unwrap_or(secret);
            let secret = secret.strip_suffix(b"\r").unwrap_or(secret);
            if secret.len() < 32 {
                return Err(format!(
                    "the HS256 secret has {} bytes; at least 32 are needed",
                    secret.len()
                ));
            }
            keys.push(Key {
                kid: None,
                alg: Algorithm::HS256,
                decoding: DecodingKey::from_secret(secret).map_err(|e| e.to_string())?,
                validation: validation(Algorithm::HS256),
            });
        }
        if let Some(jwks) = options.jwks {
            let set: JwkSet = serde_json::from_slice(jwks)
                .map_err(|e| format!("not a JWKS document (`{{\"keys\": [...]}}`): {e}"))?;
            for (i, jwk) in set.keys.iter().enumerate() {
                let alg = match (jwk.common.key_algorithm, &jwk.algorithm) {
                    (Some(KeyAlgorithm::RS256), _)
                    | (None, jsonwebtoken::jwk::AlgorithmParameters::RSA(_)) => Algorithm::RS256,
                    (Some(KeyAlgorithm::ES256), _) => Algorithm::ES256,
                    (None, jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(p))
                        if p.curve == jsonwebtoken::jwk::EllipticCurve::P256 =>
                    {
                        Algorithm::ES256
                    }
                    _ => {
                        return Err(format!(
                            "key {i} of the JWKS is neither RS256 (RSA) nor ES256 (P-256)"
                        ))
                    }
                };
                let key =
                    DecodingKey::from_jwk(jwk).map_err(|e| format!("key {i} of the JWKS: {e}"))?;
                if key.family() != alg.family() {
                    return Err(format!("key {i} of the JWKS is not a key for {alg:?}"));
                }
                keys.push(Key {
                    kid: jwk.common.key_id.clone(),
                    alg,
                    decoding: key,
                    validation: validation(alg),
                });
            }
        }
        if keys.is_empty() {
            return Err("no keys: set `hs256_secret_file` or `jwks_file` (with keys)".into());
        }
        Ok(Self { keys })
    }

    /// The claims of `token` if it verifies: a key of its `alg` (the one its `kid` names, or
    /// each of that algorithm without a `kid`) signed it, and its times, issuer and audience
    /// pass. `None` for every failure: the source is absent.
    pub fn verify(&self, token: &str) -> Option<Claims> {
        if token.len() > MAX_TOKEN_BYTES {
            return None;
        }
        let header = jsonwebtoken::decode_header(token).ok()?;
        if !ALGORITHMS.contains(&header.alg) {
            return None;
        }
        self.keys
            .iter()
            .filter(|k| k.alg == header.alg)
            .filter(|k| header.kid.is_none() || k.kid.is_none() || k.kid == header.kid)
            .find_map(|k| {
                jsonwebtoken::decode::<Map<String, Value>>(token, &k.decoding, &k.validation).ok()
            })
            .map(|data| Claims(data.claims))
    }
}

/// A verified token's claims.
#[derive(Debug)]
pub struct Claims(Map<String, Value>);

impl Claims {
    /// Claim `name` as bytes: a string as is, a number in its JSON form; anything else (or
    /// nothing) is absent.
    pub fn get(&self, name: &str) -> Option<std::borrow::Cow<'_, [u8]>> {
        match self.0.get(name)? {
            Value::String(s) => Some(std::borrow::Cow::Borrowed(s.as_bytes())),
            Value::Number(n) => Some(std::borrow::Cow::Owned(n.to_string().into_bytes())),
            _ => None,
        }
    }
}

/// One request's token, verified at most once however many limits read its claims.
#[derive(Debug)]
pub struct Context<'a> {
    verifier: &'a Verifier,
    token: Option<&'a str>,
    verified: OnceLock<Option<Claims>>,
}

impl<'a> Context<'a> {
    /// The context of a request whose bearer token (if any) is `token`.
    pub fn new(verifier: &'a Verifier, token: Option<&'a str>) -> Self {
        Self {
            verifier,
            token,
            verified: OnceLock::new(),
        }
    }

    /// The verified claims, or `None` when there is no token or it does not verify.
    pub fn claims(&self) -> Option<&Claims> {
        self.verified
            .get_or_init(|| self.token.and_then(|t| self.verifier.verify(t)))
            .as_ref()
    }

    /// Whether the token was verified already (or there is none): then `claims` costs nothing.
    pub fn is_settled(&self) -> bool {
        self.token.is_none() || self.verified.get().is_some()
    }
}

/// Shared by every runtime: the verifier of the config it was built from.
pub type Shared = Arc<Verifier>;

/// Make ring the process's JWT crypto (once; a provider installed before is kept).
fn install_provider() {
    static RING: CryptoProvider = CryptoProvider {
        signer_factory: no_signer,
        verifier_factory: ring_verifier,
        key_utils: KeyUtils {
            rsa_pub_components_from_private_key: |_| Err(ErrorKind::InvalidKeyFormat.into()),
            rsa_pub_components_from_public_key: |_| Err(ErrorKind::InvalidKeyFormat.into()),
            ec_pub_components_from_private_key: |_, _| Err(ErrorKind::InvalidKeyFormat.into()),
            ed_pub_components_from_private_key: |_, _| Err(ErrorKind::InvalidKeyFormat.into()),
            compute_digest: |data, hash| {
                let alg = match hash {
                    jsonwebtoken::jwk::ThumbprintHash::SHA256 => &ring::digest::SHA256,
                    jsonwebtoken::jwk::ThumbprintHash::SHA384 => &ring::digest::SHA384,
                    jsonwebtoken::jwk::ThumbprintHash::SHA512 => &ring::digest::SHA512,
                    _ => return Err(ErrorKind::InvalidAlgorithm.into()),
                };
                Ok(ring::digest::digest(alg, data).as_ref().to_vec())
            },
        },
    };
    let _ = RING.install_default();
}

/// tollgate only verifies.
#[allow(clippy::trivially_copy_pass_by_ref)] // The signature `CryptoProvider` asks for.
fn no_signer(_: &Algorithm, _: &jsonwebtoken::EncodingKey) -> Result<Box<dyn JwtSigner>, Error> {
    Err(ErrorKind::InvalidAlgorithm.into())
}

#[allow(clippy::trivially_copy_pass_by_ref)] // The signature `CryptoProvider` asks for.
fn ring_verifier(alg: &Algorithm, key: &DecodingKey) -> Result<Box<dyn JwtVerifier>, Error> {
    // An HS256 secret never checks an RS256 or ES256 signature, nor the other way round.
    if key.family() != alg.family() || !ALGORITHMS.contains(alg) {
        return Err(ErrorKind::InvalidAlgorithm.into());
    }
    let check = match (alg, key.kind()) {
        (Algorithm::HS256, DecodingKeyKind::SecretOrDer(secret)) => {
            Check::Hmac(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret))
        }
        (Algorithm::RS256, DecodingKeyKind::RsaModulusExponent { n, e }) => Check::Rsa {
            n: n.clone(),
            e: e.clone(),
        },
        (Algorithm::ES256, DecodingKeyKind::SecretOrDer(point)) => Check::Ec(point.clone()),
        _ => return Err(ErrorKind::InvalidKeyFormat.into()),
    };
    Ok(Box::new(RingVerifier { alg: *alg, check }))
}

enum Check {
    Hmac(ring::hmac::Key),
    Rsa {
        n: Vec<u8>,
        e: Vec<u8>,
    },
    /// The uncompressed P-256 point.
    Ec(Vec<u8>),
}

struct RingVerifier {
    alg: Algorithm,
    check: Check,
}

impl jsonwebtoken::signature::Verifier<Vec<u8>> for RingVerifier {
    fn verify(&self, msg: &[u8], sig: &Vec<u8>) -> Result<(), jsonwebtoken::signature::Error> {
        let ok = match &self.check {
            Check::Hmac(key) => ring::hmac::verify(key, msg, sig).is_ok(),
            Check::Rsa { n, e } => ring::signature::RsaPublicKeyComponents { n, e }
                .verify(&ring::signature::RSA_PKCS1_2048_8192_SHA256, msg, sig)
                .is_ok(),
            Check::Ec(point) => ring::signature::UnparsedPublicKey::new(
                &ring::signature::ECDSA_P256_SHA256_FIXED,
                point,
            )
            .verify(msg, sig)
            .is_ok(),
        };
        if ok {
            Ok(())
        } else {
            Err(jsonwebtoken::signature::Error::new())
        }
    }
}

impl JwtVerifier for RingVerifier {
    fn algorithm(&self) -> Algorithm {
        self.alg
    }
}
