//! Host and `:authority` checked and canonicalised: a reg-name or an IPv6 literal with an
//! optional port 1-65535 (RFC 3986 3.2.2-3.2.3), anything else `400`; the name lower-cased and
//! one trailing dot dropped, so routes, limits and the backend read one spelling of the host.
//!
//! Stricter than RFC 3986's reg-name on purpose: it allows sub-delims (`,`, `;`, `=`, `&`, ...)
//! and percent-encoding, which no DNS name carries and which backends split or decode in ways
//! of their own (a comma list is two hosts to one backend and a single odd name to the next).
//! A name here is letters, digits, `-`, `_` and dots between non-empty labels, at most 253
//! characters (RFC 1035 2.3.4); `_` is kept for internal names (Docker, Consul).

use std::fmt::Write as _;
use std::net::Ipv6Addr;

use http::header::HOST;
use http::uri::Authority;
use http::{HeaderValue, Request, Uri, Version};

use crate::error::ProxyError;

/// The longest name DNS can carry as text (RFC 1035 2.3.4: 255 octets on the wire).
const MAX_NAME: usize = 253;

/// A valid Host (or authority) value, taken apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostParts<'a> {
    /// The name as sent without its one trailing dot (case kept), or the IPv6 literal
    /// without its brackets.
    pub name: &'a [u8],
    /// The parsed IPv6 address of a literal (`[::1]`).
    pub ip: Option<Ipv6Addr>,
    pub port: Option<u16>,
    /// Already in canonical form: a lower-case name without a trailing dot, an address as
    /// RFC 5952 writes it, a port without leading zeros. The common case: nothing to rewrite.
    pub canonical: bool,
}

impl HostParts<'_> {
    /// The canonical spelling: `known.example:8080`, `[2001:db8::1]`.
    pub fn canonical(&self) -> String {
        let mut s = match self.ip {
            Some(ip) => format!("[{ip}]"),
            // ASCII by now (`reg_name`): each byte is its own character.
            None => self
                .name
                .iter()
                .map(|&b| char::from(b.to_ascii_lowercase()))
                .collect(),
        };
        if let Some(port) = self.port {
            let _ = write!(s, ":{port}");
        }
        s
    }

    /// The same host and port, whatever the spelling.
    pub fn same_as(&self, other: &HostParts<'_>) -> bool {
        self.port == other.port
            && match (self.ip, other.ip) {
                (Some(a), Some(b)) => a == b,
                (None, None) => self.name.eq_ignore_ascii_case(other.name),
                _ => false,
            }
    }
}

/// Take a Host value apart; `None` when it is not a valid one (`a b`, `a@b`, `a:x`,
/// `a:99999`, `a/b`, `[::1`, `a,b`, an empty name, an empty port).
pub fn parse_host(value: &[u8]) -> Option<HostParts<'_>> {
    let (name, ip, rest, mut canonical) = if let Some(inner) = value.strip_prefix(b"[") {
        // Not UTF-8 is not ASCII either: no host has such bytes.
        let (addr, rest) = std::str::from_utf8(inner).ok()?.split_once(']')?;
        // std's parser takes RFC 4291 text only: no zone (`%25eth0`), no IPvFuture.
        let ip: Ipv6Addr = addr.parse().ok()?;
        (
            addr.as_bytes(),
            Some(ip),
            rest.as_bytes(),
            written_as_rfc5952(ip, addr),
        )
    } else {
        // On bytes, in one pass each: a name is checked byte by byte anyway.
        let colon = memchr::memchr(b':', value).unwrap_or(value.len());
        let (name, rest) = value.split_at(colon);
        let (name, canonical) = reg_name(name)?;
        (name, None, rest, canonical)
    };
    let port = match rest {
        [] => None,
        [b':', digits @ ..] => {
            let (port, plain) = port(digits)?;
            canonical &= plain;
            Some(port)
        }
        _ => return None,
    };
    Some(HostParts {
        name,
        ip,
        port,
        canonical,
    })
}

