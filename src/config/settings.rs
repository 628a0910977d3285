//! The compiled settings: plain values a reload compares and the runtime is built from.
//!
//! Nothing here is live: no sockets, pools, buckets or metric handles. Those belong to
//! `runtime`, which builds them from these settings (and reuses what an unchanged setting
//! already runs).

mod protocol;
mod redis;
mod rls;
mod status;
mod window;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderMap, StatusCode};
use ipnet::IpNet;

use crate::body::BodyLimits;
use crate::identity::{Exemption, ForwardedHeader, KeySpec};
use crate::route::Table;

/// Everything a config file says, validated.
#[derive(Debug)]
pub struct Settings {
    /// In file order; `table` finds them by index.
    pub routes: Vec<RouteSpec>,
    /// The routes' match conditions and their path index.
    pub table: Table,
    /// Every upstream, by name (routes refer to them by name).
    pub upstreams: Vec<Arc<UpstreamSpec>>,
    pub listeners: Vec<Listener>,
    pub admin: Option<SocketAddr>,
    pub trusted_proxies: Vec<IpNet>,
    pub client_ip_header: ForwardedHeader,
    pub headers: HeaderPolicy,
    pub limiter: LimiterSettings,
    /// How long in-flight requests may take to finish once SIGTERM or SIGINT arrives.
    pub shutdown_timeout: Duration,
    /// How long the listeners keep accepting (and `/readyz` already fails) after SIGTERM or
    /// SIGINT, before the drain: the time a load balancer takes to stop sending.
    pub shutdown_delay: Duration,
    /// Requests in flight at once before new ones get 503.
    pub max_inflight: usize,
    /// Resident memory past which new requests get 503 and new connections are refused.
    pub max_rss: Option<u64>,
    /// Request headers with `_` in their names go upstream (`underscores_in_headers: true`);
    /// by default they are dropped.
    pub underscores_in_headers: bool,
    /// Request headers removed when the peer is not a trusted proxy (client-IP and URL-override
    /// headers such as `True-Client-IP` and `X-Original-URL`).
    pub strip_untrusted_headers: Vec<http::HeaderName>,
    /// Where and how much bodies are buffered.
    pub buffering: BufferSettings,
    /// The header a request's ID is read from, sent upstream in and returned in.
    pub request_id_header: http::HeaderName,
    /// The gRPC status of a call a rate limit refused (`grpc.limited_status`).
    pub grpc_limited_status: u8,
    /// `identity.jwt`: the keys bearer JWTs are verified with, files read at compile time.
    pub jwt: Option<crate::identity::jwt::Shared>,
    /// `admin.token_file`'s token: the admin API (`/api/v1/`) is off without one.
    pub admin_token: Option<AdminToken>,
    /// (name, hash of its YAML) for every route and upstream, to log what a reload changed.
    pub fingerprints: Vec<(String, u64)>,
    /// The YAML these settings were compiled from (served redacted on the admin `/config`).
    pub source: String,
    /// Digest of the config text and of every file it names, read *before* compiling: a file
    /// changed after that is seen as a change by the reload watcher, never missed.
    pub inputs_digest: [u8; 32],
    /// `candidate:`, loaded beside this file (`config::load`): what loading it gave.
    pub candidate: Option<CandidateLoad>,
    /// `rls:`, Envoy's rate limit service (its files read by `config::load`).
    pub rls: Option<RlsSettings>,
    /// `telemetry.traces`: spans exported over OTLP (`None`: no tracing).
    pub traces: Option<TracesSettings>,
}

/// The candidate config a file names: evaluated beside the live one, never enforced.
#[derive(Debug)]
pub struct CandidateLoad {
    /// The file, resolved against the main config's directory.
    pub path: std::path::PathBuf,
    /// Its settings, or everything wrong with it (the live config loads either way).
    pub settings: Result<Arc<Settings>, super::ConfigError>,
}

impl Settings {
    /// What is valid but likely not meant: `check` prints these, `run` logs them at WARN.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if let Some(admin) = self.admin.filter(|a| !a.ip().is_loopback()) {
            warnings.push(format!(
                "admin.address {admin} is not a loopback address: /metrics, /config and the \
                 dashboard page answer whoever reaches it (the API still needs its token); bind \
                 127.0.0.1, or keep the port off the public network"
            ));
        }
        warnings
    }

    /// Every limit of every route, in file order.
    pub fn limits(&self) -> impl Iterator<Item = &LimitSpec> {
        self.routes.iter().flat_map(|r| r.limits.iter())
    }

    /// What is wrong with the candidate config, if it did not load.
    pub fn candidate_error(&self) -> Option<&super::ConfigError> {
        self.candidate.as_ref()?.settings.as_ref().err()
    }
}

