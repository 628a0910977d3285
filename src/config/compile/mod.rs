//! Validation is the conversion: raw `file::File` -> `Settings`, collecting every problem.
//!
//! One file per section of the config: `listeners`, `limiter`, `upstreams` (and `health`, its
//! balancing, retry and health keys), `routes` (with their limits). Compiling reads the
//! certificate and CA files a config names, but builds no live object: `tollgate check` runs
//! exactly this.

mod capacity;
mod concurrency;
mod health;
mod identity;
mod leasing;
mod limiter;
mod listeners;
mod quota;
mod responses;
mod rls;
mod routes;
mod telemetry;
mod upstreams;
mod whole;

/// `N/day` and the other quota values, for the admin API's overrides.
pub(crate) use quota::parse as quota_value;
pub(crate) use rls::{call_limit as rls_call_limit, domain as rls_domain};

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use super::file;
use super::settings::{
    AdminToken, BufferSettings, HeaderPolicy, LimiterSettings, Listener, RouteSpec, Settings,
    UpstreamSpec,
};
use super::values;
use super::Problem;
use crate::identity::ForwardedHeader;
use crate::route::{Matcher, Table};

/// Collects problems with the field path each belongs to.
#[derive(Default)]
pub(super) struct Problems(pub(super) Vec<Problem>);

impl Problems {
    pub(super) fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
            at: None,
        });
    }

    /// Keep the value, or record the error and return `None`.
    pub(super) fn take<T>(&mut self, path: impl Into<String>, r: Result<T, String>) -> Option<T> {
        r.map_err(|e| self.add(path, e)).ok()
    }
}

/// Which file is compiled: the live config, or a candidate evaluated beside it (whose
/// listeners and admin are ignored, so not compiled, and which names no candidate itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Live,
    Candidate,
}

/// Compile a parsed file into settings, or every problem it has.
pub fn compile(raw: &file::File, role: Role) -> Result<Settings, Vec<Problem>> {
    let mut p = Problems::default();
    let live = role == Role::Live;
    let (listeners, admin) = front(raw, live, &mut p);
    let trusted_proxies = trusted_proxies(raw, &mut p);
    let limiter = limiter::limiter(&raw.limiter, &mut p);
    let client_ip_header = client_ip_header(raw.client_ip_header.as_deref(), &mut p);
    let (shutdown_timeout, shutdown_delay) = shutdown(raw, &mut p);
    let upstreams = upstreams::upstreams(&raw.upstreams, &mut p);
    let (routes, matchers) = all_routes(raw, &upstreams, &limiter, &mut p);
    let buffering = buffering(raw.buffering.as_ref(), &mut p);
    let strip_untrusted_headers = strip_untrusted(raw.strip_untrusted_headers.as_deref(), &mut p);
    let request_id_header = request_id_header(raw.request_id_header.as_deref(), &mut p);
    let grpc_limited_status = grpc_limited_status(raw.grpc.as_ref(), &mut p);
    let jwt = identity::jwt(raw, &mut p);
    let (admin_token, rls, traces) = (
        admin_token(raw.admin.as_ref().filter(|_| live), &mut p),
        rls::section(raw.rls.as_ref().filter(|_| live), &mut p),
        telemetry::traces(raw.telemetry.as_ref().filter(|_| live), &mut p),
    );
    whole::role_checks(raw, live, &listeners, &trusted_proxies, &mut p);
    if !p.0.is_empty() {
        return Err(p.0);
    }
    let mut upstreams: Vec<Arc<UpstreamSpec>> = upstreams.into_values().flatten().collect();
    upstreams.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(Settings {
        table: Table::new(matchers),
        routes,
        upstreams,
        listeners,
        admin,
        trusted_proxies,
        client_ip_header,
        headers: HeaderPolicy {
            ietf: raw.rate_limit_headers.ietf,
            x_ratelimit: raw.rate_limit_headers.x_ratelimit,
        },
        limiter,
        shutdown_timeout,
        shutdown_delay,
        max_inflight: raw.max_inflight.unwrap_or(10_000),
        max_rss: raw
            .max_rss
            .as_deref()
            .and_then(|s| p.take("max_rss", values::size(s))),
        underscores_in_headers: raw.underscores_in_headers.unwrap_or(false),
        strip_untrusted_headers,
        buffering,
        request_id_header,
        grpc_limited_status,
        jwt,
        admin_token,
        fingerprints: fingerprints(raw),
        source: String::new(),
        inputs_digest: [0; 32],
        candidate: None,
        rls,
        traces,
    })
}

/// `trusted_proxies:`, each entry a network or an address.
fn trusted_proxies(raw: &file::File, p: &mut Problems) -> Vec<IpNet> {
    raw.trusted_proxies
        .iter()
        .enumerate()
        .filter_map(|(i, s)| p.take(format!("trusted_proxies[{i}]"), parse_net(s)))
        .collect()
}

