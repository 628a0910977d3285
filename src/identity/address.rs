//! Who is connecting: the request's host, and the client address behind trusted proxies.

use std::net::IpAddr;

use http::header::HOST;
use http::{HeaderMap, HeaderValue, Uri};
use ipnet::IpNet;

/// The request's host without port and without the brackets of an IPv6 literal: the
/// authority of an absolute URI (HTTP/2's `:authority`), or the `Host` header. Screening has
/// made both canonical (lower case, no trailing dot) and made them agree.
pub fn host<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<&'a str> {
    let raw = match uri.host() {
        Some(h) => return Some(strip_brackets(h)),
        None => headers.get(HOST)?.to_str().ok()?,
    };
    Some(strip_port(raw))
}

fn strip_brackets(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_once(']').map_or(host, |(h, _)| &h[1..]);
    }
    match host.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

/// Which header trusted proxies name the client in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2`
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for=proxy1`
    Forwarded,
}

/// The client address: the TCP peer, unless the peer is a trusted proxy; then the right-most
/// X-Forwarded-For entry (across all its lines) that is not itself a trusted proxy. The
/// left-most entries are whatever the client wrote, so they are never believed.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted: &[IpNet]) -> IpAddr {
    client_ip_from(peer, headers, trusted, ForwardedHeader::XForwardedFor)
}

/// `client_ip`, reading the chain from `header`.
pub fn client_ip_from(
    peer: IpAddr,
    headers: &HeaderMap,
    trusted: &[IpNet],
    header: ForwardedHeader,
) -> IpAddr {
    client_ip_behind((peer, is_trusted(peer, trusted)), headers, trusted, header)
}

/// `client_ip_from`, for a caller that knows whether the peer is trusted.
pub fn client_ip_behind(
    (peer, peer_trusted): (IpAddr, bool),
    headers: &HeaderMap,
    trusted: &[IpNet],
    header: ForwardedHeader,
) -> IpAddr {
    let peer = peer.to_canonical();
    let is_trusted = |ip: &IpAddr| is_trusted(*ip, trusted);
    if !peer_trusted {
        return peer;
    }
    let name = match header {
        ForwardedHeader::XForwardedFor => "x-forwarded-for",
        ForwardedHeader::Forwarded => "forwarded",
    };
    // Raw bytes: a line with bytes that are not visible ASCII is not skipped (that would let
    // a client hide the entries a proxy appended); only the entries themselves are judged.
    let lines: Vec<&[u8]> = headers
        .get_all(name)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    let mut client = peer;
    for entry in lines.iter().rev().flat_map(|l| l.rsplit(|b| *b == b',')) {
        let entry = std::str::from_utf8(entry).ok();
        let hop = match header {
            ForwardedHeader::XForwardedFor => entry.and_then(|e| parse_forwarded_ip(e.trim())),
            ForwardedHeader::Forwarded => {
                entry.and_then(forwarded_for).and_then(parse_forwarded_ip)
            }
        };
        let Some(ip) = hop else {
            // Not an address: what is left of it is client-written and cannot be believed.
            break;
        };
        client = ip;
        if !is_trusted(&ip) {
            break;
        }
    }
    client
}

/// Whether `ip` (IPv4-mapped IPv6 counted as IPv4) is one of the trusted proxies.
pub fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
    let ip = ip.to_canonical();
    trusted.iter().any(|n| n.contains(&ip))
}

/// The `for=` node of one RFC 7239 element, unquoted and without brackets' port.
fn forwarded_for(element: &str) -> Option<&str> {
    element.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("for") {
            return None;
        }
        let v = v.trim().trim_matches('"');
        // `[2001:db8::1]:4711` -> `2001:db8::1`; `[2001:db8::1]` -> `2001:db8::1`
        Some(match v.strip_prefix('[') {
            Some(rest) => rest.split(']').next().unwrap_or(rest),
            None => v,
        })
    })
}

fn parse_forwarded_ip(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    // `192.0.2.1:4711` or `[2001:db8::1]:4711`
    s.parse::<std::net::SocketAddr>()
        .ok()
        .map(|a| a.ip().to_canonical())
}

/// One client's address as the exhaustion policy and the capacity queue group them: an IPv4
/// address, or an IPv6 /64 (one host can rotate through its subnet's addresses, not out of
/// its peer).
pub fn peer_key(ip: IpAddr) -> u64 {
    match ip.to_canonical() {
        // Tagged with a prefix no unicast IPv6 /64 has (ffff::/16 is multicast space).
        IpAddr::V4(v4) => 0xFFFF_FFFF_0000_0000 | u64::from(u32::from(v4)),
        IpAddr::V6(v6) => (u128::from(v6) >> 64) as u64,
    }
}