/// One route: what it does, its limits and body limits (its match conditions are in `Table`).
// Independent per-route switches (WebSocket, buffering each way, retries, path case), not a
// state machine.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug)]
pub struct RouteSpec {
    pub name: Arc<str>,
    pub action: ActionSpec,
    pub limits: Vec<LimitSpec>,
    /// Idle timeout, deadline and size cap of request bodies on this route.
    pub body: BodyLimits,
    /// WebSocket upgrades are proxied (limits apply to the handshake request).
    pub websocket: bool,
    /// An open tunnel with no traffic either way for this long is closed.
    pub websocket_idle: Duration,
    /// Receive request bodies whole before contacting the upstream.
    pub buffer_request: bool,
    /// Read upstream responses ahead, as fast as the upstream sends them.
    pub buffer_response: bool,
    /// An idempotent request whose bytes reached a target that then failed is sent to
    /// another target (when its body can be sent again).
    pub retry_idempotent: bool,
    /// `match.path_case: insensitive`: the `path` key source reads the path lower-cased.
    pub fold_path: bool,
    /// The route's class in its upstream's queue.
    pub priority: crate::capacity::Priority,
}

/// The `buffering` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferSettings {
    pub temp_dir: std::path::PathBuf,
    pub memory_per_body: u64,
    pub max_memory: u64,
    pub max_response_file: u64,
    /// Bytes in temporary files, all bodies together.
    pub max_spill: u64,
}

impl Default for BufferSettings {
    fn default() -> Self {
        Self {
            temp_dir: std::env::temp_dir(),
            memory_per_body: 64 << 10,
            max_memory: 64 << 20,
            max_response_file: 1 << 30,
            max_spill: 4 << 30,
        }
    }
}

/// What a route does with an admitted request.
#[derive(Debug)]
pub enum ActionSpec {
    /// Forward to the upstream of this name (one of `Settings::upstreams`).
    Forward(Arc<UpstreamSpec>),
    Respond(Arc<Respond>),
}

/// A response the proxy gives itself.
#[derive(Debug)]
pub struct Respond {
    pub status: StatusCode,
    pub body: Bytes,
    pub headers: HeaderMap,
}

/// A limit of a route, as configured.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitSpec {
    pub name: Arc<str>,
    pub rate: Rate,
    pub cost: u32,
    pub shadow: bool,
    pub key: KeySpec,
    pub exempt: Vec<Exemption>,
    pub on_failure: FailurePolicy,
    /// The stricter per-replica rate the `local` failure policy enforces without Redis.
    pub fallback: Rate,
    /// `quota:`: counted per calendar window instead of by token bucket (then `rate` is the
    /// quota spread over the period's nominal length, for headers and reload comparison).
    pub quota: Option<QuotaSpec>,
    /// `ban:`: an identity this limit keeps rejecting is refused outright for a while.
    pub ban: Option<BanSpec>,
    /// `concurrency: N`: a cap on requests in flight instead of a token bucket (then `rate` is
    /// `N/s`, only for headers).
    pub concurrency: Option<ConcurrencySpec>,
    /// `leasing:`: over Redis, a busy identity's tokens taken several at a time (see
    /// `limiter::leasing`).
    pub leasing: Option<LeaseSpec>,
    /// `count_when:`: counted only for responses of these statuses.
    pub count_when: Option<StatusSet>,
    /// `cost: { from_response }`: `cost` is reserved at admission and settled to this
    /// response header's value.
    pub settle: Option<http::HeaderName>,
}

/// A limit's leases: a replica holds at most `tokens` of one identity's bucket at a time, and
/// gives back what no new lease topped up within `hold`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseSpec {
    /// The most one lease holds (`L` of the stated bound).
    pub tokens: u32,
    /// `auto`: each lease sized from what the identity spent here in the last hold, up to
    /// `tokens`; else every lease asks for `tokens`.
    pub auto: bool,
    pub hold: std::time::Duration,
}

/// An escalating ban: `after` rejections by the limit within `within` ban the identity for
/// `first`, doubling with each ban while its level is remembered, up to `max`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BanSpec {
    pub after: u32,
    pub within: std::time::Duration,
    pub first: std::time::Duration,
    pub max: std::time::Duration,
}

