//! The request path in one spelling: `//admin`, `/./admin` and `/%61dmin` meet the limits of
//! `/admin`, and the spellings some backend reads differently from the rest are refused or
//! routed as that backend serves them.
//!
//! - Normalised (RFC 3986 6.2.2): unreserved escapes decoded, other escapes upper-cased,
//!   repeated slashes merged, `.` and `..` resolved. This is the path that goes upstream.
//! - Refused (`400`): an encoded `/`, `\` or NUL; a raw `\` (IIS and other Windows servers
//!   read it as `/`; RFC 3986 has no place for it); `%25` before two hex digits (a double
//!   encoding, which backends that decode twice, IIS among them, read as the escape it
//!   spells: `%252f` as `/`); escapes that do not decode to UTF-8, overlong forms such as
//!   `%C0%AF` (a `/` to decoders that skip the check) included; `.` or `..` with path
//!   parameters (`..;/`: Tomcat strips the parameter, then climbs).
//! - Routed without path parameters: `/api;x=y/login` and `/api/login;jsessionid=1` are
//!   routed and limited as `/api/login`, because servlet containers (Tomcat, Jetty) strip a
//!   segment's `;` parameters before mapping it; the backend still receives them
//!   (`ForwardPath`), so URL sessions and matrix parameters keep working. To a backend that
//!   reads `;` literally that is another, likely missing, resource that was limited strictly.

use std::borrow::Cow;

use http::uri::PathAndQuery;
use http::{Request, Uri};

use crate::error::ProxyError;

/// The normalised path and query as the upstream receives it, when it differs from the path
/// the request is routed by (it kept its path parameters). Set by `screen`, taken by the
/// upstream rewrite.
#[derive(Debug, Clone)]
pub struct ForwardPath(pub PathAndQuery);

/// Refuse the paths that must not be proxied; normalise the rest in place (routes and limits
/// see the routed form, the upstream the forwarded one).
pub(super) fn screen<B>(req: &mut Request<B>) -> Result<(), ProxyError> {
    let path = req.uri().path();
    if req.uri().path_and_query().is_none() || is_clean(path.as_bytes()) {
        return Ok(());
    }
    let forward = normalize_path(path)?;
    let routed = route_form(&forward);
    if forward == path && matches!(routed, Cow::Borrowed(_)) {
        return Ok(());
    }
    let query = req.uri().query();
    let with_query = |p: &str| {
        let pq = match query {
            Some(q) => format!("{p}?{q}"),
            None => p.to_owned(),
        };
        PathAndQuery::try_from(pq).map_err(|_| ProxyError::BadRequest)
    };
    let routed_pq = with_query(&routed)?;
    if let Cow::Owned(_) = routed {
        let forward = ForwardPath(with_query(&forward)?);
        req.extensions_mut().insert(forward);
    }
    let mut parts = req.uri().clone().into_parts();
    parts.path_and_query = Some(routed_pq);
    *req.uri_mut() = Uri::from_parts(parts).map_err(|_| ProxyError::BadRequest)?;
    Ok(())
}

/// A path with nothing to decode, merge, resolve, strip or refuse: one pass, no allocation.
/// Most paths are clean (`/api/v1/users/42`, `/static/app.js`).
fn is_clean(path: &[u8]) -> bool {
    if path.first() != Some(&b'/') {
        return false;
    }
    let mut prev = 0u8;
    for &b in path {
        match b {
            // Non-ASCII (a raw Unicode space may end a segment) goes the long way too.
            b'%' | b'\\' | b';' | 0x80.. => return false,
            b'/' | b'.' if prev == b'/' => return false,
            // A segment ending in a dot; an NTFS stream name (`::$DATA`).
            b'/' if prev == b'.' => return false,
            b'$' if prev == b':' => return false,
            _ => {}
        }
        prev = b;
    }
    prev != b'.'
}

