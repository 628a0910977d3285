//! Who is asking: the client address behind trusted proxies, and the identity a limit counts.
//!
//! An identity is never kept raw: the values of its sources are fed into BLAKE3 and the first
//! 128 bits of the digest are the bucket key, locally and in Redis alike. So API keys and tokens
//! never sit in memory maps, Redis keys or logs, and a client cannot choose what its key looks
//! like (no key injection, no chosen Redis Cluster hash tag).

use std::borrow::Cow;
use std::net::IpAddr;

use http::HeaderName;
use ipnet::IpNet;

mod address;
mod digest;
pub mod jwt;
pub mod logged;
mod view;
pub use address::{
    client_ip, client_ip_behind, client_ip_from, host, is_trusted, peer_key, ForwardedHeader,
};
pub(crate) use view::form_decoded;
pub use view::{bearer, fold_path, Arrival, RequestView};

/// The IPv6 prefix the `ip` source groups clients by.
pub const DEFAULT_V6_PREFIX: u8 = 64;

/// A 128-bit digest of a client identity: the key of a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientId(pub u128);

impl ClientId {
    /// The one shared bucket of requests for which no alternative of a key is present.
    pub fn anonymous() -> Self {
        Self::digest_of(b"\xffanonymous")
    }

    /// The identity of a rate limit service descriptor: its domain and entries, in order.
    pub fn of_entries<'a>(domain: &str, entries: impl Iterator<Item = (&'a str, &'a str)>) -> Self {
        let mut h = blake3::Hasher::new();
        h.update(b"\xferls");
        for part in std::iter::once(domain).chain(entries.flat_map(|(k, v)| [k, v])) {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        Self::from_hasher(&h)
    }

    fn digest_of(bytes: &[u8]) -> Self {
        Self::from_hasher(blake3::Hasher::new().update(bytes))
    }

    fn from_hasher(h: &blake3::Hasher) -> Self {
        let mut first = [0u8; 16];
        first.copy_from_slice(&h.finalize().as_bytes()[..16]);
        Self(u128::from_be_bytes(first))
    }

    /// Lower-case hex, for Redis keys and logs.
    pub fn hex(self) -> String {
        let mut s = String::with_capacity(32);
        self.push_hex(&mut s);
        s
    }

    /// Append the 32 lower-case hex digits of the digest (`{:032x}`, without the formatting
    /// machinery: this is part of every Redis check).
    pub fn push_hex(self, out: &mut String) {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = [0u8; 32];
        for (i, digit) in hex.iter_mut().enumerate() {
            *digit = DIGITS[(self.0 >> (4 * (31 - i))) as usize & 15];
        }
        // ASCII digits: always UTF-8. One `push_str`, not 32 pushes of a `char`.
        out.push_str(std::str::from_utf8(&hex).unwrap_or_default());
    }
}

/// One place an identity can be read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The client address; IPv6 clients are grouped by this prefix length (default 64), so one
    /// host cannot rotate through the addresses of its subnet for fresh buckets.
    Ip(u8),
    Header(HeaderName),
    Query(String),
    Cookie(String),
    Bearer,
    Global,
    Host,
    Method,
    Path,
    /// A claim of the verified bearer JWT (`identity.jwt`).
    Jwt(String),
}