pub use self::protocol::Protocol;
pub use self::redis::{redact, RedisConfig, RedisTls, SentinelSpec};
pub use self::rls::{DescriptorSpec, DomainSpec, RlsLimit, RlsSettings, RlsUnit};
pub use self::status::StatusSet;
pub use self::window::{Counting, Period, QuotaSpec, EXACT_MAX};
pub use crate::telemetry::{OtlpProtocol, TracesSettings};

/// A concurrency limit: at most `max` requests of one identity in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConcurrencySpec {
    pub max: u32,
    /// The per-replica cap the `local` failure policy enforces without Redis.
    pub fallback: u32,
    /// How long a Redis lease lives unless renewed.
    pub lease: std::time::Duration,
}

/// The numbers of one limit.
#[derive(Debug, Clone, PartialEq)]
pub struct Rate {
    /// Tokens added per second.
    pub per_sec: f64,
    /// Bucket capacity in whole tokens.
    pub burst: u32,
}

impl Rate {
    /// `per_sec` in the largest unit that makes it at least one (`2/s`, `30/min`, `1.5/h`), as
    /// `check`, `explain` and `simulate` word it.
    pub fn describe(per_sec: f64) -> String {
        fn trim_float(x: f64) -> String {
            let s = format!("{x:.4}");
            s.trim_end_matches('0').trim_end_matches('.').to_owned()
        }
        for (unit, secs) in [("s", 1.0), ("min", 60.0), ("h", 3600.0)] {
            if per_sec * secs >= 1.0 {
                return format!("{}/{unit}", trim_float(per_sec * secs));
            }
        }
        format!("{}/day", trim_float(per_sec * 86400.0))
    }

    /// Microseconds for one token to come back.
    pub fn token_us(&self) -> f64 {
        1e6 / self.per_sec
    }

    /// Microseconds an empty bucket takes to fill: the `w` of `RateLimit-Policy`.
    pub fn window_us(&self) -> f64 {
        f64::from(self.burst) * self.token_us()
    }
}

/// What to do with a limit when the shared store cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Admit the request (and say so loudly in logs and metrics).
    Open,
    /// Reject with 503: for logins, SMS and anything where over-admitting costs money.
    Closed,
    /// Enforce the limit in process, divided by `limiter.local_fallback.divide_by`.
    Local,
}

/// Which rate-limit header families to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderPolicy {
    pub ietf: bool,
    pub x_ratelimit: bool,
}

/// How an upstream is reached: its targets, scheme, timeouts and (for https) trust.
#[derive(Debug, Clone)]
pub struct UpstreamSpec {
    pub name: Arc<str>,
    pub scheme: Scheme,
    /// `protocol`: the HTTP version requests go upstream in.
    pub protocol: Protocol,
    /// `http2.max_concurrent_streams`: an HTTP/2 connection's streams at most.
    pub max_streams: usize,
    pub targets: Vec<Authority>,
    pub connect_timeout: Duration,
    pub timeout: Duration,
    /// Idle connections kept per target, all workers together; `None`: the default per worker.
    pub max_idle: Option<usize>,
    /// Idle connections are closed after this.
    pub idle_timeout: Duration,
    /// Trust anchors for https targets (the system's, or a configured CA).
    pub tls: Arc<rustls::ClientConfig>,
    pub balance: LoadBalancing,
    /// Extra attempts, on other targets, for a request that failed before it was answered.
    pub retries: u32,
    pub health: HealthSpec,
    /// `max_in_flight` and `queue`: none when the upstream is uncapped.
    pub capacity: Option<crate::capacity::Spec>,
    /// `queue.key`: the identity the queue is fair across, when not the route's limit's.
    pub queue_key: Option<KeySpec>,
    /// Identifies the settings and the CA file's bytes: a reload keeps an upstream (and its
    /// warm connections) whose fingerprint did not change. A change of the caps or the queue
    /// alone keeps it too (the caps change in place, waiting requests stay queued).
    pub fingerprint: [u8; 32],
}

/// How an upstream's requests are spread over its healthy targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadBalancing {
    /// Each target in turn.
    RoundRobin,
    /// Of two targets drawn at random, the one with fewer requests in flight.
    LeastRequest,
}

/// When a target is out of rotation: passively, after failures of real requests; actively,
/// after failed health checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthSpec {
    /// Consecutive failures that eject a target; 0: passive checks off.
    pub max_fails: u32,
    /// The first ejection's length; each repeat ejection doubles it, up to `max_ejection`.
    pub fail_timeout: Duration,
    pub max_ejection: Duration,
    /// Upstream response statuses counted as failures, ascending.
    pub failure_statuses: Vec<StatusCode>,
    pub check: Option<CheckSpec>,
}

