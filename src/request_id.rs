//! Request IDs: the `X-Request-Id` a trusted proxy sent, or a new one of 32 lower-case hex
//! digits (128 random bits, as nginx's `$request_id`).
//!
//! A new ID comes from a per-thread generator (wyrand, through `fastrand`, seeded per thread at
//! random): not a cryptographic one, as the ID identifies a request, it authorises nothing.
//! Its value is one allocation, shared by the upstream request and the response.

use http::{HeaderMap, HeaderName, HeaderValue};

/// The header the ID is read from, sent upstream in and returned to the client in, unless
/// `request_id_header` names another.
#[cfg(test)]
const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The longest ID kept from a trusted proxy; a longer one is replaced.
const MAX_KEPT: usize = 200;

/// The request's ID: the one in `headers` under `name` when the peer is a trusted proxy
/// (`trusted`, asked first) and it is 1 to 200 visible ASCII characters, else a new one. One
/// ID per request: never indexed by HTTP/2's header compression (`header_value::unindexed`).
pub fn resolve(
    headers: &HeaderMap,
    name: &HeaderName,
    trusted: impl FnOnce() -> bool,
) -> HeaderValue {
    // Trust first: a scan of a few address ranges (none by default) is cheaper than looking
    // up a header name that is not a standard one.
    if trusted() {
        if let Some(sent) = headers.get(name) {
            let b = sent.as_bytes();
            if !b.is_empty() && b.len() <= MAX_KEPT && b.iter().all(u8::is_ascii_graphic) {
                return crate::header_value::unindexed(sent.clone());
            }
        }
    }
    generate()
}

/// A new ID: 32 lower-case hex digits.
pub fn generate() -> HeaderValue {
    let n = fastrand::u128(..);
    let mut hex = [0u8; 32];
    for (digits, i) in hex.chunks_exact_mut(8).zip((0..4).rev()) {
        // The four 32-bit parts of `n`, most significant first.
        digits.copy_from_slice(&hex8((n >> (32 * i)) as u32));
    }
    // Owned by its `Bytes` with a reference count in the same allocation: the ID goes
    // upstream and back to the client, and a clone of a `Vec`'s bytes allocates a second
    // block for the count. Hex digits are a valid header value: this never falls back.
    let id = HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(hex))
        .unwrap_or(HeaderValue::from_static("-"));
    crate::header_value::unindexed(id)
}

/// `x` as 8 lower-case hex digits, all at once in a `u64` (one digit a byte) rather than a
/// table look-up a digit.
fn hex8(x: u32) -> [u8; 8] {
    let mut v = u64::from(x);
    // Each nibble to a byte of its own, the most significant in the highest byte.
    v = ((v & 0xffff_0000) << 16) | (v & 0xffff);
    v = ((v & 0x0000_ff00_0000_ff00) << 8) | (v & 0x0000_00ff_0000_00ff);
    v = ((v & 0x00f0_00f0_00f0_00f0) << 4) | (v & 0x000f_000f_000f_000f);
    // 1 in each byte whose nibble is 10 or more: those become `a`-`f`, 0x27 past `0` + n.
    let letters = ((v + 0x0606_0606_0606_0606) >> 4) & 0x0101_0101_0101_0101;
    (v + 0x3030_3030_3030_3030 + letters * 0x27).to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_digits_are_formats() {
        for x in [
            0,
            1,
            9,
            10,
            15,
            16,
            0xdead_beef,
            0x0123_4567,
            0x89ab_cdef,
            u32::MAX,
        ] {
            assert_eq!(hex8(x), format!("{x:08x}").as_bytes(), "{x:#x}");
        }
    }

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
        let many: Vec<HeaderValue> = (0..300).map(|_| generate()).collect();
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
        assert_eq!(resolve(&HeaderMap::new(), &HEADER, || true).len(), 32);
    }
}
