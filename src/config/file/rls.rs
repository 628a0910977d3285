//! The `rls` section (Envoy's rate limit service) and the envoyproxy/ratelimit configuration
//! files it reads, as written: their keys, plus tollgate's own on a descriptor.

use schemars::JsonSchema;
use serde::Deserialize;

use super::{Ban, Leasing, Tls};

/// `rls:`: serve Envoy's rate limit service (`envoy.service.ratelimit.v3`) over gRPC.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Rls {
    /// Where the gRPC service listens, as `0.0.0.0:8081`.
    #[schemars(length(min = 1))]
    pub address: String,
    /// An envoyproxy/ratelimit configuration file, or a directory of them (`*.yaml`,
    /// `*.yml`), relative to this file's directory.
    #[schemars(length(min = 1))]
    pub config: String,
    /// Serve gRPC over TLS with these certificates (default: plaintext HTTP/2).
    pub tls: Option<Tls>,
}

/// One envoyproxy/ratelimit configuration file: a domain and its descriptors.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlsFile {
    pub domain: String,
    #[serde(default)]
    pub descriptors: Vec<Descriptor>,
}

/// A descriptor rule: a key (and value) matched against a request's descriptor entry, its
/// limit, and the rules for the entries after it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Descriptor {
    pub key: String,
    pub value: Option<String>,
    pub rate_limit: Option<RateLimit>,
    #[serde(default)]
    pub shadow_mode: bool,
    #[serde(default)]
    pub detailed_metric: bool,
    /// Read as envoyproxy/ratelimit writes it; tollgate's metrics name the descriptor rule
    /// (its limit) already, never the request's values.
    #[serde(default)]
    #[allow(dead_code)]
    pub value_to_metric: bool,
    #[serde(default)]
    pub descriptors: Vec<Descriptor>,
    /// tollgate's: how the limit counts (`fixed`, the default, `sliding`, `exact`, or
    /// `token_bucket` with `burst`).
    pub algorithm: Option<String>,
    /// tollgate's: a token bucket's burst (default: `requests_per_unit`).
    pub burst: Option<u32>,
    /// tollgate's: `open`, `closed` or `local` when Redis cannot answer.
    pub on_failure: Option<String>,
    /// tollgate's: leases of a hot descriptor's tokens (`token_bucket` only).
    pub leasing: Option<Leasing>,
    /// tollgate's: refuse a descriptor outright once it keeps going over its limit.
    pub ban: Option<Ban>,
}

/// A descriptor's `rate_limit`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    pub unit: Option<String>,
    pub requests_per_unit: Option<u32>,
    pub name: Option<String>,
    #[serde(default)]
    pub unlimited: bool,
    #[serde(default)]
    pub replaces: Vec<Replaces>,
}

/// A `rate_limit.replaces` entry: the limit, by name, this one stands in for.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Replaces {
    pub name: String,
}
