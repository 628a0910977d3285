//! Screening before routing: request shapes that smuggle, confuse or evade are refused, the
//! host and the path are brought to one spelling, so that every spelling of a request meets
//! the route and the limits the backend will serve it under.
//!
//! hyper already refuses obs-fold, whitespace before a colon, control characters, differing
//! duplicate Content-Lengths and a Transfer-Encoding whose last coding is not chunked; it
//! handles Content-Length together with Transfer-Encoding as chunked, drops the length and
//! closes the connection after the response. Caught here: codings other than chunked,
//! CONNECT, methods in lower case, over-long targets, and what `host` (Host and `:authority`)
//! and `path` refuse. docs/hardening.md lists every refusal with the reference it follows.

mod host;
mod path;

use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{Method, Request, Version};

pub use host::{parse_host, HostParts};
pub use path::{normalize_path, route_form, ForwardPath};

use crate::error::ProxyError;

/// Refuse what must not be proxied; canonicalise the host and normalise the path in place.
/// `body`: whether the request may have a body. One hyper parsed without (every GET) has no
/// `Transfer-Encoding` either, so its framing is not looked up.
pub fn screen<B>(req: &mut Request<B>, max_uri_bytes: usize, body: bool) -> Result<(), ProxyError> {
    let target_len = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if target_len > max_uri_bytes {
        return Err(ProxyError::UriTooLong);
    }
    if req.method() == Method::CONNECT {
        return Err(ProxyError::MethodNotAllowed);
    }
    // The asterisk form (RFC 9112 3.2.4) is only for OPTIONS, about the server as a whole:
    // answered here, never routed or forwarded as the path `/*`.
    if req.uri().path() == "*" {
        return Err(if req.method() == Method::OPTIONS {
            ProxyError::ServerOptions
        } else {
            ProxyError::BadRequest
        });
    }
    method(req.method())?;
    if req.version() <= Version::HTTP_11 {
        if body {
            framing(req)?;
        }
    } else {
        field_values(req)?;
    }
    host::screen(req)?;
    path::screen(req)
}

/// Methods are case-sensitive (RFC 9110 9.1) and every registered one is upper case, but
/// some frameworks upper-case what they receive (Django, Werkzeug) and would serve `post` as
/// the POST that a `methods: [POST]` route limits. So, as nginx does, a method with a
/// lower-case letter is refused: `400`. One pass over a few bytes, no allocation.
fn method(method: &Method) -> Result<(), ProxyError> {
    if method.as_str().bytes().any(|b| b.is_ascii_lowercase()) {
        return Err(ProxyError::BadRequest);
    }
    Ok(())
}

/// HTTP/2 and HTTP/3 field values must not start or end with whitespace (RFC 9113 8.2.1):
/// HTTP/1.1's parser trims it, h2 passes it on, and a limit keyed on the value would count
/// `" key"` apart from the `key` a trimming backend reads.
fn field_values<B>(req: &Request<B>) -> Result<(), ProxyError> {
    let padded = |b: &[u8]| {
        matches!(b.first(), Some(b' ' | b'\t')) || matches!(b.last(), Some(b' ' | b'\t'))
    };
    if req.headers().values().any(|v| padded(v.as_bytes())) {
        return Err(ProxyError::BadRequest);
    }
    Ok(())
}

fn framing<B>(req: &Request<B>) -> Result<(), ProxyError> {
    let headers = req.headers();
    let codings: crate::Small<&[u8]> = headers
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

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn hosts_must_be_one_valid_and_agree() {
        let screened = |lines: &[(&str, &str)], uri: &str| {
            let mut r = req(lines, uri);
            screen(&mut r, 8192, true).map(|()| r)
        };
        assert!(screened(&[], "/").is_err(), "HTTP/1.1 without Host");
        assert!(screened(&[("host", "a"), ("host", "b")], "/").is_err());
        assert!(screened(&[("host", "a b")], "/").is_err());
        assert!(screened(&[("host", "evil")], "http://other/").is_err());
        assert!(screened(&[("host", "same:80")], "http://same:80/").is_ok());
        assert!(screened(&[("host", "Same.")], "http://same/").is_ok());
        let r = screened(
            &[("host", "Known.Example.:8080")],
            "http://KNOWN.example:8080/x",
        )
        .unwrap();
        assert_eq!(r.headers()["host"], "known.example:8080");
        assert_eq!(r.uri().authority().unwrap().as_str(), "known.example:8080");
        let mut h2 = req(&[], "/");
        *h2.version_mut() = Version::HTTP_2;
        assert!(
            screen(&mut h2, 8192, true).is_err(),
            "HTTP/2 without :authority or Host"
        );
        let mut h2 = req(&[], "http://u@known.example/");
        *h2.version_mut() = Version::HTTP_2;
        assert!(
            screen(&mut h2, 8192, true).is_err(),
            "userinfo in :authority"
        );
        let mut h10 = req(&[], "/");
        *h10.version_mut() = Version::HTTP_10;
        assert!(
            screen(&mut h10, 8192, true).is_ok(),
            "HTTP/1.0 may leave Host out"
        );
    }

    #[test]
    fn methods_in_lower_case_are_refused() {
        for bad in ["post", "Post", "gEt", "propfind"] {
            let m = Method::from_bytes(bad.as_bytes()).unwrap();
            assert!(method(&m).is_err(), "{bad}");
        }
        for ok in ["GET", "POST", "PROPFIND", "M-SEARCH", "X_CUSTOM"] {
            assert!(method(&Method::from_bytes(ok.as_bytes()).unwrap()).is_ok());
        }
    }

    #[test]
    fn the_route_path_drops_parameters_and_the_upstream_keeps_them() {
        let mut r = req(&[("host", "a")], "/api;x=y/login;jsessionid=1?q=1");
        screen(&mut r, 8192, true).unwrap();
        assert_eq!(r.uri(), "/api/login?q=1");
        let forward = r.extensions().get::<ForwardPath>().unwrap();
        assert_eq!(forward.0.as_str(), "/api;x=y/login;jsessionid=1?q=1");
        let mut r = req(&[("host", "a")], "//a/./b?q");
        screen(&mut r, 8192, true).unwrap();
        assert_eq!(r.uri(), "/a/b?q");
        assert!(r.extensions().get::<ForwardPath>().is_none());
    }
}
