//! The upstream request rewrite: origin-form URI, Host, hop-by-hop headers, X-Forwarded-*,
//! client-IP and URL-override headers from untrusted peers, the framing re-emitted.

use http::header::{CONNECTION, CONTENT_LENGTH, HOST};
use http::uri::{Authority, PathAndQuery};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Uri, Version};

use super::Downstream;
use crate::body::Guarded;
use crate::error::ProxyError;
use crate::screen::ForwardPath;
use crate::Small;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// The request made origin-form, as upstream requests are: the path and query only (a path
/// whose parameters routing left out goes with them: screening kept it as `ForwardPath`).
/// The authority an absolute-form request carried.
fn origin_form(req: &mut Request<Guarded>) -> Option<Authority> {
    let forward = req.extensions_mut().remove::<ForwardPath>();
    let absolute = req.uri().scheme().is_some() || req.uri().authority().is_some();
    if !absolute && forward.is_none() {
        return None;
    }
    let authority = req.uri().authority().cloned();
    let path = forward
        .map(|f| f.0)
        .or_else(|| req.uri().path_and_query().cloned())
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *req.uri_mut() = Uri::from(path);
    authority
}

/// The request's `Host`, set where it had none: HTTP/2 carries the host in `:authority`
/// (`authority`), HTTP/1.1 upstreams need it as `Host`, and an HTTP/1.0 request without either
/// still needs one (the target's). The client's host (`None`: it sent none), and whether the
/// `Host` is the target's.
fn host(
    headers: &mut http::HeaderMap,
    authority: Option<Authority>,
    target: &Authority,
) -> Result<(Option<HeaderValue>, bool), ProxyError> {
    if let Some(host) = headers.get(HOST) {
        return Ok((Some(host.clone()), false));
    }
    let from_authority = authority
        .map(|a| HeaderValue::from_str(a.as_str()))
        .transpose()
        .map_err(|_| ProxyError::BadRequest)?;
    let host = match &from_authority {
        Some(host) => host.clone(),
        None => HeaderValue::from_str(target.as_str()).map_err(|_| ProxyError::BadRequest)?,
    };
    headers.insert(HOST, host);
    let is_target = from_authority.is_none();
    Ok((from_authority, is_target))
}

/// Rewrite `req` for `target`; `true` when its `Host` is the target's (the client sent none),
/// so a retry on another target sets that one's.
pub(super) fn rewrite(
    req: &mut Request<Guarded>,
    target: &Authority,
    down: &Downstream<'_>,
) -> Result<bool, ProxyError> {
    let authority = origin_form(req);
    let from_h2 = req.version() == Version::HTTP_2;
    *req.version_mut() = Version::HTTP_11;
    let headers = req.headers_mut();
    if from_h2 {
        join_cookies(headers)?;
    }
    let (original_host, host_is_target) = host(headers, authority, target)?;
    // One pass over the names finds everything to drop; most requests have nothing.
    let has_length = strip_hop_by_hop_and(headers, |k| {
        // Backends that fold `_` into `-` (CGI, PHP-FPM, many frameworks: both become
        // `HTTP_X_FORWARDED_FOR`) would read `X_Forwarded_For` or `X_Real_IP` as the
        // forwarding headers tollgate controls. nginx drops them by default too.
        (!down.underscores && k.as_str().contains('_'))
            // Whatever an untrusted client says about forwarding is dropped, not passed on to
            // a backend that may believe it (X-Forwarded-For is replaced below); so are the
            // other client-IP headers (`True-Client-IP`, ...) and the URL overrides IIS and
            // Symfony honour (`X-Original-URL`, `X-Rewrite-URL`): `strip_untrusted_headers`.
            || (!down.peer_trusted
                && (*k == http::header::FORWARDED
                    || (k.as_str().starts_with("x-forwarded-") && *k != X_FORWARDED_FOR)
                    || down.untrusted_strip.contains(k)))
    });
    // That pass saw every name: without a Content-Length there is no length to re-emit.
    if has_length {
        super::framing::canonical_length(headers)?;
    }
    if down.client_ip == down.peer {
        headers.insert(X_REAL_IP, down.peer_value.clone());
    } else if let Some(v) = crate::header_value::display(down.client_ip) {
        headers.insert(X_REAL_IP, v);
    }
    forwarded_for(headers, down);
    // After the strip: the ID goes upstream whatever `strip_untrusted_headers` names.
    headers.insert(down.request_id.0.clone(), down.request_id.1.clone());
    // From an untrusted peer these were just removed: no need to look.
    if !(down.peer_trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        let proto = if down.tls { "https" } else { "http" };
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    }
    if !(down.peer_trusted && headers.contains_key(&X_FORWARDED_HOST)) {
        match original_host {
            Some(host) => headers.insert(X_FORWARDED_HOST, host),
            None => headers.remove(&X_FORWARDED_HOST),
        };
    }
    Ok(host_is_target)
}