/// The normalised path, as the upstream receives it (see the module's rules), or `400`.
pub fn normalize_path(path: &str) -> Result<String, ProxyError> {
    let decoded = decode_unreserved(path)?;
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => {
                // `..;x` is `..` to a servlet container, a name to everyone else.
                if s.contains(';') && matches!(s.split(';').next(), Some("." | "..")) {
                    return Err(ProxyError::BadRequest);
                }
                // `/login%20` (or `%C2%A0`, `%E3%80%80`: any Unicode space) is `/login` to a
                // backend that trims names (IIS, some routers), past `/login`'s limit: a
                // segment ending in whitespace, encoded or raw, is refused. So is an NTFS
                // stream name (`login::$DATA` is the file `login` to IIS).
                if ends_in_space(s) || has_stream_name(s) {
                    return Err(ProxyError::BadRequest);
                }
                segments.push(s);
            }
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

/// Whether `segment` (escapes upper-cased) ends in whitespace, encoded or raw.
fn ends_in_space(segment: &str) -> bool {
    let decoded = percent_encoding::percent_decode_str(segment).decode_utf8_lossy();
    decoded.ends_with(char::is_whitespace)
}

/// `name::$DATA`, `name::$INDEX_ALLOCATION`: an NTFS stream, which IIS serves as `name`.
fn has_stream_name(segment: &str) -> bool {
    let upper = segment.to_ascii_uppercase();
    upper.contains("::$") || upper.contains("::%24")
}

/// The path routes and limits see: the normalised path without path parameters (`;` up to
/// the end of each segment) and without the dots that end a segment (`/login.` is `/login`
/// to IIS and to Windows file names); segments left empty are merged away.
pub fn route_form(normalized: &str) -> Cow<'_, str> {
    let dotted = normalized.ends_with('.') || normalized.contains("./");
    if !normalized.contains(';') && !dotted {
        return Cow::Borrowed(normalized);
    }
    let mut out = String::with_capacity(normalized.len());
    let mut last_empty = false;
    for segment in normalized.split('/').skip(1) {
        let bare = segment.split(';').next().unwrap_or_default();
        let bare = bare.trim_end_matches('.');
        last_empty = bare.is_empty();
        if !last_empty {
            out.push('/');
            out.push_str(bare);
        }
    }
    if out.is_empty() || last_empty {
        out.push('/');
    }
    Cow::Owned(out)
}

fn decode_unreserved(path: &str) -> Result<String, ProxyError> {
    let bytes = path.as_bytes();
    // Bytes, not chars: a path may carry UTF-8 (hyper accepts it), which is copied untouched.
    let mut out: Vec<u8> = Vec::with_capacity(path.len());
    let (mut high, mut percent) = (false, false);
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => return Err(ProxyError::BadRequest),
            b'%' => {}
            b => {
                out.push(b);
                i += 1;
                continue;
            }
        }
        let byte = hex_byte(bytes, i + 1).ok_or(ProxyError::BadRequest)?;
        match byte {
            b'/' | b'\\' | 0 => return Err(ProxyError::BadRequest),
            b if b.is_ascii_alphanumeric() || b"-._~".contains(&b) => out.push(b),
            // Reserved or non-ASCII: keep the escape, in upper case (one spelling).
            b => {
                high |= b >= 0x80;
                percent |= b == b'%';
                out.push(b'%');
                out.extend_from_slice(&[hex_digit(b >> 4), hex_digit(b & 0xF)]);
            }
        }
        i += 3;
    }
    // `%25` then two hex digits (once the digits themselves are decoded: `%25%32%66`) is a
    // double encoding.
    if percent
        && out
            .windows(5)
            .any(|w| w.starts_with(b"%25") && hex_byte(w, 3).is_some())
    {
        return Err(ProxyError::BadRequest);
    }
    // Only ASCII was decoded into a valid UTF-8 string, so it stays valid.
    let out = String::from_utf8(out).map_err(|_| ProxyError::BadRequest)?;
    // Escaped bytes above 0x7F must spell UTF-8 (with the raw ones around them): std's check
    // refuses overlong forms (`%C0%AF`), surrogates and bytes no UTF-8 has.
    if high
        && percent_encoding::percent_decode_str(&out)
            .decode_utf8()
            .is_err()
    {
        return Err(ProxyError::BadRequest);
    }
    Ok(out)
}

