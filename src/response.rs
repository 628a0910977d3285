//! Responses the proxy writes itself: 429 with its headers, and one response per error.

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::{Either, Full};

pub mod grpc;

pub use crate::config::settings::HeaderPolicy;
use crate::error::ProxyError;
use crate::header_value::unindexed;
use crate::limiter::{Decision, Limit, Verdict};

/// Every response body: an upstream's, streamed or read ahead, or bytes in memory (the proxy's
/// own, or a whole upstream body read ahead).
pub type Body = Either<Either<crate::pool::Pooled, crate::buffer::Spooled>, Full<Bytes>>;

const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const X_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// A response with a fixed body.
pub fn fixed(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut res = Response::new(Either::Right(Full::new(body.into())));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    res
}

/// The response for a request-path error. Bodies are short and generic: details go to logs.
pub fn from_error(err: &ProxyError) -> Response<Body> {
    if let ProxyError::AtCapacity { refusal, .. } = err {
        return at_capacity(*refusal);
    }
    let status = err.status();
    let reason = status.canonical_reason().unwrap_or("Error");
    let mut res = fixed(status, "text/plain; charset=utf-8", format!("{reason}\n"));
    if let ProxyError::LimiterUnavailable { .. } | ProxyError::Overloaded = err {
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from_static("1"));
    }
    if let ProxyError::MethodNotAllowed | ProxyError::ServerOptions = err {
        res.headers_mut().insert(
            http::header::ALLOW,
            HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),
        );
    }
    res
}

/// `503` for a request the upstream's capacity refused: when to come back, and why, as
/// problem+json (the upstream's name stays in the logs).
fn at_capacity(refusal: crate::capacity::Refusal) -> Response<Body> {
    let detail = match refusal.why {
        crate::capacity::Refused::QueueFull => "the backend is at capacity and its queue is full",
        crate::capacity::Refused::QueueTimeout => {
            "the backend is at capacity: no slot came free while the request waited"
        }
        crate::capacity::Refused::ShuttingDown => {
            "the proxy is shutting down and the backend had no slot free before it stops"
        }
    };
    let body = format!(
        "{{\"type\":\"about:blank\",\"title\":\"Service Unavailable\",\"status\":503,\"detail\":\"{detail}; retry in {} s.\",\"reason\":\"{}\",\"retry_after\":{}}}\n",
        refusal.retry_after,
        refusal.why.as_str(),
        refusal.retry_after
    );
    let mut res = fixed(
        StatusCode::SERVICE_UNAVAILABLE,
        "application/problem+json",
        body,
    );
    res.headers_mut()
        .insert(RETRY_AFTER, number(refusal.retry_after));
    res
}

/// Whole seconds, rounded up.
pub fn secs_up(us: f64) -> u64 {
    (us / 1e6 - 1e-9).ceil().max(0.0) as u64
}

/// The last 429 a worker thread wrote, kept to be written again: the clients of a flood hit
/// the same limit with the same numbers (no token left, the same seconds to wait) for a whole
/// second at a time, and a clone of the head and body costs a fraction of writing them.
struct Last429 {
    /// The limit it was written for. A `Weak` keeps the allocation, so no other limit can
    /// take its address while it is remembered, but not the limit's buckets.
    limit: Weak<Limit>,
    /// What its numbers were: retry after, tokens left, seconds until full, and whether it
    /// is a ban's.
    numbers: (u64, u64, u64, bool),
    policy: HeaderPolicy,
    /// The request-ID header its map has a slot for.
    id_header: HeaderName,
    headers: HeaderMap,
    body: Bytes,
}

thread_local! {
    static LAST_429: RefCell<Option<Last429>> = const { RefCell::new(None) };
}

/// `429 Too Many Requests` for a request that `decision` rejected (`limits` are its route's,
/// `rendered` their fixed header parts). Its headers hold a slot for the request ID, under
/// `id_header`, that `proxy::handle` fills.
pub fn too_many_requests(
    limits: &[Arc<Limit>],
    rendered: &[Rendered],
    decision: &Decision,
    policy: HeaderPolicy,
    id_header: &HeaderName,
) -> Response<Body> {
    let route = (limits, rendered);
    let (headers, body) = match decision.reported() {
        Some((r, v)) => {
            let limit = &limits[r.index];
            let numbers = (
                secs_up(v.retry_after_us).max(1),
                v.remaining,
                secs_up(v.reset_us),
                !matches!(
                    r.ban,
                    crate::limiter::ban::BanEvent::None | crate::limiter::ban::BanEvent::Lifted
                ),
            );
            let same = |last: &Last429| {
                std::ptr::eq(last.limit.as_ptr(), Arc::as_ptr(limit))
                    && last.numbers == numbers
                    && last.policy == policy
                    && last.id_header == *id_header
            };
            let again = LAST_429.with_borrow(|last| {
                last.as_ref()
                    .filter(|last| same(last))
                    .map(|last| (last.headers.clone(), last.body.clone()))
            });
            again.unwrap_or_else(|| {
                let (headers, body) = head_429(
                    &limit.name,
                    (numbers.0, numbers.3),
                    route,
                    decision,
                    (policy, id_header),
                );
                LAST_429.set(Some(Last429 {
                    limit: Arc::downgrade(limit),
                    numbers,
                    policy,
                    id_header: id_header.clone(),
                    headers: headers.clone(),
                    body: body.clone(),
                }));
                (headers, body)
            })
        }
        None => head_429("", (1, false), route, decision, (policy, id_header)),
    };
    let mut res = Response::new(Either::Right(Full::new(body)));
    *res.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    *res.headers_mut() = headers;
    res
}

