//! What identities are read from: one request's parts (`Arrival`, made once per request),
//! the view a route's limits read (`RequestView`), and each source's value in it.

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::OnceLock;

use http::header::{AUTHORIZATION, COOKIE};
use http::{HeaderMap, Method, Uri};
use percent_encoding::percent_decode_str;

use super::digest::{alternative_digest, digest_source, global_digest, ip_digest, ip_octets};
use super::{
    host, jwt, value_digest, without_trailing_slash, ClientId, Exemption, KeySpec, Source,
};

/// One request as limits, exemptions and operators' entries read it: made once per request
/// (`proxy`, `explain`) and shared by the live decision and the candidate config's, so both
/// read the same client, path and token.
#[derive(Debug)]
pub struct Arrival<'a> {
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
    /// The client address, already resolved through trusted proxies.
    pub client_ip: IpAddr,
    /// `uri` with its path lower-cased, made on first use by a case-insensitive route.
    folded: OnceLock<Uri>,
}

impl<'a> Arrival<'a> {
    pub fn of<B>(req: &'a http::Request<B>, client_ip: IpAddr) -> Self {
        Self {
            method: req.method(),
            uri: req.uri(),
            headers: req.headers(),
            client_ip,
            folded: OnceLock::new(),
        }
    }

    /// The URI a route's limits read: its path lower-cased where the route compares paths
    /// without case (`fold`), so `/Admin` counts where `/admin` does.
    pub fn uri(&self, fold: bool) -> &Uri {
        if fold && self.uri.path().bytes().any(|b| b.is_ascii_uppercase()) {
            self.folded.get_or_init(|| fold_path(self.uri))
        } else {
            self.uri
        }
    }

    /// The request's bearer JWT for `verifier`, verified on first use.
    pub fn jwt<'v>(&self, verifier: &'v jwt::Verifier) -> jwt::Context<'v>
    where
        'a: 'v,
    {
        jwt::Context::new(verifier, bearer(self.headers))
    }

    /// What one route's limits read: the URI as `uri(fold)`, and `jwt`, the context of the
    /// config whose limits these are (the candidate's verifier may not be the live one).
    pub fn view<'s>(&'s self, fold: bool, jwt: Option<&'s jwt::Context<'s>>) -> RequestView<'s> {
        RequestView {
            method: self.method,
            uri: self.uri(fold),
            headers: self.headers,
            client_ip: self.client_ip,
            jwt,
        }
    }
}

/// The parts of a request identities are read from.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    pub method: &'a Method,
    pub uri: &'a Uri,
    pub headers: &'a HeaderMap,
    /// The client address, already resolved through trusted proxies.
    pub client_ip: IpAddr,
    /// The request's bearer JWT, verified on first use; `None` without `identity.jwt`.
    pub jwt: Option<&'a jwt::Context<'a>>,
}

