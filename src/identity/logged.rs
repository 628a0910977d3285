//! The per-source digests the JSON access log carries, so that `simulate` can replay a limit's
//! identities without the log ever holding an API key, a cookie or a token.

use super::{RequestView, Source};

/// The BLAKE3 key of logged digests: fixed, so that the lines of every replica and every
/// restart agree, and not the bucket keys' scheme, so that a logged digest is never a Redis key.
const KEY: &[u8; 32] = b"tollgate access-log sources v1..";

/// Whether the access log carries `source`'s digest. The address, host, method and path are
/// in every line already (`client.address`, `server.address`, `http.request.method`,
/// `url.path`), and `global` has one value: replay reads those from the line itself.
pub fn is_logged(source: &Source) -> bool {
    matches!(
        source,
        Source::Header(_) | Source::Query(_) | Source::Cookie(_) | Source::Bearer | Source::Jwt(_)
    )
}

/// What an access-log line says of one source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logged {
    /// The digest of the request's value.
    Digest(u64),
    /// The request did not carry the source.
    Absent,
    /// The line does not say.
    Unknown,
}

/// The 64-bit digest of one source's value as the access log writes it (hex, 16 digits).
pub fn digest(value: &[u8]) -> u64 {
    let hash = blake3::keyed_hash(KEY, value);
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_be_bytes(first)
}

impl RequestView<'_> {
    /// What the access log says of `source` in this request: the digest of its value, read
    /// exactly as a limit reads it (decoded, empty meaning absent). `Unknown` for a `jwt:`
    /// claim of a token no limit verified: a log line is not worth a signature check.
    pub fn logged_digest(&self, source: &Source) -> Logged {
        if let (Source::Jwt(_), Some(jwt)) = (source, self.jwt) {
            if !jwt.is_settled() {
                return Logged::Unknown;
            }
        }
        match self.value(source) {
            Some(v) => Logged::Digest(digest(&v)),
            None => Logged::Absent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, Method, Uri};

    #[test]
    fn a_source_is_digested_as_a_limit_reads_it() {
        let (m, u) = (Method::GET, Uri::from_static("/x?key=%61b&empty="));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "secret".parse().unwrap());
        let view = RequestView {
            method: &m,
            uri: &u,
            headers: &h,
            client_ip: "192.0.2.1".parse().unwrap(),
            jwt: None,
        };
        let header = Source::parse("header:X-API-Key").unwrap();
        assert_eq!(
            view.logged_digest(&header),
            Logged::Digest(digest(b"secret"))
        );
        assert_eq!(
            view.logged_digest(&Source::Query("key".into())),
            Logged::Digest(digest(b"ab"))
        );
        assert_eq!(
            view.logged_digest(&Source::Query("empty".into())),
            Logged::Absent
        );
        assert_eq!(view.logged_digest(&Source::Bearer), Logged::Absent);
        assert_ne!(digest(b"secret"), digest(b"secret2"));
        assert!(is_logged(&header) && !is_logged(&Source::Ip(64)));
    }
}
