//! gRPC's form of tollgate's own answers: a call refused by a limit, the capacity of its
//! upstream or an error gets HTTP 200 with its gRPC status in a trailers-only response
//! (`grpc-status`, `grpc-message`, and `grpc-retry-pushback-ms`, gRPC's A6 server pushback,
//! where there is a wait), never an HTTP status a gRPC client reads as a broken transport.

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::{Either, Full};

use super::Body;

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
const GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// A gRPC call: `content-type: application/grpc`, or `application/grpc+proto` and the like.
/// (gRPC-Web, `application/grpc-web*`, is not: it speaks HTTP/1.1 and reads HTTP statuses.)
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(CONTENT_TYPE).is_some_and(|v| {
        let v = v.as_bytes();
        v.len() >= 16
            && v[..16].eq_ignore_ascii_case(b"application/grpc")
            && matches!(v.get(16), None | Some(b'+' | b';'))
    })
}

/// `req` is a gRPC call. Every call is a `POST`: other methods skip the header lookup.
pub fn is_call<B>(req: &http::Request<B>) -> bool {
    req.method() == http::Method::POST && is_grpc(req.headers())
}

/// The gRPC status code of an answer tollgate made with `status` (gRPC's own mapping of HTTP
/// statuses, `RESOURCE_EXHAUSTED` for a limit).
pub fn code(status: StatusCode) -> u8 {
    match status.as_u16() {
        // A rate limit, a body past its limit: RESOURCE_EXHAUSTED (not UNAVAILABLE, which
        // clients retry at once, into the limit).
        429 | 413 | 431 => 8,
        // At capacity, overloaded, the store or the upstream unavailable: UNAVAILABLE.
        502 | 503 => 14,
        504 | 408 => 4,
        401 => 16,
        403 => 7,
        404 | 405 | 501 | 505 => 12,
        400 | 414 => 13,
        _ => 2,
    }
}

/// `res`, an answer tollgate made itself, in gRPC's form: HTTP 200, trailers-only (the
/// status in the headers, no body), the rate-limit headers kept, `Retry-After` as pushback.
/// `limited`: the status of a call a rate limit refused (`grpc.limited_status`).
pub fn answer(res: Response<Body>, limited: u8) -> Response<Body> {
    let status = res.status();
    let grpc_status = if status == StatusCode::TOO_MANY_REQUESTS {
        limited
    } else {
        code(status)
    };
    let (parts, _) = res.into_parts();
    let mut headers = parts.headers;
    let pushback = headers
        .remove(RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    headers.remove(http::header::CONTENT_LENGTH);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(GRPC_STATUS, HeaderValue::from(u16::from(grpc_status)));
    let reason = status.canonical_reason().unwrap_or("error");
    let message = match pushback {
        Some(s) => format!("{reason}: retry in {s} s"),
        None => reason.to_owned(),
    };
    // gRPC percent-encodes its message; these are ASCII without `%`, so it reads as is.
    if let Ok(v) = HeaderValue::from_str(&message.replace('%', "%25")) {
        headers.insert(GRPC_MESSAGE, v);
    }
    if let Some(s) = pushback {
        headers.insert(GRPC_PUSHBACK, HeaderValue::from(s.saturating_mul(1000)));
    }
    let mut out = Response::new(Either::Right(Full::default()));
    *out.status_mut() = StatusCode::OK;
    *out.headers_mut() = headers;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_is_told_apart_from_grpc_web() {
        let h = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_static(v));
            h
        };
        assert!(is_grpc(&h("application/grpc")));
        assert!(is_grpc(&h("application/grpc+proto")));
        assert!(is_grpc(&h("Application/GRPC;charset=utf-8")));
        assert!(!is_grpc(&h("application/grpc-web")));
        assert!(!is_grpc(&h("application/json")));
    }

    #[test]
    fn a_429_is_resource_exhausted_with_pushback() {
        let mut res = super::super::fixed(StatusCode::TOO_MANY_REQUESTS, "text/plain", "x");
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from_static("3"));
        let g = answer(res, 8);
        assert_eq!(g.status(), StatusCode::OK);
        assert_eq!(g.headers()[GRPC_STATUS], "8");
        assert_eq!(g.headers()[GRPC_PUSHBACK], "3000");
        assert!(!g.headers().contains_key(RETRY_AFTER));
        assert_eq!(code(StatusCode::SERVICE_UNAVAILABLE), 14);
        assert_eq!(code(StatusCode::GATEWAY_TIMEOUT), 4);
    }
}
