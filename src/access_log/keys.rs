//! `tollgate.keys`: the digests of the identity sources a request's limits read, rendered as
//! the members of a JSON object for the access log, so that traffic can be replayed
//! (`tollgate simulate`) without any raw value in the log.

use smallvec::SmallVec;

use crate::identity::logged::{self, Logged};
use crate::identity::{RequestView, Source};

/// What the line says of a request's logged sources, in the order `logged_sources` gives them:
/// what the request path keeps (no names, inline for two sources).
pub type Digests = SmallVec<[Logged; 2]>;

/// The members of `tollgate.keys`, `"header:x-api-key":"0123456789abcdef","cookie:sid":null`:
/// a digest for a source the request carries, `null` for one it does not. Inline up to two
/// header sources: a route's limits read one or two.
#[derive(Debug, Clone, Default)]
pub struct Keys {
    members: SmallVec<[u8; 80]>,
}

/// Each source of `sources` (each limit's key and exemption sources, repeats allowed) whose
/// digest the line carries, once, in order: those the line does not hold already.
fn logged_sources<'a>(
    sources: impl Iterator<Item = &'a Source> + Clone,
) -> impl Iterator<Item = &'a Source> {
    let earlier = sources.clone();
    sources.enumerate().filter_map(move |(i, source)| {
        let first = !earlier.clone().take(i).any(|s| s == source);
        (first && logged::is_logged(source)).then_some(source)
    })
}

impl Keys {
    /// The digests of a request decided against limits reading `sources`.
    pub fn digests<'a>(
        sources: impl Iterator<Item = &'a Source> + Clone,
        view: &RequestView<'_>,
    ) -> Digests {
        logged_sources(sources)
            .map(|s| view.logged_digest(s))
            .collect()
    }

    /// The members of `digests`, taken by `digests` from the same `sources`.
    pub fn render<'a>(
        sources: impl Iterator<Item = &'a Source> + Clone,
        digests: &Digests,
    ) -> Self {
        let mut keys = Self::default();
        for (source, digest) in logged_sources(sources).zip(digests) {
            keys.push(source, *digest);
        }
        keys
    }

    /// The rendered members (without braces).
    pub(super) fn members(&self) -> &[u8] {
        &self.members
    }

    fn push(&mut self, source: &Source, digest: Logged) {
        let out = &mut self.members;
        if digest == Logged::Unknown {
            return;
        }
        if !out.is_empty() {
            out.push(b',');
        }
        out.push(b'"');
        let (kind, name) = match source {
            Source::Header(n) => ("header:", n.as_str()),
            Source::Query(n) => ("query:", n.as_str()),
            Source::Cookie(n) => ("cookie:", n.as_str()),
            Source::Jwt(n) => ("jwt:", n.as_str()),
            _ => ("bearer", ""),
        };
        out.extend_from_slice(kind.as_bytes());
        escaped(out, name.as_bytes());
        out.extend_from_slice(b"\":");
        match digest {
            Logged::Digest(d) => {
                out.push(b'"');
                push_hex64(out, d);
                out.push(b'"');
            }
            Logged::Absent | Logged::Unknown => out.extend_from_slice(b"null"),
        }
    }
}

/// A name from the config (a query parameter, cookie or claim may hold anything) as the
/// inside of a JSON string.
fn escaped(out: &mut SmallVec<[u8; 80]>, name: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for &c in name {
        match c {
            b'"' | b'\\' => out.extend_from_slice(&[b'\\', c]),
            0..0x20 | 0x7f => {
                out.extend_from_slice(b"\\u00");
                out.push(DIGITS[usize::from(c >> 4)]);
                out.push(DIGITS[usize::from(c & 15)]);
            }
            c => out.push(c),
        }
    }
}

fn push_hex64(out: &mut SmallVec<[u8; 80]>, n: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = [0u8; 16];
    for (i, d) in hex.iter_mut().enumerate() {
        *d = DIGITS[(n >> (4 * (15 - i))) as usize & 15];
    }
    out.extend_from_slice(&hex);
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, Method, Uri};

    #[test]
    fn sources_are_written_once_with_null_when_absent_and_names_escaped() {
        let (m, u) = (Method::GET, Uri::from_static("/x"));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "k1".parse().unwrap());
        let view = RequestView {
            method: &m,
            uri: &u,
            headers: &h,
            client_ip: "192.0.2.1".parse().unwrap(),
            jwt: None,
        };
        let sources = [
            Source::parse("header:X-API-Key").unwrap(),
            Source::Ip(64),
            Source::parse("header:x-api-key").unwrap(),
            Source::Cookie("a\"b".into()),
        ];
        let digests = Keys::digests(sources.iter(), &view);
        assert_eq!(digests.len(), 2);
        assert!(!digests.spilled());
        let keys = Keys::render(sources.iter(), &digests);
        let text = format!(
            "{{{}}}",
            String::from_utf8(keys.members().to_vec()).unwrap()
        );
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let want = format!("{:016x}", logged::digest(b"k1"));
        assert_eq!(v["header:x-api-key"], want.as_str(), "{text}");
        assert!(v["cookie:a\"b"].is_null(), "{text}");
        assert_eq!(v.as_object().unwrap().len(), 2, "{text}");
        assert!(
            !keys.members.spilled(),
            "one header and one cookie fit inline"
        );
    }
}
