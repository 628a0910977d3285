//! Identity digests: an alternative's sources hashed with BLAKE3, with the constant `global`
//! digest and recent address digests remembered, since a digest costs more than the rest of
//! an in-process check.

use std::net::IpAddr;

use super::{ClientId, Source};

/// The start of the digest of alternative number `alt`: its sources follow (`digest_source`).
pub(super) fn alternative_digest(alt: u8) -> blake3::Hasher {
    let mut h = blake3::Hasher::new();
    h.update(&[alt]);
    h
}

/// One source's part of an alternative's digest.
pub(super) fn digest_source(h: &mut blake3::Hasher, tag: u8, value: &[u8]) {
    h.update(&[tag]);
    h.update(&(value.len() as u64).to_le_bytes());
    h.update(value);
}

/// The digest of alternative number `alt` when it is `global` alone, as the general path
/// computes it. Computed once: it is a constant, and a digest costs more than the rest of an
/// in-process check.
pub(super) fn global_digest(alt: u8) -> ClientId {
    const REMEMBERED: usize = 4;
    static DIGESTS: std::sync::LazyLock<[ClientId; REMEMBERED]> =
        std::sync::LazyLock::new(|| std::array::from_fn(|alt| compute_global(alt as u8)));
    DIGESTS
        .get(usize::from(alt))
        .copied()
        .unwrap_or_else(|| compute_global(alt))
}

pub(super) fn compute_global(alt: u8) -> ClientId {
    let mut h = alternative_digest(alt);
    digest_source(&mut h, Source::Global.tag(), b"global");
    ClientId::from_hasher(&h)
}

/// Entries of the per-thread memo of address digests (direct-mapped by address).
const IP_MEMO: usize = 64;

type IpMemo = [Option<(u8, [u8; 16], usize, ClientId)>; IP_MEMO];

thread_local! {
    /// Recent digests of alternatives that are an address alone, by alternative number and
    /// address. A digest costs more than the rest of an in-process check, and a client's
    /// requests repeat its address. Exact: an entry is used only for the very same input.
    static IP_DIGESTS: std::cell::RefCell<IpMemo> = const { std::cell::RefCell::new([None; IP_MEMO]) };
}

/// The digest of alternative number `alt` when it is the `ip` source alone, with value
/// `bytes[..len]`.
pub(super) fn ip_digest(alt: u8, bytes: [u8; 16], len: usize) -> ClientId {
    let compute = || {
        let mut h = alternative_digest(alt);
        digest_source(&mut h, Source::Ip(0).tag(), &bytes[..len]);
        ClientId::from_hasher(&h)
    };
    let fold = u128::from_le_bytes(bytes) ^ u128::from(alt);
    let slot = ((fold as u64 ^ (fold >> 64) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58)
        as usize
        % IP_MEMO;
    IP_DIGESTS
        .try_with(|memo| {
            let mut memo = memo.borrow_mut();
            match memo[slot] {
                Some((a, b, l, id)) if a == alt && b == bytes && l == len => id,
                _ => {
                    let id = compute();
                    memo[slot] = Some((alt, bytes, len, id));
                    id
                }
            }
        })
        .unwrap_or_else(|_| compute())
}

/// The address as the `ip` source counts it (IPv6 cut to its prefix): the first `len` bytes.
pub(super) fn ip_octets(ip: IpAddr, v6_prefix: u8) -> ([u8; 16], usize) {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let mut octets = [0u8; 16];
            octets[..4].copy_from_slice(&v4.octets());
            (octets, 4)
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let mask = u128::MAX
                .checked_shl(128 - u32::from(v6_prefix))
                .unwrap_or(0);
            ((bits & mask).to_be_bytes(), 16)
        }
    }
}
