//! Request IDs: the `X-Request-Id` a trusted proxy sent, or a new one of 32 lower-case hex
//! digits (128 random bits, as nginx's `$request_id`).
//!
//! A new ID comes from a per-thread generator (wyrand, through `fastrand`, seeded per thread at
//! random): not a cryptographic one, as the ID identifies a request, it authorises nothing.
//! Its bytes are cut from a per-thread block, so a header value costs no allocation of its own.

use std::cell::RefCell;

use bytes::BytesMut;
use http::{HeaderMap, HeaderName, HeaderValue};

/// The header the ID is read from, sent upstream in and returned to the client in, unless
/// `request_id_header` names another.
#[cfg(test)]
const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The longest ID kept from a trusted proxy; a longer one is replaced.
const MAX_KEPT: usize = 200;

/// Generated IDs per block of memory.
const PER_BLOCK: usize = 128;

thread_local! {
    static BLOCK: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

/// The request's ID: the one in `headers` under `name` when the peer is a trusted proxy
/// (`trusted` is only asked when there is one) and it is 1 to 200 visible ASCII characters,
/// else a new one.
pub fn resolve(
    headers: &HeaderMap,
    name: &HeaderName,
    trusted: impl FnOnce() -> bool,
) -> HeaderValue {
    if let Some(sent) = headers.get(name) {
        let b = sent.as_bytes();
        let visible = !b.is_empty() && b.len() <= MAX_KEPT && b.iter().all(u8::is_ascii_graphic);
        if visible && trusted() {
            return sent.clone();
        }
    }
    generate()
}

/// A new ID: 32 lower-case hex digits.
pub fn generate() -> HeaderValue {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let n = fastrand::u128(..);
    let mut hex = [0u8; 32];
    for (i, digit) in hex.iter_mut().enumerate() {
        *digit = DIGITS[(n >> (4 * (31 - i))) as usize & 15];
    }
    let bytes = BLOCK.with_borrow_mut(|block| {
        if block.capacity() - block.len() < hex.len() {
            *block = BytesMut::with_capacity(hex.len() * PER_BLOCK);
        }
        block.extend_from_slice(&hex);
        block.split().freeze()
    });
    // Hex digits are a valid header value: this never falls back.
    HeaderValue::from_maybe_shared(bytes).unwrap_or(HeaderValue::from_static("-"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_32_lower_case_hex_digits_and_differ() {
        let a = generate();
        let b = generate();
        for id in [&a, &b] {
            let s = id.to_str().unwrap();
            assert_eq!(s.len(), 32);
            assert!(s
                .bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        }
        assert_ne!(a, b);
        // A whole block and more: each ID stays its own.
        let many: Vec<HeaderValue> = (0..PER_BLOCK * 2 + 3).map(|_| generate()).collect();
        let distinct: std::collections::HashSet<&[u8]> =
            many.iter().map(HeaderValue::as_bytes).collect();
        assert_eq!(distinct.len(), many.len());
    }

    #[test]
    fn a_trusted_peers_id_is_kept_and_anyone_elses_replaced() {
        let mut headers = HeaderMap::new();
        headers.insert(HEADER, HeaderValue::from_static("abc-123"));
        assert_eq!(resolve(&headers, &HEADER, || true), "abc-123");
        assert_ne!(resolve(&headers, &HEADER, || false), "abc-123");
        headers.insert(HEADER, HeaderValue::from_static("has space"));
        assert_ne!(resolve(&headers, &HEADER, || true), "has space");
        headers.insert(HEADER, HeaderValue::from_str(&"a".repeat(201)).unwrap());
        assert_eq!(resolve(&headers, &HEADER, || true).len(), 32);
        let mut asked = false;
        let _ = resolve(&HeaderMap::new(), &HEADER, || {
            asked = true;
            true
        });
        assert!(!asked, "no header: the trust check is not run");
    }
}
