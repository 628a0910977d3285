//! `tollgate.keys`: the digests of the identity sources a request's limits read, rendered as
//! the members of a JSON object for the access log, so that traffic can be replayed
//! (`tollgate simulate`) without any raw value in the log.

use smallvec::SmallVec;

use crate::identity::logged::{self, Logged};
use crate::identity::{RequestView, Source};

/// What the line says of a request's logged sources, in `KeySources` order: what the request
/// path keeps (no names, inline for two sources).
pub type Digests = SmallVec<[Logged; 2]>;

/// A route's logged sources, each once, with its member name (`"header:x-api-key":`) rendered
/// when the config is built: a request then pays for its digests and a copy, no more.
#[derive(Debug, Clone, Default)]
pub struct KeySources {
    sources: Vec<(Source, Box<[u8]>)>,
}

/// The members of `tollgate.keys`, `"header:x-api-key":"0123456789abcdef","cookie:sid":null`:
/// a digest for a source the request carries, `null` for one it does not. Inline up to two
/// header sources: a route's limits read one or two.
#[derive(Debug, Clone, Default)]
pub struct Keys {
    members: SmallVec<[u8; 80]>,
}

impl KeySources {
    /// The sources of `sources` (each limit's key and exemption sources, repeats allowed)
    /// whose digests a line carries: those the line does not hold already.
    pub fn of<'a>(sources: impl Iterator<Item = &'a Source>) -> Self {
        let mut out: Vec<(Source, Box<[u8]>)> = Vec::new();
        for source in sources {
            if logged::is_logged(source) && !out.iter().any(|(s, _)| s == source) {
                out.push((source.clone(), name(source)));
            }
        }
        Self { sources: out }
    }

    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// What the line says of these sources in one request.
    pub fn digests(&self, view: &RequestView<'_>) -> Digests {
        self.sources
            .iter()
            .map(|(s, _)| view.logged_digest(s))
            .collect()
    }

    /// The members of `digests`, as `digests` gave them.
    pub fn render(&self, digests: &Digests) -> Keys {
        let mut out = SmallVec::new();
        for ((_, name), digest) in self.sources.iter().zip(digests) {
            let mut value = [0u8; 18];
            let value: &[u8] = match digest {
                Logged::Digest(d) => {
                    value[0] = b'"';
                    hex64(&mut value[1..17], *d);
                    value[17] = b'"';
                    &value
                }
                Logged::Absent => b"null",
                Logged::Unknown => continue,
            };
            if !out.is_empty() {
                out.push(b',');
            }
            out.extend_from_slice(name);
            out.extend_from_slice(value);
        }
        Keys { members: out }
    }
}

impl Keys {
    /// The rendered members (without braces).
    pub(super) fn members(&self) -> &[u8] {
        &self.members
    }
}

/// `"NAME":` of a logged source, its name escaped (a query parameter, cookie or claim of the
/// config may hold anything).
fn name(source: &Source) -> Box<[u8]> {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = b"\"".to_vec();
    for c in source.to_string().bytes() {
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
    out.extend_from_slice(b"\":");
    out.into_boxed_slice()
}

fn hex64(out: &mut [u8], n: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (i, d) in out.iter_mut().take(16).enumerate() {
        *d = DIGITS[(n >> (4 * (15 - i))) as usize & 15];
    }
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
        let route = KeySources::of(sources.iter());
        let digests = route.digests(&view);
        assert_eq!(digests.len(), 2);
        assert!(!digests.spilled());
        let keys = route.render(&digests);
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
        assert!(KeySources::of([Source::Ip(64), Source::Global].iter()).is_empty());
    }
}