/// The active health check of an upstream's targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckSpec {
    /// What is asked for: `GET path` with `Host: <target>`, or gRPC's health check.
    pub path: http::uri::PathAndQuery,
    /// gRPC's health check of this service (`grpc.health.v1.Health/Check` at `path`).
    pub grpc: Option<String>,
    pub interval: Duration,
    pub timeout: Duration,
    /// Consecutive passes that take a failing target back.
    pub healthy_threshold: u32,
    /// Consecutive failures that take a target out.
    pub unhealthy_threshold: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Listener {
    pub address: SocketAddr,
    pub tls: Option<TlsSettings>,
    pub settings: ListenerSettings,
}

/// A TLS listener's certificates, loaded.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    pub files: Vec<crate::tls::CertFiles>,
    pub config: Arc<rustls::ServerConfig>,
    /// When each file's leaf certificate expires, in seconds since the Unix epoch (`files`
    /// order), for `/metrics`.
    pub not_after: Vec<i64>,
}

impl PartialEq for TlsSettings {
    /// Same files, same settings: what a reload compares (the contents are reloaded anyway).
    fn eq(&self, other: &Self) -> bool {
        self.files == other.files
    }
}

/// A listener's connection limits and timeouts (the `listeners[]` hardening keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerSettings {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub tls_handshake_timeout: Duration,
    /// A client that accepts no response bytes for this long is disconnected.
    pub send_timeout: Duration,
    pub max_connections: usize,
    pub max_requests_per_connection: u64,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_uri_bytes: usize,
    pub h2_max_concurrent_streams: u32,
    pub h2_stream_window: u32,
    pub h2_connection_window: u32,
    pub h2_max_header_list: u32,
    /// Expect a PROXY protocol header (v1 or v2) from a trusted peer before anything else.
    pub proxy_protocol: bool,
    /// Another process may already listen on the port (`share_port: true`).
    pub share_port: bool,
}

impl Default for ListenerSettings {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_mins(1),
            tls_handshake_timeout: Duration::from_secs(10),
            send_timeout: Duration::from_mins(1),
            max_connections: 10_000,
            max_requests_per_connection: 1000,
            max_header_bytes: 64 << 10,
            max_headers: 100,
            max_uri_bytes: 8 << 10,
            h2_max_concurrent_streams: 100,
            h2_stream_window: 64 << 10,
            h2_connection_window: 1 << 20,
            h2_max_header_list: 64 << 10,
            proxy_protocol: false,
            share_port: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Backend {
    Local,
    Redis(Box<RedisConfig>),
}

impl Backend {
    /// Where limits are counted, for the startup line: `local`, or the Redis servers (a URL's
    /// host and port only, never its password).
    pub fn describe(&self) -> String {
        let Backend::Redis(r) = self else {
            return "local".into();
        };
        let host = |url: &str| {
            let rest = url.split_once("://").map_or(url, |(_, r)| r);
            let rest = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
            rest.split('/').next().unwrap_or(rest).to_owned()
        };
        if let Some(s) = &r.sentinel {
            format!("redis sentinel {} via {}", s.master, s.nodes.join(","))
        } else if !r.cluster.is_empty() {
            let seeds: Vec<String> = r.cluster.iter().map(|u| host(u)).collect();
            format!("redis cluster {}", seeds.join(","))
        } else {
            format!("redis {}", r.url.as_deref().map(host).unwrap_or_default())
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct LimiterSettings {
    pub backend: Backend,
    pub on_failure: FailurePolicy,
    pub divide_by: u32,
    pub max_buckets: usize,
    /// Buckets one client address (IPv6: /64) may hold in a limit whose identity is not the
    /// address itself; its further new identities share one bucket of that address's.
    pub max_buckets_per_peer: usize,
}

/// The admin API's bearer token, kept as its digest: never printed, compared in constant time.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(blake3::Hash);

impl AdminToken {
    /// The token of a file's text (surrounding whitespace, such as a final newline, dropped).
    pub fn of(text: &str) -> Option<Self> {
        let token = text.trim();
        (!token.is_empty()).then(|| Self(blake3::hash(token.as_bytes())))
    }

    /// `given` is the token (`blake3::Hash` compares in constant time).
    pub fn accepts(&self, given: &str) -> bool {
        self.0 == blake3::hash(given.as_bytes())
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(***)")
    }
}