/// Put the request ID on an answer: when `slotted`, into the slot a 429 keeps for it
/// (`too_many_requests`), its last header, without hashing the name; else, or where the last
/// header is another, inserted.
pub fn add_request_id(headers: &mut HeaderMap, name: &HeaderName, id: HeaderValue, slotted: bool) {
    if slotted {
        if let Some((last, slot)) = headers.iter_mut().last() {
            if last == name {
                *slot = id;
                return;
            }
        }
    }
    headers.insert(name.clone(), id);
}

/// The headers and body of a 429 naming limit `name`, retry after `retry` seconds.
fn head_429(
    name: &str,
    (retry, ban): (u64, bool),
    route: (&[Arc<Limit>], &[Rendered]),
    decision: &Decision,
    (policy, id_header): (HeaderPolicy, &HeaderName),
) -> (HeaderMap, Bytes) {
    let mut numbers = itoa::Buffer::new();
    let retry_text = numbers.format(retry);
    let mut body = String::with_capacity(160 + 2 * name.len());
    body.push_str(
        "{\"type\":\"about:blank\",\"title\":\"Too Many Requests\",\"status\":429,\"detail\":\"",
    );
    body.push_str(if ban {
        "Banned by rate limit '"
    } else {
        "Rate limit '"
    });
    body.push_str(name);
    body.push_str(if ban {
        "' after repeated rejections; retry in "
    } else {
        "' exceeded; retry in "
    });
    body.push_str(retry_text);
    body.push_str(" s.\",\"limit\":\"");
    body.push_str(name);
    body.push_str("\",\"retry_after\":");
    body.push_str(retry_text);
    if ban {
        body.push_str(",\"ban\":true");
    }
    body.push_str("}\n");
    // Content-Type, Retry-After and the five rate-limit headers, with room to spare for the
    // `Connection: close` a request with an unread body gets.
    let mut headers = HeaderMap::with_capacity(8);
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    headers.insert(RETRY_AFTER, number(retry));
    add_headers(&mut headers, route.0, route.1, decision, policy);
    // The request ID's slot, filled by `proxy::handle`: a clone of this map has no room to
    // spare, and an entry added to it would move all the others to a larger allocation.
    headers.insert(id_header.clone(), HeaderValue::from_static(""));
    (headers, Bytes::from(body))
}

/// Add the rate-limit headers of the limit closest to rejecting the request.
pub fn add_headers(
    headers: &mut HeaderMap,
    limits: &[Arc<Limit>],
    rendered: &[Rendered],
    decision: &Decision,
    policy: HeaderPolicy,
) {
    let Some((result, v)) = decision.reported() else {
        return;
    };
    let Some(limit) = limits.get(result.index) else {
        return;
    };
    let rendered = rendered.get(result.index);
    // Room for all of them at once: an upstream's map, sized for its own headers, would
    // otherwise grow (and rehash) on the way.
    headers.reserve(2 * usize::from(policy.ietf) + 3 * usize::from(policy.x_ratelimit));
    if policy.ietf {
        let policy_header = rendered.map_or_else(|| policy_value(limit), |r| r.policy.clone());
        headers.insert(RATELIMIT_POLICY, policy_header);
        headers.insert(RATELIMIT, unindexed(ratelimit_value(limit, &v)));
    }
    if policy.x_ratelimit {
        let burst =
            rendered.map_or_else(|| HeaderValue::from(limit.rate.burst), |r| r.burst.clone());
        headers.insert(X_LIMIT, burst);
        headers.insert(X_REMAINING, unindexed(number(v.remaining)));
        headers.insert(X_RESET, number(secs_up(v.reset_us)));
    }
}