impl Source {
    /// Parse `ip`, `header:NAME`, `query:NAME`, `cookie:NAME`, `bearer`, `global`, `host`,
    /// `method`, `path`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let named = |kind: &str, name: &str| {
            if name.is_empty() {
                Err(format!("`{kind}:` needs a name, as in `{kind}:X-API-Key`"))
            } else {
                Ok(name.to_owned())
            }
        };
        match s.split_once(':') {
            Some(("header", name)) => HeaderName::from_bytes(named("header", name)?.as_bytes())
                .map(Source::Header)
                .map_err(|_| format!("`{name}` is not a valid header name")),
            Some(("query", name)) => named("query", name).map(Source::Query),
            Some(("cookie", name)) => named("cookie", name).map(Source::Cookie),
            Some(("jwt", name)) => named("jwt", name).map(Source::Jwt),
            Some((other, _)) => Err(format!(
                "unknown key source `{other}:` (expected header:, query:, cookie: or jwt:)"
            )),
            None => match s {
                "ip" => Ok(Source::Ip(DEFAULT_V6_PREFIX)),
                _ if s.starts_with("ip/") => s[3..]
                    .parse::<u8>()
                    .ok()
                    .filter(|n| (1..=128).contains(n))
                    .map(Source::Ip)
                    .ok_or_else(|| {
                        format!("`{s}`: the IPv6 prefix must be 1 to 128, as in `ip/56`")
                    }),
                "bearer" => Ok(Source::Bearer),
                "global" => Ok(Source::Global),
                "host" => Ok(Source::Host),
                "method" => Ok(Source::Method),
                "path" => Ok(Source::Path),
                _ => Err(format!(
                    "unknown key source `{s}` (expected ip, ip/N, header:NAME, query:NAME, \
                     cookie:NAME, jwt:CLAIM, bearer, global, host, method or path)"
                )),
            },
        }
    }

    fn tag(&self) -> u8 {
        match self {
            Source::Ip(_) => 1,
            Source::Header(_) => 2,
            Source::Query(_) => 3,
            Source::Cookie(_) => 4,
            Source::Bearer => 5,
            Source::Global => 6,
            Source::Host => 7,
            Source::Method => 8,
            Source::Path => 9,
            Source::Jwt(_) => 10,
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Ip(DEFAULT_V6_PREFIX) => f.write_str("ip"),
            Source::Ip(n) => write!(f, "ip/{n}"),
            Source::Header(n) => write!(f, "header:{n}"),
            Source::Query(n) => write!(f, "query:{n}"),
            Source::Cookie(n) => write!(f, "cookie:{n}"),
            Source::Bearer => f.write_str("bearer"),
            Source::Global => f.write_str("global"),
            Source::Host => f.write_str("host"),
            Source::Method => f.write_str("method"),
            Source::Path => f.write_str("path"),
            Source::Jwt(n) => write!(f, "jwt:{n}"),
        }
    }
}

/// Sources joined with `+`: present only when every part is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alternative(pub Vec<Source>);

impl Alternative {
    pub fn parse(s: &str) -> Result<Self, String> {
        s.split('+')
            .map(|p| Source::parse(p.trim()))
            .collect::<Result<Vec<_>, _>>()
            .map(Alternative)
    }
}

impl std::fmt::Display for Alternative {
    /// As written in the config: `header:X-API-Key+ip`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, s) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("+")?;
            }
            write!(f, "{s}")?;
        }
        Ok(())
    }
}

/// A limit's `key`: alternatives in order, the first present one is the identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec(pub Vec<Alternative>);

impl std::fmt::Display for KeySpec {
    /// `[header:X-API-Key, ip]`: the alternatives as written, as `check` and `simulate` word it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[")?;
        for (i, alt) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{alt}")?;
        }
        f.write_str("]")
    }
}

impl KeySpec {
    /// A client address gives at most one identity: every alternative is the address (IPv6 no
    /// finer than the /64 a peer is counted by) or `global`. Any other source (a header, a
    /// cookie, a path) lets one client mint identities at will.
    pub fn one_per_address(&self) -> bool {
        self.0.iter().all(|alt| {
            alt.0
                .iter()
                .all(|s| matches!(s, Source::Ip(n) if *n <= 64) || *s == Source::Global)
        })
    }
}

/// An `exempt` entry: a network, or a source with an exact value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exemption {
    Net(IpNet),
    Equals(Source, String),
}

/// An IPv4-mapped IPv6 network (`::ffff:10.0.0.0/104`) as the IPv4 one it is: client
/// addresses are compared as IPv4 (`to_canonical`), so the mapped form would never match.
pub fn canonical_net(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.network().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).map_or(net, IpNet::V4),
            None => net,
        },
        _ => net,
    }
}

/// `path` with the bytes a request line cannot carry raw (space, `<`, `>`, `"`, controls,
/// non-ASCII) percent-encoded, as a client must send them.
fn encode_unsafe(path: &str) -> Cow<'_, str> {
    let unsafe_byte = |b: u8| {
        b <= b' '
            || b >= 0x7f
            || matches!(
                b,
                b'<' | b'>' | b'"' | b'`' | b'{' | b'}' | b'|' | b'\\' | b'^'
            )
    };
    if !path.bytes().any(unsafe_byte) {
        return Cow::Borrowed(path);
    }
    let mut out = String::with_capacity(path.len() + 8);
    for b in path.bytes() {
        if unsafe_byte(b) {
            let _ = std::fmt::Write::write_fmt(&mut out, format_args!("%{b:02X}"));
        } else {
            out.push(char::from(b));
        }
    }
    Cow::Owned(out)
}