/// Append the peer to X-Forwarded-For when the peer is a trusted proxy (the chain it sent is
/// believed as far as `identity::client_ip` believes it); from anyone else, replace the header
/// so a client cannot plant addresses the backend might trust.
fn forwarded_for(headers: &mut HeaderMap, down: &Downstream<'_>) {
    let chain: Vec<&str> = if down.peer_trusted {
        headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect()
    } else {
        Vec::new()
    };
    if chain.is_empty() {
        headers.insert(X_FORWARDED_FOR, down.peer_value.clone());
        return;
    }
    let value = format!("{}, {}", chain.join(", "), down.peer);
    if let Ok(v) = HeaderValue::try_from(value) {
        headers.insert(X_FORWARDED_FOR, v);
    }
}

/// Whether `name` (lower case) describes one hop, never the message (RFC 9110 7.6.1), or is a
/// framing header hyper sets itself on the next hop.
fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Headers a `Connection` line may name but never removes: the message's Host and length, and
/// the forwarding headers tollgate sets or appends to. RFC 9110 7.6.1 forbids naming headers
/// meant for every recipient; a client that does (`Connection: host`, `Connection:
/// X-Forwarded-For`) would otherwise take them from the backend, or the chain a trusted proxy
/// appended to. (`Transfer-Encoding` is hop-by-hop anyway: hyper frames the next hop itself.)
const OWNED: [&str; 7] = [
    "host",
    "content-length",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-real-ip",
    "forwarded",
];

/// The names to remove from `headers` before the message goes on: the hop-by-hop headers, every
/// header a `Connection` line names (except `OWNED`), and whatever `also` picks. One pass over
/// the names (a `match` on each), so a message that has none of them costs no lookup and no
/// allocation; and whether the message has a Content-Length, seen on the way.
fn doomed_names(
    headers: &HeaderMap,
    also: impl Fn(&HeaderName) -> bool,
) -> (Small<HeaderName>, bool) {
    let mut doomed: Small<HeaderName> = Small::new();
    let mut length = false;
    // The `Connection` lines, met on the same walk: no lookup of the name afterwards.
    let mut connection: Small<&HeaderValue> = Small::new();
    let mut last: Option<&HeaderName> = None;
    for (k, v) in headers {
        if *k == CONNECTION {
            connection.push(v);
        }
        // `iter` yields a name (the same one, by address) once per value: judged once.
        if last.is_some_and(|l| std::ptr::eq(l, k)) {
            continue;
        }
        last = Some(k);
        length |= *k == CONTENT_LENGTH;
        if is_hop_by_hop(k.as_str()) || also(k) {
            doomed.push(k.clone());
        }
    }
    if !connection.is_empty() {
        // Options such as `close` or `keep-alive` name no header, or one already doomed: only
        // names the message actually has are added.
        let options = connection
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|o| !o.is_empty());
        for option in options {
            // The usual options, `keep-alive` and `close`: the first names a hop-by-hop header
            // (doomed above if present), the second none. No scan of the names for them.
            if option.eq_ignore_ascii_case("keep-alive")
                || option.eq_ignore_ascii_case("close")
                || OWNED.iter().any(|o| option.eq_ignore_ascii_case(o))
            {
                continue;
            }
            if let Some(k) = headers
                .keys()
                .find(|k| k.as_str().eq_ignore_ascii_case(option) && !doomed.contains(k))
            {
                doomed.push(k.clone());
            }
        }
    }
    (doomed, length)
}

/// Remove hop-by-hop headers, including every header a `Connection` line names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip_hop_by_hop_and(headers, |_| false);
}

