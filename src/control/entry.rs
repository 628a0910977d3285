//! One operator entry, a ban or an override: built from the API's JSON, kept as a record in
//! Redis, matched against requests, and shown with its secret redacted.
//!
//! An identity is in the `exempt` syntax. An address or network is kept as it is; the value of
//! `SOURCE=VALUE` (an API key, a cookie, a token's subject) only as its BLAKE3 digest
//! (`identity::value_digest`), and a request matches by the digest of its own value. So neither
//! Redis, nor the listings, nor the logs hold the secret: they show `header:x-api-key=blake3:`
//! and the digest's first 12 hex digits.

use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::identity::{value_digest, Exemption, RequestView, Source};

mod ban;
mod overrides;
pub use ban::{Ban, BanView, NewBan};
pub use overrides::{fits, NewOverride, Override, OverrideView};

/// The longest `ttl` an entry may have: an operator's entry is for an incident, and the
/// config is where a lasting rule belongs.
pub const MAX_TTL: Duration = Duration::from_hours(30 * 24);

/// Who an entry applies to.
#[derive(Debug, Clone, PartialEq)]
pub enum Matcher {
    Net(IpNet),
    /// A source whose value has this digest.
    Value(Source, [u8; 32]),
}

/// A `Matcher` as Redis keeps it: `{"net": "10.0.0.0/8"}` or
/// `{"value": {"source": "header:x-api-key", "blake3": "<64 hex digits>"}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum MatchRecord {
    Net(String),
    Value { source: String, blake3: String },
}

impl Matcher {
    /// The matcher of `identity` (the `exempt` syntax), and the identity as it is shown.
    pub fn parse(identity: &str) -> Result<(Self, String), String> {
        match Exemption::parse(identity.trim())? {
            Exemption::Net(net) => Ok((Matcher::Net(net), net.to_string())),
            Exemption::Equals(source, value) => {
                if value.is_empty() {
                    return Err(format!(
                        "`{identity}` has an empty value, which no request carries"
                    ));
                }
                let digest = value_digest(value.as_bytes());
                let shown = shown(&source, &value, &digest);
                Ok((Matcher::Value(source, digest), shown))
            }
        }
    }

    pub fn matches(&self, view: &RequestView<'_>) -> bool {
        match self {
            Matcher::Net(net) => net.contains(&view.client_ip),
            Matcher::Value(source, digest) => view.has_value_digest(source, digest),
        }
    }

    fn record(&self) -> MatchRecord {
        match self {
            Matcher::Net(net) => MatchRecord::Net(net.to_string()),
            Matcher::Value(source, digest) => MatchRecord::Value {
                source: source.to_string(),
                blake3: blake3::Hash::from_bytes(*digest).to_hex().to_string(),
            },
        }
    }

    fn of_record(r: &MatchRecord) -> Result<Self, String> {
        match r {
            MatchRecord::Net(net) => net
                .parse()
                .map(Matcher::Net)
                .map_err(|_| format!("`{net}` is not a network")),
            MatchRecord::Value { source, blake3 } => {
                let digest = blake3::Hash::from_hex(blake3).map_err(|e| e.to_string())?;
                Ok(Matcher::Value(Source::parse(source)?, *digest.as_bytes()))
            }
        }
    }
}

/// How an identity is shown: the sources that carry secrets by their digest's first 12 hex
/// digits; a host, method or path as it is.
fn shown(source: &Source, value: &str, digest: &[u8; 32]) -> String {
    match source {
        Source::Host | Source::Method | Source::Path | Source::Global => {
            format!("{source}={value}")
        }
        _ => {
            let hex = blake3::Hash::from_bytes(*digest).to_hex();
            format!("{source}=blake3:{}", &hex[..12])
        }
    }
}

/// When an entry was made and until when it holds: milliseconds since the UNIX epoch, on the
/// wall clock of the replica that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub created_ms: i64,
    pub expires_ms: i64,
}

impl Span {
    /// From `now_ms`, for `ttl` (the config's duration syntax: `90s`, `1h`, `7d`), at most
    /// `MAX_TTL`.
    pub fn of(ttl: &str, now_ms: i64) -> Result<Self, String> {
        let ttl = crate::config::values::duration(ttl)?;
        if ttl.is_zero() {
            return Err("`ttl` must be longer than zero".into());
        }
        if ttl > MAX_TTL {
            return Err("`ttl` is at most 30d: a lasting rule belongs in the config".into());
        }
        Ok(Self {
            created_ms: now_ms,
            expires_ms: now_ms.saturating_add(ttl.as_millis() as i64),
        })
    }

    /// Whole seconds left at `now_ms`, rounded up (0 once expired).
    pub fn left_s(self, now_ms: i64) -> u64 {
        let left = self.expires_ms.saturating_sub(now_ms).max(0) as u64;
        left.div_ceil(1000)
    }

    pub fn expired(self, now_ms: i64) -> bool {
        self.expires_ms <= now_ms
    }

    /// The times as listings show them.
    fn times(self, now_ms: i64) -> Times {
        Times {
            created: rfc3339(self.created_ms),
            created_unix: self.created_ms.div_euclid(1000),
            expires: rfc3339(self.expires_ms),
            expires_unix: self.expires_ms.div_euclid(1000),
            ttl_left_s: self.left_s(now_ms),
        }
    }
}

/// An entry's times in a listing: RFC 3339 in UTC to the second, and UNIX seconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Times {
    pub created: String,
    pub created_unix: i64,
    pub expires: String,
    pub expires_unix: i64,
    pub ttl_left_s: u64,
}

fn rfc3339(ms: i64) -> String {
    jiff::Timestamp::from_second(ms.div_euclid(1000))
        .unwrap_or(jiff::Timestamp::UNIX_EPOCH)
        .to_string()
}

/// The wall clock, in milliseconds since the UNIX epoch.
pub fn now_ms() -> i64 {
    jiff::Timestamp::now().as_millisecond()
}

/// A fresh entry ID: 16 hex digits, random (IDs are made by any replica, unsynchronised).
fn new_id() -> String {
    format!("{:016x}", fastrand::u64(..))
}

/// A reason is one line of text: it goes into log lines.
fn reason(r: &str) -> Result<String, String> {
    if r.chars().count() > 500 {
        return Err("`reason` is at most 500 characters".into());
    }
    if r.chars().any(|c| c.is_control() || invisible(c)) {
        return Err(
            "`reason` is one line, without control, format or separator characters \
             (such as U+202E or U+2028)"
                .into(),
        );
    }
    Ok(r.to_owned())
}

/// Unicode format and separator characters a log or terminal shows as nothing, or acts on:
/// bidirectional overrides (U+202E turns what follows around), zero-width characters, line
/// and paragraph separators.
fn invisible(c: char) -> bool {
    matches!(c,
        '\u{00AD}' | '\u{061C}' | '\u{180E}'
        | '\u{200B}'..='\u{200F}'
        | '\u{2028}'..='\u{202E}'
        | '\u{2060}'..='\u{206F}'
        | '\u{FEFF}'
        | '\u{FFF9}'..='\u{FFFB}')
}

// === Bans ===

#[cfg(test)]
mod tests;