/// What a byte of a name is: one of these flags ([`CLASS`]).
const NAME: u8 = 1;
const UPPER: u8 = 2;
const DOT: u8 = 4;
const BAD: u8 = 8;

/// Each byte's class in a name: letters, digits, `-` and `_` make labels, dots separate them,
/// anything else is refused.
static CLASS: [u8; 256] = {
    let mut table = [BAD; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = match c {
            b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' => NAME,
            b'A'..=b'Z' => UPPER,
            b'.' => DOT,
            _ => BAD,
        };
        b += 1;
    }
    table
};

/// A name (without the port): returns it without its one trailing dot, and whether it was
/// canonical already (no upper case, no trailing dot).
fn reg_name(name: &[u8]) -> Option<(&[u8], bool)> {
    let (bare, dot) = match name.strip_suffix(b".") {
        Some(bare) => (bare, true),
        None => (name, false),
    };
    if bare.is_empty() || bare.len() > MAX_NAME {
        return None;
    }
    // One table lookup a byte, no branch: what the name holds is gathered, then judged.
    let (mut seen, mut prev, mut empty) = (0u8, DOT, 0u8);
    for &b in bare {
        let class = CLASS[usize::from(b)];
        seen |= class;
        // A leading dot and `..` are empty labels.
        empty |= class & prev;
        prev = class;
    }
    // So is a second trailing dot.
    empty |= prev;
    if seen & BAD != 0 || empty & DOT != 0 {
        return None;
    }
    let upper = seen & UPPER != 0;
    Some((bare, !(dot || upper)))
}

/// A port of 1-5 digits, 1-65535 (port 0 names no service); and whether it had no leading
/// zero.
fn port(digits: &[u8]) -> Option<(u16, bool)> {
    if digits.is_empty() || digits.len() > 5 {
        return None;
    }
    let mut port = 0u32;
    for &b in digits {
        if !b.is_ascii_digit() {
            return None;
        }
        port = port * 10 + u32::from(b - b'0');
    }
    let port = u16::try_from(port).ok().filter(|&p| p != 0)?;
    Some((port, digits[0] != b'0'))
}

/// Whether `text` is the RFC 5952 spelling of `ip` (what `Ipv6Addr`'s `Display` writes).
fn written_as_rfc5952(ip: Ipv6Addr, text: &str) -> bool {
    // At most 39 characters ("ffff:" eight times less one colon), 45 for a mapped IPv4.
    let mut buf = [0u8; 48];
    let mut cursor = std::io::Cursor::new(&mut buf[..]);
    if std::io::Write::write_fmt(&mut cursor, format_args!("{ip}")).is_err() {
        return false;
    }
    let len = usize::try_from(cursor.position()).unwrap_or(0);
    buf[..len] == *text.as_bytes()
}