impl Exemption {
    /// Parse `10.0.0.0/8`, `192.0.2.7`, or `SOURCE=VALUE` such as `header:X-API-Key=batch`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if let Ok(net) = s.parse::<IpNet>() {
            return Ok(Exemption::Net(canonical_net(net)));
        }
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Exemption::Net(IpNet::from(ip.to_canonical())));
        }
        match s.split_once('=') {
            Some((source, _)) if source.contains('+') => Err(format!(
                "`{s}`: an exemption names one source, not a `+` join"
            )),
            Some((ip, _)) if ip == "ip" || ip.starts_with("ip/") => Err(format!(
                "`{s}`: exempt addresses are written as an IP or CIDR, as in `192.0.2.7` or `10.0.0.0/8`"
            )),
            Some((source, value)) => {
                let source = Source::parse(source)?;
                // Compare the way the request's value is read, after `screen`: hosts
                // canonical (lower case, no trailing dot), methods upper case, paths
                // normalised (dot segments, escapes, path parameters) without a trailing
                // slash. A value no screened request can carry is refused: it would never
                // match.
                let value = match source {
                    // As the `host` source reads it: canonical, without the port or brackets.
                    Source::Host => crate::screen::parse_host(value.as_bytes())
                        .map(|mut h| {
                            h.port = None;
                            h.ip.map_or_else(|| h.canonical(), |ip| ip.to_string())
                        })
                        .ok_or_else(|| format!("`{s}`: `{value}` is not a host a request can name"))?,
                    Source::Method => value.to_ascii_uppercase(),
                    Source::Path => {
                        // A request carries a space or `<` only percent-encoded.
                        let encoded = encode_unsafe(value);
                        let normal = crate::screen::normalize_path(&encoded).map_err(|_| {
                            format!("`{s}`: tollgate refuses requests for `{value}` (400), so this never matches")
                        })?;
                        without_trailing_slash(&crate::screen::route_form(&normal)).to_owned()
                    }
                    // Field values reach tollgate without surrounding whitespace, and cookie
                    // values without their quotes.
                    Source::Header(_) => value.trim_matches([' ', '\t']).to_owned(),
                    Source::Cookie(_) => value.trim().trim_matches('"').to_owned(),
                    _ => value.to_owned(),
                };
                Ok(Exemption::Equals(source, value))
            }
            None => Err(format!(
                "`{s}` is neither a CIDR, an IP address nor SOURCE=VALUE \
                 (as in `header:X-API-Key=internal-batch`)"
            )),
        }
    }
}

/// The digest an operator's entry keeps of a `SOURCE=VALUE` value (an API key, a cookie):
/// BLAKE3 in a context of its own, of the value as `Exemption::parse` normalises it.
pub fn value_digest(value: &[u8]) -> [u8; 32] {
    // The context's key is derived once, not per request.
    static CONTEXT: std::sync::LazyLock<blake3::Hasher> = std::sync::LazyLock::new(|| {
        blake3::Hasher::new_derive_key("tollgate 2026 operator entry value")
    });
    *CONTEXT.clone().update(value).finalize().as_bytes()
}