/// The byte that the two hex digits at `bytes[at..at + 2]` spell.
fn hex_byte(bytes: &[u8], at: usize) -> Option<u8> {
    let pair = bytes.get(at..at + 2)?;
    let digit = |d: u8| char::from(d).to_digit(16);
    let value = digit(pair[0])? * 16 + digit(pair[1])?;
    u8::try_from(value).ok()
}

fn hex_digit(nibble: u8) -> u8 {
    b"0123456789ABCDEF"[usize::from(nibble & 0xF)]
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
            ("/a;x=y/b", "/a;x=y/b"),
            ("/a%3bx", "/a%3Bx"),
            ("/100%25", "/100%25"),
            ("/100%25x", "/100%25x"),
            ("/x;a/../b", "/b"),
        ] {
            assert_eq!(normalize_path(raw).unwrap(), clean, "{raw}");
            assert!(!is_clean(raw.as_bytes()) || raw == clean, "{raw}");
        }
        for bad in [
            "/a%2fb",
            "/a%5Cb",
            "/a%00",
            "/a%zz",
            "/a%4",
            "/a\\b",
            "/%252f",
            "/%2561dmin",
            "/%25%32%66",
            "/%C0%AF",
            "/%c0%ae%c0%ae/",
            "/%ED%A0%80",
            "/%FF",
            "/caf%C3",
            "/api/..;/admin",
            "/api/.;x/admin",
            "/..;",
            "/a/..;jsessionid=1/b",
            "/w/login%20",
            "/w/login%C2%A0",
            "/w/login%e3%80%80",
            "/w/login\u{a0}",
            "/w/login%E2%80%8A/x",
            "/w/login::$DATA",
            "/w/login::%24data",
        ] {
            assert!(normalize_path(bad).is_err(), "{bad}");
        }
        // `%2e` is a dot: routed as the dot is.
        assert_eq!(
            route_form(&normalize_path("/w/login%2e").unwrap()),
            "/w/login"
        );
    }

    #[test]
    fn routes_see_paths_without_parameters() {
        for (normalized, routed) in [
            ("/api/login", "/api/login"),
            ("/api;x=y/login", "/api/login"),
            ("/api/login;jsessionid=AB12", "/api/login"),
            ("/api/login;a;b/", "/api/login/"),
            ("/;x/admin", "/admin"),
            ("/a/;x", "/a/"),
            ("/;x", "/"),
            ("/w/login.", "/w/login"),
            ("/w/login...", "/w/login"),
            ("/w./login", "/w/login"),
            ("/w/login.;x", "/w/login"),
            ("/x.y/z", "/x.y/z"),
        ] {
            assert_eq!(route_form(normalized), routed, "{normalized}");
        }
        assert!(matches!(route_form("/plain/path"), Cow::Borrowed(_)));
    }

    #[test]
    fn clean_paths_skip_the_work() {
        for clean in [
            "/",
            "/api/v1/users/42",
            "/static/app.js",
            "/a-b_c~d",
            "/x.y/z",
        ] {
            assert!(is_clean(clean.as_bytes()), "{clean}");
        }
        for dirty in [
            "",
            "x",
            "//a",
            "/./a",
            "/a/..",
            "/a%41",
            "/a;b",
            "/a\\b",
            "/.well",
            "/a.",
            "/a./b",
            "/caf\u{e9}",
        ] {
            assert!(!is_clean(dirty.as_bytes()), "{dirty}");
        }
    }
}
