//! Screening before routing: request shapes that smuggle, confuse or evade are refused, and the
//! path is normalised so that `//admin`, `/./admin` and `/%61dmin` meet the limits of `/admin`.
//!
//! hyper already refuses obs-fold, whitespace before a colon, control characters, differing
//! duplicate Content-Lengths and a Transfer-Encoding whose last coding is not chunked; it
//! handles Content-Length together with Transfer-Encoding as chunked, drops the length and
//! closes the connection after the response. Caught here: codings other than chunked, a
//! missing or repeated Host, an authority (absolute-form, HTTP/2 `:authority`) that disagrees
//! with Host, CONNECT, over-long targets, and encoded slashes, backslashes and NULs.

use http::header::{CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use http::uri::PathAndQuery;
use http::{Method, Request, Uri, Version};

use crate::error::ProxyError;

/// Refuse what must not be proxied; normalise the path in place.
pub fn screen<B>(req: &mut Request<B>, max_uri_bytes: usize) -> Result<(), ProxyError> {
    let target_len = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if target_len > max_uri_bytes {
        return Err(ProxyError::UriTooLong);
    }
    if req.method() == Method::CONNECT {
        return Err(ProxyError::MethodNotAllowed);
    }
    if req.version() <= Version::HTTP_11 {
        framing(req)?;
    }
    same_host(req)?;
    normalize(req)
}

/// The request's authority (an absolute-form target, HTTP/2's `:authority`) and its Host
/// header must agree: routing reads one, the backend the other, and a mismatch would let a
/// request take one route's limits to another host (RFC 9113 8.3.1, RFC 9112 3.2.2).
fn same_host<B>(req: &Request<B>) -> Result<(), ProxyError> {
    // Origin-form targets (nearly every HTTP/1.1 request) have no authority: no lookup.
    let Some(authority) = req.uri().authority() else {
        return Ok(());
    };
    let Some(host) = req.headers().get(HOST) else {
        return Ok(());
    };
    if authority
        .as_str()
        .as_bytes()
        .eq_ignore_ascii_case(host.as_bytes())
    {
        Ok(())
    } else {
        Err(ProxyError::BadRequest)
    }
}

fn framing<B>(req: &Request<B>) -> Result<(), ProxyError> {
    let headers = req.headers();
    let mut hosts = headers.get_all(HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() || (host.is_none() && req.version() == Version::HTTP_11) {
        return Err(ProxyError::BadRequest);
    }
    let codings: Vec<&[u8]> = headers
        .get_all(TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .collect();
    if !codings.is_empty() {
        if headers.contains_key(CONTENT_LENGTH) {
            // hyper already drops Content-Length when Transfer-Encoding is present (and closes
            // the connection after the response, RFC 9112 6.1), so this does not fire behind
            // hyper today; it stays so that a change there cannot quietly reopen smuggling.
            return Err(ProxyError::BadRequest);
        }
        if codings.iter().any(|c| !c.eq_ignore_ascii_case(b"chunked")) {
            return Err(ProxyError::NotImplemented);
        }
    }
    Ok(())
}

/// Decode percent-encoded unreserved characters, merge repeated slashes and resolve `.` and
/// `..` segments (RFC 3986 6.2.2), so every spelling of a path routes the same way. Encoded
/// `/`, `\` and NUL are refused: decoding them would change the path's structure, keeping them
/// would let `/admin%2Fx` skip the limits of `/admin/x` on backends that decode.
fn normalize<B>(req: &mut Request<B>) -> Result<(), ProxyError> {
    let path = req.uri().path();
    let needs_work = path.contains(['%', '.']) || path.contains("//") || !path.starts_with('/');
    if !needs_work || req.uri().path_and_query().is_none() {
        return Ok(());
    }
    let clean = normalize_path(path)?;
    if clean == path {
        return Ok(());
    }
    let pq = match req.uri().query() {
        Some(q) => format!("{clean}?{q}"),
        None => clean,
    };
    let mut parts = req.uri().clone().into_parts();
    parts.path_and_query = Some(PathAndQuery::try_from(pq).map_err(|_| ProxyError::BadRequest)?);
    *req.uri_mut() = Uri::from_parts(parts).map_err(|_| ProxyError::BadRequest)?;
    Ok(())
}

pub fn normalize_path(path: &str) -> Result<String, ProxyError> {
    let decoded = decode_unreserved(path)?;
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let trailing = decoded.ends_with('/') || decoded.ends_with("/.") || decoded.ends_with("/..");
    let mut out = String::with_capacity(decoded.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() || (trailing && !out.ends_with('/')) {
        out.push('/');
    }
    Ok(out)
}

fn decode_unreserved(path: &str) -> Result<String, ProxyError> {
    let bytes = path.as_bytes();
    // Bytes, not chars: a path may carry UTF-8 (hyper accepts it), which is copied untouched.
    let mut out: Vec<u8> = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            out.push(bytes[i]);
            i += 1;
            continue;
        }
        let hex = path.get(i + 1..i + 3).ok_or(ProxyError::BadRequest)?;
        let byte = u8::from_str_radix(hex, 16).map_err(|_| ProxyError::BadRequest)?;
        match byte {
            b'/' | b'\\' | 0 => return Err(ProxyError::BadRequest),
            b if b.is_ascii_alphanumeric() || b"-._~".contains(&b) => out.push(b),
            // Reserved or non-ASCII: keep the escape, in upper case (one spelling).
            _ => {
                out.push(b'%');
                out.extend_from_slice(hex.to_ascii_uppercase().as_bytes());
            }
        }
        i += 3;
    }
    // Only ASCII was decoded into a valid UTF-8 string, so it stays valid.
    String::from_utf8(out).map_err(|_| ProxyError::BadRequest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_have_one_spelling() {
        for (raw, clean) in [
            ("/admin", "/admin"),
            ("//admin", "/admin"),
            ("/./admin", "/admin"),
            ("/x/../admin", "/admin"),
            ("/%61dmin", "/admin"),
            ("/a/b/", "/a/b/"),
            ("/a/.", "/a/"),
            ("/../..", "/"),
            ("/caf%c3%a9", "/caf%C3%A9"),
            ("/caf\u{e9}/./menu", "/caf\u{e9}/menu"),
        ] {
            assert_eq!(normalize_path(raw).unwrap(), clean, "{raw}");
        }
        for bad in ["/a%2fb", "/a%5Cb", "/a%00", "/a%zz", "/a%4"] {
            assert!(normalize_path(bad).is_err(), "{bad}");
        }
    }

    fn req(lines: &[(&str, &str)], uri: &str) -> Request<()> {
        let mut b = Request::builder().uri(uri);
        for (k, v) in lines {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn framing_shapes() {
        let ok = req(&[("host", "x")], "/");
        assert!(framing(&ok).is_ok());
        assert!(matches!(
            framing(&req(&[], "/")),
            Err(ProxyError::BadRequest)
        ));
        assert!(framing(&req(&[("host", "a"), ("host", "b")], "/")).is_err());
        let both = req(
            &[
                ("host", "x"),
                ("content-length", "4"),
                ("transfer-encoding", "chunked"),
            ],
            "/",
        );
        assert!(matches!(framing(&both), Err(ProxyError::BadRequest)));
        let gzip = req(
            &[("host", "x"), ("transfer-encoding", "gzip, chunked")],
            "/",
        );
        assert!(matches!(framing(&gzip), Err(ProxyError::NotImplemented)));
        assert!(same_host(&req(&[("host", "evil")], "http://other/")).is_err());
        assert!(same_host(&req(&[("host", "same:80")], "http://same:80/")).is_ok());
        assert!(same_host(&req(&[], "http://only-authority/")).is_ok());
    }
}
