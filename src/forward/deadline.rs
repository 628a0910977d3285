//! A gRPC call's deadline (`grpc-timeout`): read at arrival, kept by the proxy while it waits
//! for the answer, and sent upstream as what is left of it.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};
use tokio::time::Instant;

use crate::body::Sent;

const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// The deadline a gRPC call's `grpc-timeout` sets, counted from `since`: at most 8 digits and
/// a unit (`H`, `M`, `S`, `m`, `u`, `n`), as the gRPC protocol spells it. None for a
/// malformed value, which is sent on unchanged.
pub(super) fn of(headers: &HeaderMap, since: Instant) -> Option<Instant> {
    let v = headers.get(&GRPC_TIMEOUT)?.as_bytes();
    let (&unit, digits) = v.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    let d = match unit {
        b'H' => Duration::from_secs(n.checked_mul(3600)?),
        b'M' => Duration::from_secs(n.checked_mul(60)?),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    };
    since.checked_add(d)
}

/// Tell the upstream what is left at `now` of `deadline`, or of `timeout` (the upstream's own)
/// if that is shorter: in milliseconds, rounded up, so a call is never cut short.
pub(super) fn propagate(
    headers: &mut HeaderMap,
    deadline: Instant,
    now: Instant,
    timeout: Duration,
) {
    let left = deadline.saturating_duration_since(now).min(timeout);
    let ms = left.as_nanos().div_ceil(1_000_000);
    // 8 digits at most: 99,999,999 ms is 27 hours, longer than any upstream timeout.
    let v = format!("{}m", ms.min(99_999_999));
    if let Ok(v) = HeaderValue::from_str(&v) {
        headers.insert(GRPC_TIMEOUT, v);
    }
}

/// The moment to give up on a response head for a request whose body was still streaming
/// when it went: `timeout` after its body is sent, or the call's deadline if sooner.
pub(super) async fn head_due(sent: &Sent, timeout: Duration, deadline: Option<Instant>) {
    let after_body = async {
        sent.wait().await;
        tokio::time::sleep(timeout).await;
    };
    match deadline {
        Some(at) => {
            tokio::select! {
                () = after_body => {}
                () = tokio::time::sleep_until(at) => {}
            }
        }
        None => after_body.await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout(v: &'static str) -> Option<Duration> {
        let mut h = HeaderMap::new();
        h.insert(GRPC_TIMEOUT, HeaderValue::from_static(v));
        let now = Instant::now();
        of(&h, now).map(|d| d - now)
    }

    #[test]
    fn grpc_timeouts_are_read_in_every_unit() {
        assert_eq!(timeout("2H"), Some(Duration::from_hours(2)));
        assert_eq!(timeout("3M"), Some(Duration::from_mins(3)));
        assert_eq!(timeout("10S"), Some(Duration::from_secs(10)));
        assert_eq!(timeout("500m"), Some(Duration::from_millis(500)));
        assert_eq!(timeout("250000u"), Some(Duration::from_millis(250)));
        assert_eq!(timeout("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "S", "123456789S", "10s", "1.5S", "-1S", "10"] {
            let mut h = HeaderMap::new();
            h.insert(GRPC_TIMEOUT, HeaderValue::from_str(bad).unwrap());
            assert_eq!(of(&h, Instant::now()), None, "{bad:?}");
        }
    }

    #[test]
    fn what_is_left_goes_upstream_rounded_up() {
        let now = Instant::now();
        let mut h = HeaderMap::new();
        propagate(
            &mut h,
            now + Duration::from_micros(1500),
            now,
            Duration::from_secs(30),
        );
        assert_eq!(h[&GRPC_TIMEOUT], "2m");
        propagate(
            &mut h,
            now + Duration::from_mins(1),
            now,
            Duration::from_secs(30),
        );
        assert_eq!(h[&GRPC_TIMEOUT], "30000m");
        propagate(
            &mut h,
            now,
            now + Duration::from_secs(1),
            Duration::from_secs(30),
        );
        assert_eq!(h[&GRPC_TIMEOUT], "0m");
    }
}