/// `client_ip_header:` (X-Forwarded-For unless it says `forwarded`).
fn client_ip_header(raw: Option<&str>, p: &mut Problems) -> ForwardedHeader {
    match raw {
        None | Some("x-forwarded-for") => ForwardedHeader::XForwardedFor,
        Some("forwarded") => ForwardedHeader::Forwarded,
        Some(other) => {
            p.add(
                "client_ip_header",
                format!("`{other}` is not x-forwarded-for or forwarded"),
            );
            ForwardedHeader::XForwardedFor
        }
    }
}

/// `shutdown_timeout:` (30 s) and `shutdown_delay:` (none).
fn shutdown(raw: &file::File, p: &mut Problems) -> (Duration, Duration) {
    let timeout = duration_or(
        p,
        "shutdown_timeout".into(),
        raw.shutdown_timeout.as_ref(),
        Duration::from_secs(30),
    );
    let delay = duration_or(
        p,
        "shutdown_delay".into(),
        raw.shutdown_delay.as_ref(),
        Duration::ZERO,
    );
    (timeout, delay)
}

/// Every route in file order with its matcher; route names are unique.
fn all_routes(
    raw: &file::File,
    upstreams: &std::collections::HashMap<String, Option<Arc<UpstreamSpec>>>,
    limiter: &LimiterSettings,
    p: &mut Problems,
) -> (Vec<RouteSpec>, Vec<Matcher>) {
    let mut ctx = routes::RouteCtx {
        upstreams,
        limiter,
        limit_names: HashSet::new(),
        broken_upstreams: &raw.positions.broken_upstreams,
    };
    let mut route_names = HashSet::new();
    let (mut routes, mut matchers) = (Vec::new(), Vec::new());
    for (i, r) in raw.routes.iter().enumerate() {
        let path = format!("routes[{}]", raw.positions.routes.get(i).unwrap_or(&i));
        if !route_names.insert(r.name.as_str()) {
            p.add(
                format!("{path}.name"),
                format!("duplicate route name `{}`", r.name),
            );
        }
        if let Some((route, matcher)) = routes::route(r, &path, &mut ctx, p) {
            routes.push(route);
            matchers.push(matcher);
        }
    }
    (routes, matchers)
}

/// The listeners and the admin address: a candidate's are ignored, so not compiled (their
/// certificate files are not read).
fn front(raw: &file::File, live: bool, p: &mut Problems) -> (Vec<Listener>, Option<SocketAddr>) {
    if !live {
        return (Vec::new(), None);
    }
    let listeners = listeners::listeners(&raw.listeners, &raw.positions.listeners, p);
    let admin = (raw.admin.as_ref()).and_then(|a| p.take("admin.address", parse_addr(&a.address)));
    (listeners, admin)
}

/// `admin.token_file`'s token, read on every load and reload (so rotating it needs no restart).
fn admin_token(admin: Option<&file::Admin>, p: &mut Problems) -> Option<AdminToken> {
    let path = admin?.token_file.as_ref()?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| p.add("admin.token_file", format!("cannot read `{path}`: {e}")))
        .ok()?;
    let token = AdminToken::of(&text);
    if token.is_none() {
        p.add(
            "admin.token_file",
            format!("`{path}` is empty: it must hold the admin API's bearer token"),
        );
    }
    token
}

fn fingerprints(raw: &file::File) -> Vec<(String, u64)> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let hash = |s: String| {
        let mut h = DefaultHasher::new();
        s.hash(&mut h);
        h.finish()
    };
    let routes = raw
        .routes
        .iter()
        .map(|r| (format!("route {}", r.name), hash(format!("{r:?}"))));
    let upstreams = raw
        .upstreams
        .iter()
        .map(|(n, u)| (format!("upstream {n}"), hash(format!("{u:?}"))));
    routes.chain(upstreams).collect()
}

/// What `strip_untrusted_headers` is without the key: headers that name the client's address
/// (set by CDNs and load balancers, believed by the frameworks behind them) and the URL
/// overrides IIS's URL Rewrite module and Symfony honour in place of the request line.
pub const DEFAULT_STRIP: [&str; 11] = [
    "true-client-ip",
    "x-client-ip",
    "cf-connecting-ip",
    "x-cluster-client-ip",
    "fastly-client-ip",
    "client-ip",
    "x-originating-ip",
    "x-remote-ip",
    "x-remote-addr",
    "x-original-url",
    "x-rewrite-url",
];

/// Headers a strip list cannot name: the proxy needs them (Host, framing) or sets them itself
/// for untrusted peers anyway.
const NOT_STRIPPABLE: [&str; 8] = [
    "host",
    "content-length",
    "transfer-encoding",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-real-ip",
    "forwarded",
];