/// `n` as a header value. The values up to `SMALL_NUMBERS` are made once, from static text, so
/// a response does not allocate for them (nor share a reference count between workers): the
/// seconds until a bucket is full again, and what is left of most bursts, are small.
fn number(n: u64) -> HeaderValue {
    const SMALL_NUMBERS: usize = 1024;
    static SMALL: std::sync::LazyLock<Vec<HeaderValue>> = std::sync::LazyLock::new(|| {
        // Leaked on purpose: 1024 short strings, once per process, for `from_static`.
        (0..SMALL_NUMBERS)
            .map(|n| HeaderValue::from_static(Box::leak(n.to_string().into_boxed_str())))
            .collect()
    });
    usize::try_from(n)
        .ok()
        .and_then(|i| SMALL.get(i))
        .map_or_else(|| HeaderValue::from(n), Clone::clone)
}

/// The parts of a limit's headers that never change, rendered when the config is compiled,
/// as `'static` values (`intern`): every response clones them.
#[derive(Debug, Clone)]
pub struct Rendered {
    policy: HeaderValue,
    burst: HeaderValue,
}

impl Rendered {
    pub fn of(limit: &Limit) -> Self {
        let kept = |value: HeaderValue| {
            (value.to_str().ok())
                .and_then(crate::intern::header_value)
                .unwrap_or(value)
        };
        Self {
            policy: kept(policy_value(limit)),
            burst: kept(HeaderValue::from(limit.rate.burst)),
        }
    }
}

fn policy_value(limit: &Limit) -> HeaderValue {
    let w = secs_up(limit.rate.window_us()).max(1);
    header(&format!("\"{}\";q={};w={w}", limit.name, limit.rate.burst))
}

fn ratelimit_value(limit: &Limit, v: &Verdict) -> HeaderValue {
    let (mut remaining, mut reset) = (itoa::Buffer::new(), itoa::Buffer::new());
    crate::header_value::joined(&[
        b"\"",
        limit.name.as_bytes(),
        b"\";r=",
        remaining.format(v.remaining).as_bytes(),
        b";t=",
        reset.format(secs_up(v.reset_us)).as_bytes(),
    ])
    .unwrap_or_else(|| HeaderValue::from_static("invalid"))
}

fn header(s: &str) -> HeaderValue {
    // Limit names are validated to a header-safe alphabet when the config is compiled.
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

#[cfg(test)]
mod tests {
    use super::secs_up;

    #[test]
    fn numbers_are_written_in_decimal() {
        for n in [0, 7, 999, 1023, 1024, 65_536, u64::MAX] {
            assert_eq!(super::number(n).to_str().unwrap(), n.to_string());
        }
    }

    #[test]
    fn the_request_id_fills_its_slot_or_is_inserted() {
        use http::header::{CONNECTION, CONTENT_TYPE};
        use http::{HeaderMap, HeaderName, HeaderValue};
        let name = HeaderName::from_static("x-request-id");
        let mut slotted = HeaderMap::new();
        slotted.insert(CONTENT_TYPE, HeaderValue::from_static("a/b"));
        slotted.insert(name.clone(), HeaderValue::from_static(""));
        super::add_request_id(&mut slotted, &name, HeaderValue::from_static("id-1"), true);
        assert_eq!(slotted.get_all(&name).iter().collect::<Vec<_>>(), ["id-1"]);
        assert_eq!(slotted.len(), 2);
        // A header added after the slot: the slot is found by its name instead.
        slotted.insert(CONNECTION, HeaderValue::from_static("close"));
        super::add_request_id(&mut slotted, &name, HeaderValue::from_static("id-2"), true);
        assert_eq!(slotted.get_all(&name).iter().collect::<Vec<_>>(), ["id-2"]);
        assert_eq!(slotted.len(), 3);
        let mut plain = HeaderMap::new();
        plain.insert(CONTENT_TYPE, HeaderValue::from_static("a/b"));
        super::add_request_id(&mut plain, &name, HeaderValue::from_static("id-3"), true);
        assert_eq!(plain.get(&name).unwrap(), "id-3");
        assert_eq!(plain.get(CONTENT_TYPE).unwrap(), "a/b");
        // Not a 429: inserted whatever the last header is, replacing an upstream's IDs.
        let mut other = HeaderMap::new();
        other.append(name.clone(), HeaderValue::from_static("upstream-1"));
        other.append(name.clone(), HeaderValue::from_static("upstream-2"));
        super::add_request_id(&mut other, &name, HeaderValue::from_static("id-4"), false);
        assert_eq!(other.get_all(&name).iter().collect::<Vec<_>>(), ["id-4"]);
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(secs_up(0.0), 0);
        assert_eq!(secs_up(1.0), 1);
        assert_eq!(secs_up(1e6), 1);
        assert_eq!(secs_up(1e6 + 1.0), 2);
        assert_eq!(secs_up(12e6), 12);
    }
}
