//! The YAML file as written: serde structs mirroring it 1:1, unknown keys refused, no logic.

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    #[serde(default)]
    pub listeners: Vec<Listener>,
    pub admin: Option<Admin>,
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    #[serde(default)]
    pub limiter: Limiter,
    #[serde(default)]
    pub rate_limit_headers: RateLimitHeaders,
    #[serde(default)]
    pub upstreams: BTreeMap<String, Upstream>,
    #[serde(default)]
    pub routes: Vec<Route>,
    /// How long in-flight requests may take to finish on SIGTERM.
    pub shutdown_timeout: Option<String>,
    /// Requests in flight at once, all listeners together; beyond it: 503 with Retry-After.
    pub max_inflight: Option<usize>,
    /// Where each kept list item stood in the file, when broken items were left out.
    #[serde(skip)]
    pub positions: Positions,
}

/// Original indices of `listeners` and `routes` items (identity when nothing was left out).
#[derive(Debug, Default)]
pub struct Positions {
    pub listeners: Vec<usize>,
    pub routes: Vec<usize>,
    /// Upstreams that did not parse: routes naming them get no second error.
    pub broken_upstreams: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Listener {
    pub address: String,
    pub tls: Option<Tls>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    pub cert: String,
    pub key: String,
    /// More certificates, each chosen by SNI for the DNS names it carries.
    #[serde(default)]
    pub certificates: Vec<CertPair>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertPair {
    pub cert: String,
    pub key: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Admin {
    pub address: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limiter {
    pub backend: Option<String>,
    pub redis: Option<Redis>,
    pub on_failure: Option<String>,
    pub local_fallback: Option<LocalFallback>,
    pub local: Option<Local>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Redis {
    pub url: Option<String>,
    pub cluster: Option<Vec<String>>,
    pub timeout: Option<String>,
    pub key_prefix: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalFallback {
    pub divide_by: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Local {
    pub max_buckets: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(clippy::struct_field_names)]
pub struct RateLimitHeaders {
    #[serde(default = "yes")]
    pub ietf: bool,
    #[serde(default = "yes")]
    pub x_ratelimit: bool,
}

impl Default for RateLimitHeaders {
    fn default() -> Self {
        Self {
            ietf: true,
            x_ratelimit: true,
        }
    }
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Upstream {
    pub targets: Vec<String>,
    pub connect_timeout: Option<String>,
    pub timeout: Option<String>,
    pub tls: Option<UpstreamTls>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTls {
    /// PEM file of the CA(s) to trust instead of the system's.
    pub ca: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    pub name: String,
    #[serde(rename = "match", default)]
    pub matcher: Match,
    pub upstream: Option<String>,
    pub respond: Option<Respond>,
    #[serde(default)]
    pub limits: Vec<Limit>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Match {
    pub host: Option<String>,
    pub path: Option<String>,
    pub path_prefix: Option<String>,
    pub methods: Option<Vec<String>>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Respond {
    #[serde(default = "ok")]
    pub status: u16,
    #[serde(default)]
    pub body: String,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

fn ok() -> u16 {
    200
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    pub name: String,
    pub rate: String,
    pub burst: Option<u32>,
    pub key: Vec<String>,
    pub cost: Option<u32>,
    #[serde(default)]
    pub shadow: bool,
    #[serde(default)]
    pub exempt: Vec<String>,
    pub on_failure: Option<String>,
}