/// The `strip_untrusted_headers` list: header names, each once.
fn strip_untrusted(raw: Option<&[String]>, p: &mut Problems) -> Vec<http::HeaderName> {
    let Some(raw) = raw else {
        return DEFAULT_STRIP
            .iter()
            .map(|n| http::HeaderName::from_static(n))
            .collect();
    };
    let mut names: Vec<http::HeaderName> = Vec::new();
    for (i, s) in raw.iter().enumerate() {
        let key = format!("strip_untrusted_headers[{i}]");
        let Ok(name) = http::HeaderName::from_bytes(s.as_bytes()) else {
            p.add(key, format!("`{s}` is not a valid header name"));
            continue;
        };
        if NOT_STRIPPABLE.contains(&name.as_str()) {
            p.add(
                key,
                format!("`{s}` cannot be listed: tollgate needs it or sets it itself"),
            );
        } else if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// `grpc.limited_status` as a gRPC status code: `RESOURCE_EXHAUSTED` (8) unless set.
fn grpc_limited_status(raw: Option<&file::Grpc>, p: &mut Problems) -> u8 {
    match raw.and_then(|g| g.limited_status.as_deref()) {
        None | Some("resource_exhausted") => 8,
        Some("unavailable") => 14,
        Some(other) => {
            p.add(
                "grpc.limited_status",
                format!("`{other}` is not resource_exhausted or unavailable"),
            );
            8
        }
    }
}

/// The `request_id_header` name (`x-request-id` without the key).
fn request_id_header(raw: Option<&str>, p: &mut Problems) -> http::HeaderName {
    let default = http::HeaderName::from_static("x-request-id");
    let Some(raw) = raw else { return default };
    match http::HeaderName::from_bytes(raw.as_bytes()) {
        // `'static` (`intern`): every request clones it twice.
        Ok(name) if !NOT_STRIPPABLE.contains(&name.as_str()) => {
            http::HeaderName::from_static(crate::intern::text(name.as_str()))
        }
        Ok(_) => {
            p.add(
                "request_id_header".to_owned(),
                format!(
                    "`{raw}` cannot be the request-ID header: tollgate needs it or sets it itself"
                ),
            );
            default
        }
        Err(_) => {
            p.add(
                "request_id_header".to_owned(),
                format!("`{raw}` is not a valid header name"),
            );
            default
        }
    }
}

/// The `buffering` section: sizes, and a temporary directory that exists.
fn buffering(raw: Option<&file::Buffering>, p: &mut Problems) -> BufferSettings {
    let d = BufferSettings::default();
    let Some(raw) = raw else {
        return d;
    };
    let mut size = |key: &str, v: Option<&String>, default: u64| {
        v.and_then(|s| p.take(format!("buffering.{key}"), values::size(s)))
            .unwrap_or(default)
    };
    let memory_per_body = size(
        "memory_per_body",
        raw.memory_per_body.as_ref(),
        d.memory_per_body,
    );
    let max_memory = size("max_memory", raw.max_memory.as_ref(), d.max_memory);
    let max_response_file = size(
        "max_response_file",
        raw.max_response_file.as_ref(),
        d.max_response_file,
    );
    let max_spill = size("max_spill", raw.max_spill.as_ref(), d.max_spill);
    if max_response_file == 0 {
        p.add("buffering.max_response_file", "must be at least 1 byte");
    }
    let temp_dir = raw
        .temp_dir
        .as_ref()
        .map_or(d.temp_dir, std::path::PathBuf::from);
    if raw.temp_dir.is_some() && !temp_dir.is_dir() {
        p.add(
            "buffering.temp_dir",
            format!("`{}` is not a directory", temp_dir.display()),
        );
    }
    BufferSettings {
        temp_dir,
        memory_per_body,
        max_memory,
        max_response_file: max_response_file.max(1),
        max_spill,
    }
}

pub(super) fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("`{s}` is not an address like `0.0.0.0:8000` or `[::]:8000`"))
}

/// A network or an address; an IPv4-mapped one as the IPv4 one it is (peers are compared as
/// IPv4).
fn parse_net(s: &str) -> Result<IpNet, String> {
    s.parse::<IpNet>()
        .or_else(|_| s.parse::<std::net::IpAddr>().map(IpNet::from))
        .map(crate::identity::canonical_net)
        .map_err(|_| format!("`{s}` is not a CIDR like `10.0.0.0/8` or an IP address"))
}

pub(super) fn duration_or(
    p: &mut Problems,
    path: String,
    raw: Option<&String>,
    default: Duration,
) -> Duration {
    raw.and_then(|s| p.take(path, values::duration(s)))
        .unwrap_or(default)
}
