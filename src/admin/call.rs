//! One admin API call: the request read whole (`Call`), and the JSON and problem+json answers
//! every endpoint gives.

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::json;

use crate::response::{fixed, Body};

/// An API request body larger than this is refused: bans and overrides are a few hundred bytes.
const MAX_BODY: usize = 64 * 1024;

/// One API request, read whole: the method, the path below `/api/v1`, the decoded query
/// pairs in order, and the body.
#[derive(Debug)]
pub(super) struct Call {
    pub method: Method,
    /// Below `/api/v1`, with its leading `/` (`/explain`, `/bans/ID`); `/` for the index.
    pub path: String,
    pub query: Vec<(String, String)>,
    pub body: Bytes,
}

/// Read the request whole (at most `MAX_BODY`) into a `Call`.
pub(super) async fn read(req: Request<Incoming>) -> Result<Call, Response<Body>> {
    let (parts, body) = req.into_parts();
    let Some(path) = parts.uri.path().strip_prefix("/api/v1") else {
        return Err(problem(
            StatusCode::NOT_FOUND,
            "No such API version",
            "the admin API is under /api/v1/",
        ));
    };
    let path = if path.is_empty() { "/" } else { path }.to_owned();
    let query = parts.uri.query().map(decode_query).unwrap_or_default();
    let body = match Limited::new(body, MAX_BODY).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => {
            return Err(problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "Body too large",
                "an admin API request body is at most 64 KiB",
            ))
        }
    };
    Ok(Call {
        method: parts.method,
        path,
        query,
        body,
    })
}

/// `a=1&b=x%3Ay` as decoded pairs (`+` is a space, as browsers and curl `--data-urlencode` send).
fn decode_query(query: &str) -> Vec<(String, String)> {
    let decode = |s: &str| String::from_utf8_lossy(&crate::identity::form_decoded(s)).into_owned();
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// A JSON answer.
pub(super) fn json_response(status: StatusCode, value: &impl serde::Serialize) -> Response<Body> {
    let mut body = serde_json::to_vec_pretty(value).unwrap_or_default();
    body.push(b'\n');
    fixed(status, "application/json", body)
}

/// An RFC 9457 problem+json answer.
pub(super) fn problem(status: StatusCode, title: &str, detail: &str) -> Response<Body> {
    let value = json!({ "title": title, "status": status.as_u16(), "detail": detail });
    let mut body = serde_json::to_vec(&value).unwrap_or_default();
    body.push(b'\n');
    fixed(status, "application/problem+json", body)
}

#[cfg(test)]
mod tests {
    use super::decode_query;

    #[test]
    fn query_pairs_are_decoded_in_order() {
        assert_eq!(
            decode_query("method=GET&header=X-API-Key%3Aabc&header=a:b+c&flag"),
            [
                ("method", "GET"),
                ("header", "X-API-Key:abc"),
                ("header", "a:b c"),
                ("flag", "")
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
    }
}