/// Check the request's Host header and authority, refuse what is malformed, missing or in
/// disagreement, and rewrite what is not in canonical form. RFC 9112 3.2: an HTTP/1.1 request
/// without Host, or with more than one, is `400`. RFC 9113 8.3.1: an HTTP/2 request carries
/// `:authority` or Host, and the two agree; userinfo has no place in either (RFC 9110 4.2.4,
/// RFC 9113 8.3.1).
pub(super) fn screen<B>(req: &mut Request<B>) -> Result<(), ProxyError> {
    let mut hosts = req.headers().get_all(HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(ProxyError::BadRequest);
    }
    let version = req.version();
    // Origin-form targets (nearly every HTTP/1.1 request) have no authority: no parse.
    let authority = req.uri().authority();
    if host.is_none()
        && (version == Version::HTTP_11 || (version == Version::HTTP_2 && authority.is_none()))
    {
        return Err(ProxyError::BadRequest);
    }
    let from_header = match host {
        Some(h) => Some(parse_host(h.as_bytes()).ok_or(ProxyError::BadRequest)?),
        None => None,
    };
    let from_authority = match authority {
        Some(a) => Some(parse_host(a.as_str().as_bytes()).ok_or(ProxyError::BadRequest)?),
        None => None,
    };
    // Routing reads one, the backend may read the other: a mismatch would let a request take
    // one host's limits to another host.
    if let (Some(h), Some(a)) = (&from_header, &from_authority) {
        if !h.same_as(a) {
            return Err(ProxyError::BadRequest);
        }
    }
    let new_host = from_header.filter(|h| !h.canonical).map(|h| h.canonical());
    let new_authority = from_authority
        .filter(|a| !a.canonical)
        .map(|a| a.canonical());
    if let Some(host) = new_host {
        let value = HeaderValue::try_from(host).map_err(|_| ProxyError::BadRequest)?;
        req.headers_mut().insert(HOST, value);
    }
    if let Some(authority) = new_authority {
        let mut parts = req.uri().clone().into_parts();
        parts.authority = Some(Authority::try_from(authority).map_err(|_| ProxyError::BadRequest)?);
        *req.uri_mut() = Uri::from_parts(parts).map_err(|_| ProxyError::BadRequest)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(s: &str) -> Option<String> {
        parse_host(s.as_bytes()).map(|h| h.canonical())
    }

    #[test]
    fn valid_hosts_and_their_canonical_form() {
        for (raw, want, already) in [
            ("known.example", "known.example", true),
            ("Known.Example", "known.example", false),
            ("known.example.", "known.example", false),
            ("known.example:8080", "known.example:8080", true),
            ("KNOWN.example.:08080", "known.example:8080", false),
            ("127.0.0.1:80", "127.0.0.1:80", true),
            ("[::1]", "[::1]", true),
            ("[::1]:443", "[::1]:443", true),
            ("[0:0::1]", "[::1]", false),
            ("[2001:DB8::1]", "[2001:db8::1]", false),
            ("in_ternal-1.svc", "in_ternal-1.svc", true),
            ("a:65535", "a:65535", true),
        ] {
            let parts = parse_host(raw.as_bytes()).unwrap_or_else(|| panic!("{raw} refused"));
            assert_eq!(parts.canonical(), want, "{raw}");
            assert_eq!(parts.canonical, already, "{raw}");
            assert_eq!(
                canonical(want).as_deref(),
                Some(want),
                "{want} is a fixed point"
            );
        }
    }

    #[test]
    fn malformed_hosts_are_refused() {
        for bad in [
            "",
            "a b",
            "a@b",
            "u:p@b",
            "a:notaport",
            "a:99999",
            "a:0",
            "a:",
            "a:-1",
            "a/b",
            "a\\b",
            "[::1",
            "[::1]x",
            "::1",
            "a,b",
            "a, b",
            ".a",
            "a..b",
            "a..",
            ".",
            "a:1:2",
            "[v1.x]",
            "[fe80::1%25eth0]",
            "[127.0.0.1]",
            "a%2eb",
            "caf\u{e9}",
            "a;b",
            "*",
            "a\tb",
        ] {
            assert!(parse_host(bad.as_bytes()).is_none(), "{bad:?} accepted");
        }
        assert!(parse_host(&[b'a', 0x80]).is_none());
        let long = "a".repeat(254);
        assert!(parse_host(long.as_bytes()).is_none());
        assert!(parse_host(format!("{}.", &long[1..]).as_bytes()).is_some());
    }

    #[test]
    fn spellings_of_one_host_agree() {
        fn p(s: &str) -> HostParts<'_> {
            parse_host(s.as_bytes()).unwrap()
        }
        assert!(p("Known.Example.").same_as(&p("known.example")));
        assert!(p("a:080").same_as(&p("a:80")));
        assert!(!p("a").same_as(&p("a:80")));
        assert!(p("[::1]").same_as(&p("[0::1]")));
        assert!(!p("[::1]").same_as(&p("a")));
    }
}