/// `strip_hop_by_hop`, and remove the headers `also` picks in the same pass; whether the
/// message has a Content-Length.
fn strip_hop_by_hop_and(headers: &mut HeaderMap, also: impl Fn(&HeaderName) -> bool) -> bool {
    let (doomed, length) = doomed_names(headers, also);
    // By reference: iterating by value would copy the whole list first, empty or not.
    for name in &doomed {
        headers.remove(name);
    }
    length
}

/// HTTP/2 may split `cookie` into one field per pair; an HTTP/1.1 hop takes one field, the
/// pairs joined with `; ` (RFC 9113 8.2.3): a backend would read only the first, or join them
/// with `, `, which is not a cookie separator.
fn join_cookies(headers: &mut http::HeaderMap) -> Result<(), ProxyError> {
    let mut fields = headers.get_all(http::header::COOKIE).iter();
    let (Some(first), Some(_)) = (fields.next(), fields.next()) else {
        return Ok(());
    };
    let mut joined = first.as_bytes().to_vec();
    for field in headers.get_all(http::header::COOKIE).iter().skip(1) {
        joined.extend_from_slice(b"; ");
        joined.extend_from_slice(field.as_bytes());
    }
    let value = HeaderValue::from_bytes(&joined).map_err(|_| ProxyError::BadRequest)?;
    headers.insert(http::header::COOKIE, value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn strips_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert("connection", "close, X-Secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("proxy-authorization", "Basic x".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn every_connection_line_and_repeated_name_counts() {
        let mut h = HeaderMap::new();
        h.append("connection", "close".parse().unwrap());
        h.append("x-first", "1".parse().unwrap());
        h.append("x-first", "2".parse().unwrap());
        h.append("connection", "x-first, X-Second".parse().unwrap());
        h.append("x-second", "1".parse().unwrap());
        h.append("te", "trailers".parse().unwrap());
        h.append("te", "gzip".parse().unwrap());
        h.append("x-kept", "1".parse().unwrap());
        h.append("x-kept", "2".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 2, "{h:?}");
        assert_eq!(h.get_all("x-kept").iter().count(), 2);
    }

    #[test]
    fn connection_never_names_away_what_the_proxy_owns() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            "Host, content-length, X-Forwarded-For, x-real-ip, X-Forwarded-Proto, \
             x-forwarded-host, forwarded, x-secret"
                .parse()
                .unwrap(),
        );
        for name in OWNED {
            h.insert(name, "1".parse().unwrap());
        }
        h.insert("x-secret", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), OWNED.len(), "{h:?}");
        for name in OWNED {
            assert!(h.contains_key(name), "{name} removed");
        }
    }

    #[test]
    fn forwarded_for_appends_only_for_trusted_peers() {
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_FOR, "6.6.6.6".parse().unwrap());
        let peer = "10.0.0.1".parse().unwrap();
        let peer_value = HeaderValue::from_static("10.0.0.1");
        let id_header = HeaderName::from_static("x-request-id");
        let down = |peer_trusted| Downstream {
            peer,
            peer_value: &peer_value,
            peer_trusted,
            tls: false,
            client_ip: peer,
            websocket_allowed: false,
            grpc: false,
            wants_trailers: false,
            span: None,
            websocket_idle: Duration::from_hours(1),
            underscores: false,
            untrusted_strip: &[],
            worker: 0,
            route: "r",
            retry_idempotent: false,
            request_id: (&id_header, &peer_value),
            queue: (0, crate::capacity::Priority::Normal),
        };
        forwarded_for(&mut h, &down(true));
        assert_eq!(h[&X_FORWARDED_FOR], "6.6.6.6, 10.0.0.1");
        forwarded_for(&mut h, &down(false));
        assert_eq!(h[&X_FORWARDED_FOR], "10.0.0.1");
    }

    #[test]
    fn http2_cookie_fields_are_joined_for_http11() {
        let mut h = HeaderMap::new();
        h.append(http::header::COOKIE, HeaderValue::from_static("a=1"));
        h.append(http::header::COOKIE, HeaderValue::from_static("b=2"));
        join_cookies(&mut h).unwrap();
        let all: Vec<_> = h.get_all(http::header::COOKIE).iter().collect();
        assert_eq!(all, ["a=1; b=2"]);
    }
}
