//! Framing across the proxy: a request's length re-emitted as the number tollgate parsed, and
//! upstream responses whose framing or protocol switch cannot be passed on refused (`502`,
//! the connection discarded).

use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderValue, Response, StatusCode};

use crate::error::ProxyError;

/// Send the request's Content-Length as the number it was read as: `010` goes on as `10`,
/// and `10, 10` (or the same line twice, which hyper accepts) as one `10`. A backend that
/// reads `010` as octal, or takes the first of two lines, must not frame the body differently
/// from the proxy. The common case (one line of plain digits) is one scan and no allocation.
pub(super) fn canonical_length(headers: &mut HeaderMap) -> Result<(), ProxyError> {
    let mut lines = headers.get_all(CONTENT_LENGTH).iter();
    let Some(first) = lines.next() else {
        return Ok(());
    };
    if lines.next().is_none() && is_plain_number(first.as_bytes()) {
        return Ok(());
    }
    let mut length = None;
    for line in headers.get_all(CONTENT_LENGTH) {
        for item in line.as_bytes().split(|&b| b == b',') {
            let n: u64 = std::str::from_utf8(item.trim_ascii())
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or(ProxyError::BadRequest)?;
            // hyper refuses lengths that disagree before tollgate sees them; kept so that
            // nothing ambiguous is ever sent on.
            if length.is_some_and(|l| l != n) {
                return Err(ProxyError::BadRequest);
            }
            length = Some(n);
        }
    }
    if let Some(n) = length {
        headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
    }
    Ok(())
}

/// Digits only, and no leading zero unless the number is `0`.
fn is_plain_number(b: &[u8]) -> bool {
    !b.is_empty() && b.iter().all(u8::is_ascii_digit) && (b.len() == 1 || b[0] != b'0')
}

/// Refuse an upstream response that cannot be passed on, before anything of it reaches the
/// client; the error drops the response and its connection, which never returns to the pool.
///
/// - Content-Length and Transfer-Encoding together: RFC 9112 6.3 says it "ought to be handled
///   as an error" (a sign of response splitting or smuggling), and nginx answers `502`. hyper
///   would read the body as chunked and keep the Content-Length, which then goes to the client
///   with a body of another length.
/// - `101 Switching Protocols` to a request that asked for no upgrade tollgate proxies: RFC
///   9110 15.2.2 lets a server switch only to a protocol the request's Upgrade named, and the
///   proxy removed any Upgrade it does not tunnel. Passed on, the client would take what
///   follows as another protocol.
pub(super) fn check_response<B>(res: &Response<B>, upgrade_asked: bool) -> Result<(), ProxyError> {
    if res.status() == StatusCode::SWITCHING_PROTOCOLS && !upgrade_asked {
        tracing::debug!("upstream switched protocols unasked: 502");
        return Err(ProxyError::UpstreamInvalid);
    }
    let headers = res.headers();
    if headers.contains_key(TRANSFER_ENCODING) && headers.contains_key(CONTENT_LENGTH) {
        tracing::debug!("upstream response with Content-Length and Transfer-Encoding: 502");
        return Err(ProxyError::UpstreamInvalid);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn length(lines: &[&str]) -> Result<Vec<String>, ProxyError> {
        let mut h = HeaderMap::new();
        for l in lines {
            h.append(CONTENT_LENGTH, l.parse().unwrap());
        }
        canonical_length(&mut h)?;
        Ok(h.get_all(CONTENT_LENGTH)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect())
    }

    #[test]
    fn lengths_go_on_as_parsed() {
        assert_eq!(length(&["10"]).unwrap(), ["10"]);
        assert_eq!(length(&["0"]).unwrap(), ["0"]);
        assert_eq!(length(&["010"]).unwrap(), ["10"]);
        assert_eq!(length(&["000"]).unwrap(), ["0"]);
        assert_eq!(length(&["10, 10"]).unwrap(), ["10"]);
        assert_eq!(length(&["10", "10"]).unwrap(), ["10"]);
        assert_eq!(length(&[]).unwrap(), Vec::<String>::new());
        assert!(length(&["10", "11"]).is_err());
        assert!(length(&["1x"]).is_err());
    }

    #[test]
    fn responses_that_cannot_be_passed_on() {
        let res = |status: u16, headers: &[(&str, &str)]| {
            let mut b = Response::builder().status(status);
            for (k, v) in headers {
                b = b.header(*k, *v);
            }
            b.body(()).unwrap()
        };
        assert!(check_response(&res(200, &[("content-length", "5")]), false).is_ok());
        assert!(check_response(&res(200, &[("transfer-encoding", "chunked")]), false).is_ok());
        let both = res(
            200,
            &[("content-length", "5"), ("transfer-encoding", "chunked")],
        );
        assert!(matches!(
            check_response(&both, false),
            Err(ProxyError::UpstreamInvalid)
        ));
        assert!(check_response(&res(101, &[]), false).is_err());
        assert!(check_response(&res(101, &[]), true).is_ok());
    }
}