impl<'a> RequestView<'a> {
    /// The value of one source, or `None` when the request does not carry it (empty values
    /// count as absent: an empty API key identifies nobody).
    pub(super) fn value(&self, source: &Source) -> Option<Value<'a>> {
        let v = match source {
            Source::Ip(v6_prefix) => {
                let (bytes, len) = ip_octets(self.client_ip, *v6_prefix);
                Value::Octets(bytes, len)
            }
            Source::Header(name) => Value::Borrowed(self.headers.get(name)?.as_bytes()),
            Source::Query(name) => match query_param(self.uri.query()?, name)? {
                Cow::Borrowed(v) => Value::Borrowed(v),
                Cow::Owned(v) => Value::Owned(v),
            },
            Source::Cookie(name) => Value::Borrowed(cookie(self.headers, name)?.as_bytes()),
            Source::Bearer => Value::Borrowed(bearer(self.headers)?.as_bytes()),
            Source::Global => Value::Borrowed(b"global"),
            Source::Host => Value::Owned(
                host(self.uri, self.headers)?
                    .to_ascii_lowercase()
                    .into_bytes(),
            ),
            Source::Method => Value::Borrowed(self.method.as_str().as_bytes()),
            // As exact `path` routes compare it: `/login/` is `/login`'s bucket.
            Source::Path => Value::Borrowed(without_trailing_slash(self.uri.path()).as_bytes()),
            // A token that fails verification has no claims: the next alternative applies.
            Source::Jwt(claim) => match self.jwt?.claims()?.get(claim)? {
                Cow::Borrowed(v) => Value::Borrowed(v),
                Cow::Owned(v) => Value::Owned(v),
            },
        };
        (!v.is_empty()).then_some(v)
    }

    /// The identity `spec` gives this request: the digest of its first present alternative,
    /// or the `anonymous` bucket.
    pub fn resolve(&self, spec: &KeySpec) -> ClientId {
        'alternatives: for (i, alt) in spec.0.iter().enumerate() {
            if let [Source::Ip(v6_prefix)] = alt.0[..] {
                // The most common key: the same address again and again (every request of a
                // connection), so its digest is remembered.
                let (bytes, len) = ip_octets(self.client_ip, v6_prefix);
                return ip_digest(i as u8, bytes, len);
            }
            if let [Source::Global] = alt.0[..] {
                // A limit all clients share: the same digest for every request.
                return global_digest(i as u8);
            }
            let mut h = alternative_digest(i as u8);
            for source in &alt.0 {
                let Some(v) = self.value(source) else {
                    continue 'alternatives;
                };
                digest_source(&mut h, source.tag(), &v);
            }
            return ClientId::from_hasher(&h);
        }
        ClientId::anonymous()
    }

    /// Whether the request's value of `source` has `digest` (`value_digest`): how an
    /// operator's entry matches a value it keeps only as a digest.
    pub fn has_value_digest(&self, source: &Source, digest: &[u8; 32]) -> bool {
        self.value(source)
            .is_some_and(|v| value_digest(&v) == *digest)
    }

    /// Whether any entry of `exempt` matches this request.
    pub fn is_exempt(&self, exempt: &[Exemption]) -> bool {
        self.exemption(exempt).is_some()
    }

    /// The index of the first entry of `exempt` that matches this request.
    pub fn exemption(&self, exempt: &[Exemption]) -> Option<usize> {
        exempt.iter().position(|e| match e {
            Exemption::Net(net) => net.contains(&self.client_ip),
            Exemption::Equals(source, value) => self
                .value(source)
                .is_some_and(|v| v.as_ref() == value.as_bytes()),
        })
    }

    /// The index of the alternative of `spec` that `resolve` takes (every source present), or
    /// `None` for the `anonymous` bucket.
    pub fn alternative(&self, spec: &KeySpec) -> Option<usize> {
        spec.0
            .iter()
            .position(|alt| alt.0.iter().all(|s| self.value(s).is_some()))
    }
}

/// The value of one source: borrowed from the request, or made for it (an address fits inline,
/// so the common `ip` key allocates nothing).
pub(super) enum Value<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
    Octets([u8; 16], usize),
}

impl std::ops::Deref for Value<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Value::Borrowed(v) => v,
            Value::Owned(v) => v,
            Value::Octets(v, len) => &v[..*len],
        }
    }
}

impl AsRef<[u8]> for Value<'_> {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// `uri` with its path in lower case (query and authority as they are), as the limits of a
/// case-insensitive route read it. Lower-casing ASCII keeps a valid path valid; should it
/// not, the path is read as it came, by the live limits, the candidate's and `explain` alike.
pub fn fold_path(uri: &Uri) -> Uri {
    fold(uri).unwrap_or_else(|| uri.clone())
}

fn fold(uri: &Uri) -> Option<Uri> {
    let path = uri.path().to_ascii_lowercase();
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(http::uri::PathAndQuery::try_from(pq).ok()?);
    Uri::from_parts(parts).ok()
}

/// The decoded value of query parameter `name` (decoded, so `%61` and `a` are one key).
fn query_param<'a>(query: &'a str, name: &str) -> Option<Cow<'a, [u8]>> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (form_decoded(k).as_ref() == name.as_bytes()).then(|| form_decoded(v))
    })
}

/// A query string's key or value decoded as browsers encode forms
/// (`application/x-www-form-urlencoded`): `+` is a space, then percent-decoding. The one
/// decoder of query strings, for identities and the admin API alike.
pub(crate) fn form_decoded(s: &str) -> Cow<'_, [u8]> {
    if s.contains('+') {
        Cow::Owned(percent_decode_str(&s.replace('+', " ")).collect())
    } else {
        percent_decode_str(s).into()
    }
}

fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|line| line.split(';'))
        .find_map(|pair| {
            let (k, v) = pair.trim().split_once('=')?;
            (k.trim() == name).then(|| v.trim().trim_matches('"'))
        })
}

/// The token of an `Authorization: Bearer` header.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}
