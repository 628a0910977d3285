//! The settings of Envoy's rate limit service: where it listens, and its domains' descriptor
//! rules compiled from envoyproxy/ratelimit configuration files.

use std::net::SocketAddr;
use std::path::PathBuf;

use super::{LimitSpec, TlsSettings};

/// `rls:`: the gRPC service's address and TLS, and the rules it answers with.
#[derive(Debug, Clone)]
pub struct RlsSettings {
    pub address: SocketAddr,
    pub tls: Option<TlsSettings>,
    /// The configuration file or directory, as written (relative to the config's directory).
    pub config: String,
    /// Its domains (filled by `config::load`, which reads the files), by domain name.
    pub domains: Vec<DomainSpec>,
}

/// One `domain` of an envoyproxy/ratelimit configuration file.
#[derive(Debug, Clone)]
pub struct DomainSpec {
    pub domain: String,
    pub file: PathBuf,
    pub rules: Vec<DescriptorSpec>,
}

/// A descriptor rule: the entry it matches (`value` `None`: any value of `key`, each value
/// counted apart; a value ending in `*`: the values starting with the rest), what it limits,
/// and the rules for the request's next entry.
#[derive(Debug, Clone)]
pub struct DescriptorSpec {
    pub key: String,
    pub value: Option<String>,
    pub limit: Option<RlsLimit>,
    /// `rate_limit: { unlimited: true }`: matched, never limited.
    pub unlimited: bool,
    pub detailed_metric: bool,
    pub children: Vec<DescriptorSpec>,
}

/// A descriptor's limit: the engine's spec (named after the descriptor's path, which names its
/// buckets), and the numbers Envoy is told back.
#[derive(Debug, Clone)]
pub struct RlsLimit {
    /// `None` for `requests_per_unit: 0`: every request is over the limit (a block list).
    pub spec: Option<LimitSpec>,
    /// The descriptor path of its rule (`key=value` entries joined by `.`), for metrics.
    pub rule: String,
    /// `rate_limit.name`, reported as the limit's name (default: empty, as envoyproxy/ratelimit).
    pub name: String,
    pub unit: RlsUnit,
    pub requests_per_unit: u32,
    /// Names of the limits this one replaces when both apply to one request.
    pub replaces: Vec<String>,
}

/// `rate_limit.unit`, with the protocol's numbers (`RateLimitResponse.RateLimit.Unit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RlsUnit {
    Second = 1,
    Minute = 2,
    Hour = 3,
    Day = 4,
    Month = 5,
    Year = 6,
    Week = 7,
}

impl RlsUnit {
    /// The protocol's number of a unit (`envoy.type.v3.RateLimitUnit`); `None` for `UNKNOWN`.
    pub fn of_number(n: i32) -> Option<Self> {
        [
            Self::Second,
            Self::Minute,
            Self::Hour,
            Self::Day,
            Self::Month,
            Self::Year,
            Self::Week,
        ]
        .into_iter()
        .find(|u| *u as i32 == n)
    }

    /// As envoyproxy/ratelimit reads it, in any case.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "second" => Self::Second,
            "minute" => Self::Minute,
            "hour" => Self::Hour,
            "day" => Self::Day,
            "week" => Self::Week,
            "month" => Self::Month,
            "year" => Self::Year,
            _ => return None,
        })
    }

    /// The window's length in seconds, as envoyproxy/ratelimit counts it (a month is 30 days,
    /// a year 365).
    pub fn secs(self) -> u64 {
        match self {
            Self::Second => 1,
            Self::Minute => 60,
            Self::Hour => 3_600,
            Self::Day => 86_400,
            Self::Week => 7 * 86_400,
            Self::Month => 30 * 86_400,
            Self::Year => 365 * 86_400,
        }
    }
}
