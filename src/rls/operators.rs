//! Operators' bans and overrides (`control`) for a rate limit service call. A call's
//! descriptor entries are read as a request's headers named by their keys, and its
//! `remote_address` entry as the client address, so that the admin API's identities name
//! descriptors as they name requests: `203.0.113.7`, `header:user=bob`. A ban's route is
//! `rls:DOMAIN`.

use std::net::IpAddr;

use http::{HeaderName, HeaderValue};

use super::pb::RateLimitRequest;
use super::Matched;
use crate::control::InForce;
use crate::identity::Arrival;

/// Apply the entries of `table` to `call`: the seconds a ban holds it for (the call is
/// refused), else `matched`'s limits retuned by their overrides.
pub(super) fn apply(
    table: &InForce,
    call: &RateLimitRequest,
    matched: &mut Matched<'_>,
) -> Option<u64> {
    let (req, ip) = request_of(call);
    let arrival = Arrival::of(&req, ip);
    let view = arrival.view(false, None);
    let now = crate::control::entry::now_ms();
    if let Some(ban) = table.ban_for(&view, &format!("rls:{}", call.domain), now) {
        return Some(ban.span.left_s(now).max(1));
    }
    for (limit, tuning) in matched.limits.iter().zip(&mut matched.tunings) {
        if let Some(t) = table.tuning(limit, &view, now) {
            let cost = tuning.as_ref().and_then(|own| own.cost);
            *tuning = Some(crate::limiter::Tuning { cost, ..t.clone() });
        }
    }
    None
}

/// The call's entries as the headers of a request, and its client address: the
/// `remote_address` entry's (`0.0.0.0` without one).
pub(crate) fn request_of(call: &RateLimitRequest) -> (http::Request<()>, IpAddr) {
    let ip = (call.descriptors.iter())
        .flat_map(|d| &d.entries)
        .find(|e| e.key == "remote_address")
        .and_then(|e| e.value.parse::<IpAddr>().ok())
        .unwrap_or(IpAddr::from([0, 0, 0, 0]));
    let mut req = http::Request::new(());
    for e in call.descriptors.iter().flat_map(|d| &d.entries) {
        let name = HeaderName::from_bytes(e.key.as_bytes());
        if let (Ok(name), Ok(value)) = (name, HeaderValue::from_str(&e.value)) {
            req.headers_mut().append(name, value);
        }
    }
    (req, ip)
}