/// `path` without its one trailing slash (`/` stays `/`): the form exact `path` routes and
/// the `path` key source compare in, since most backends serve `/login/` as `/login`.
pub fn without_trailing_slash(path: &str) -> &str {
    match path.strip_suffix('/') {
        Some(bare) if !bare.is_empty() => bare,
        _ => path,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, Method, Uri};

    /// One decoder for every query string: `+` is a space in keys and values alike, `%2B` a
    /// plus; text without either is borrowed.
    #[test]
    fn query_strings_decode_as_forms() {
        assert_eq!(&*form_decoded("a+b%2Bc"), b"a b+c");
        assert_eq!(&*form_decoded("%61"), b"a");
        assert!(matches!(
            form_decoded("plain"),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn nets(s: &[&str]) -> Vec<IpNet> {
        s.iter().map(|n| n.parse().unwrap()).collect()
    }

    #[test]
    fn untrusted_peer_is_the_client_whatever_it_claims() {
        let h = headers(&[("x-forwarded-for", "1.2.3.4")]);
        let ip = client_ip("203.0.113.9".parse().unwrap(), &h, &nets(&["10.0.0.0/8"]));
        assert_eq!(ip, "203.0.113.9".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn trusted_chain_takes_the_right_most_untrusted_entry() {
        let h = headers(&[
            ("x-forwarded-for", "6.6.6.6, 198.51.100.7"),
            ("x-forwarded-for", "10.1.1.1"),
        ]);
        let ip = client_ip("10.0.0.1".parse().unwrap(), &h, &nets(&["10.0.0.0/8"]));
        assert_eq!(ip, "198.51.100.7".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn garbage_stops_the_walk() {
        let h = headers(&[("x-forwarded-for", "198.51.100.7, junk, 10.2.2.2")]);
        let ip = client_ip("10.0.0.1".parse().unwrap(), &h, &nets(&["10.0.0.0/8"]));
        assert_eq!(ip, "10.2.2.2".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn forwarded_header_chain() {
        let h = headers(&[(
            "forwarded",
            "for=6.6.6.6, for=\"[2001:db8::7]:4711\";proto=https, for=10.1.1.1",
        )]);
        let peer = "10.0.0.1".parse().unwrap();
        let ip = client_ip_from(peer, &h, &nets(&["10.0.0.0/8"]), ForwardedHeader::Forwarded);
        assert_eq!(ip, "2001:db8::7".parse::<IpAddr>().unwrap());
        let junk = headers(&[("forwarded", "for=unknown, for=10.1.1.1")]);
        let ip = client_ip_from(
            peer,
            &junk,
            &nets(&["10.0.0.0/8"]),
            ForwardedHeader::Forwarded,
        );
        assert_eq!(ip, "10.1.1.1".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn mapped_ipv6_counts_as_ipv4() {
        let ip = client_ip("::ffff:192.0.2.1".parse().unwrap(), &HeaderMap::new(), &[]);
        assert_eq!(ip, "192.0.2.1".parse::<IpAddr>().unwrap());
    }

    fn view<'a>(m: &'a Method, u: &'a Uri, h: &'a HeaderMap) -> RequestView<'a> {
        RequestView {
            method: m,
            uri: u,
            headers: h,
            client_ip: "192.0.2.1".parse().unwrap(),
            jwt: None,
        }
    }

    #[test]
    fn alternatives_and_joins() {
        let spec = KeySpec(vec![
            Alternative::parse("header:X-API-Key").unwrap(),
            Alternative::parse("ip").unwrap(),
        ]);
        let (m, u) = (Method::GET, Uri::from_static("/x"));
        let with_key = headers(&[("x-api-key", "k1")]);
        let none = HeaderMap::new();
        let a = view(&m, &u, &with_key).resolve(&spec);
        let b = view(&m, &u, &none).resolve(&spec);
        assert_ne!(a, b);
        assert_ne!(a, ClientId::anonymous());
        let joined = KeySpec(vec![Alternative::parse("header:X-Tenant+ip").unwrap()]);
        assert_eq!(view(&m, &u, &none).resolve(&joined), ClientId::anonymous());
    }

    #[test]
    fn hex_is_zero_padded_lower_case() {
        for n in [0, 1, 0xabc, u128::MAX, u128::MAX / 3, 1 << 127] {
            assert_eq!(ClientId(n).hex(), format!("{n:032x}"));
        }
    }

    #[test]
    fn the_global_digest_is_the_one_computed_each_time_before() {
        // What a lone `global` alternative hashed before its digest was remembered: Redis keys
        // of shared buckets must not change across an upgrade.
        fn expected(alt: u8) -> ClientId {
            let mut h = blake3::Hasher::new();
            h.update(&[alt, 6]);
            h.update(&6u64.to_le_bytes());
            h.update(b"global");
            ClientId::from_hasher(&h)
        }
        let (m, u, none) = (Method::GET, Uri::from_static("/x"), HeaderMap::new());
        // Alternatives before it that are absent (no such header), so `global` is number `alt`;
        // past the four remembered digests it is computed.
        for alt in 0..7u8 {
            let mut spec = vec![Alternative::parse("header:X-Absent").unwrap(); usize::from(alt)];
            spec.push(Alternative::parse("global").unwrap());
            let id = view(&m, &u, &none).resolve(&KeySpec(spec));
            assert_eq!(id, expected(alt), "global as alternative {alt}");
        }
    }

    #[test]
    fn remembered_address_digests_are_the_digests() {
        // What a lone `ip` alternative hashes, written out: the memo must give exactly this,
        // for every address and alternative number, however often and in whatever order.
        fn expected(alt: u8, octets: &[u8]) -> ClientId {
            let mut h = blake3::Hasher::new();
            h.update(&[alt, 1]);
            h.update(&(octets.len() as u64).to_le_bytes());
            h.update(octets);
            ClientId::from_hasher(&h)
        }
        let spec = KeySpec(vec![
            Alternative::parse("header:X-API-Key").unwrap(),
            Alternative::parse("ip").unwrap(),
        ]);
        let (m, u, h) = (Method::GET, Uri::from_static("/x"), HeaderMap::new());
        let v4: IpAddr = "192.0.2.1".parse().unwrap();
        // The same leading bytes as the IPv4 address, as a /64: a different identity.
        let v6: IpAddr = "c000:201::".parse().unwrap();
        for _ in 0..3 {
            for i in 0..300u32 {
                let ip = IpAddr::from([10, 0, (i >> 8) as u8, i as u8]);
                let mut v = view(&m, &u, &h);
                v.client_ip = ip;
                let IpAddr::V4(four) = ip else { unreachable!() };
                assert_eq!(v.resolve(&spec), expected(1, &four.octets()));
            }
            let mut v = view(&m, &u, &h);
            v.client_ip = v4;
            assert_eq!(v.resolve(&spec), expected(1, &[192, 0, 2, 1]));
            v.client_ip = v6;
            let mut prefix = [0u8; 16];
            prefix[..4].copy_from_slice(&[0xc0, 0, 2, 1]);
            assert_eq!(v.resolve(&spec), expected(1, &prefix));
            assert_ne!(v.resolve(&spec), expected(1, &[192, 0, 2, 1]));
            let alone = KeySpec(vec![Alternative::parse("ip").unwrap()]);
            assert_eq!(v.resolve(&alone), expected(0, &prefix));
        }
    }

    #[test]
    fn query_cookie_bearer_are_read_and_decoded() {
        let m = Method::GET;
        let u: Uri = "/x?a=1&key=%61b".parse().unwrap();
        let h = headers(&[
            ("cookie", "x=1; session=abc"),
            ("authorization", "Bearer tok"),
        ]);
        let v = view(&m, &u, &h);
        assert_eq!(
            v.value(&Source::Query("key".into())).unwrap().as_ref(),
            b"ab"
        );
        assert_eq!(
            v.value(&Source::Cookie("session".into())).unwrap().as_ref(),
            b"abc"
        );
        assert_eq!(v.value(&Source::Bearer).unwrap().as_ref(), b"tok");
        assert!(v.value(&Source::Query("nope".into())).is_none());
    }

    #[test]
    fn ipv6_clients_are_grouped_by_prefix() {
        let (m, u, h) = (Method::GET, Uri::from_static("/"), HeaderMap::new());
        let spec = |s: &str| KeySpec(vec![Alternative::parse(s).unwrap()]);
        let at = |ip: &str, key: &KeySpec| {
            RequestView {
                method: &m,
                uri: &u,
                headers: &h,
                client_ip: ip.parse().unwrap(),
                jwt: None,
            }
            .resolve(key)
        };
        let ip = spec("ip");
        assert_eq!(at("2001:db8:1:2::1", &ip), at("2001:db8:1:2:ffff::9", &ip));
        assert_ne!(at("2001:db8:1:2::1", &ip), at("2001:db8:1:3::1", &ip));
        let exact = spec("ip/128");
        assert_ne!(at("2001:db8:1:2::1", &exact), at("2001:db8:1:2::2", &exact));
        assert_ne!(at("192.0.2.1", &ip), at("192.0.2.2", &ip));
        assert!(Alternative::parse("ip/0").is_err());
        assert!(Alternative::parse("ip/129").is_err());
    }

    #[test]
    fn exemptions() {
        let (m, u) = (Method::GET, Uri::from_static("/"));
        let h = headers(&[("x-api-key", "internal-batch")]);
        let v = view(&m, &u, &h);
        assert!(v.is_exempt(&[Exemption::parse("192.0.2.0/24").unwrap()]));
        assert!(v.is_exempt(&[Exemption::parse("header:X-API-Key=internal-batch").unwrap()]));
        assert!(!v.is_exempt(&[Exemption::parse("header:X-API-Key=other").unwrap()]));
    }

    #[test]
    fn host_and_path_entries_are_spelled_as_screened_requests() {
        let equals = |s: &str| match Exemption::parse(s) {
            Ok(Exemption::Equals(_, v)) => v,
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(equals("host=API.Example.com."), "api.example.com");
        // The `host` source reads the name without the port.
        assert_eq!(equals("host=Example.com:8080"), "example.com");
        assert_eq!(equals("host=[0::1]:80"), "::1");
        assert_eq!(equals("path=/./v1//%61dmin/"), "/v1/admin");
        assert_eq!(equals("path=/a/../login;jsessionid=1"), "/login");
        for never in ["path=/a%2fb", "path=/login%20", "path=/..;/x", "host=a b"] {
            let e = Exemption::parse(never).unwrap_err();
            assert!(e.contains(never), "{never}: {e}");
        }
    }
}
