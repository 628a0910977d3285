//! The YAML file as written: serde structs mirroring it 1:1, unknown keys refused, no logic.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Deserialize;

use super::values::{DURATION, POSITIVE_DURATION, SIZE};

mod limit;
mod rls;
mod telemetry;
pub use self::limit::{Ban, Cost, Leasing, Limit, StatusItem};
pub use self::rls::{Descriptor, RateLimit, Rls, RlsFile};
pub use self::telemetry::Telemetry;

#[derive(Debug, Deserialize, JsonSchema)]
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
    #[schemars(pattern(DURATION))]
    pub shutdown_timeout: Option<String>,
    /// How long the listeners keep accepting after SIGTERM, readiness already failing.
    #[schemars(pattern(DURATION))]
    pub shutdown_delay: Option<String>,
    /// Requests in flight at once, all listeners together; beyond it: 503 with Retry-After.
    pub max_inflight: Option<usize>,
    /// Resident memory past which new requests get 503 and new connections are refused.
    #[schemars(pattern(SIZE))]
    pub max_rss: Option<String>,
    /// Where trusted proxies name the client: `x-forwarded-for` (default) or `forwarded`.
    #[schemars(extend("x-choices" = ["x-forwarded-for", "forwarded"]))]
    pub client_ip_header: Option<String>,
    /// Pass request headers whose names contain `_` upstream (default: drop them, as nginx).
    pub underscores_in_headers: Option<bool>,
    /// Request headers dropped when the peer is not a trusted proxy (default: the client-IP
    /// and URL-override headers, see `compile::DEFAULT_STRIP`).
    pub strip_untrusted_headers: Option<Vec<String>>,
    /// Where and how much request and response bodies are buffered.
    pub buffering: Option<Buffering>,
    /// The request-ID header (default `x-request-id`).
    pub request_id_header: Option<String>,
    /// How tollgate answers gRPC calls itself.
    pub grpc: Option<Grpc>,
    /// How identities are verified (the `jwt:CLAIM` key sources).
    pub identity: Option<Identity>,
    /// Envoy's rate limit service, answered by this process's limiter.
    pub rls: Option<Rls>,
    /// Traces exported to the operator's OpenTelemetry collector.
    pub telemetry: Option<Telemetry>,
    /// Where each kept list item stood in the file, when broken items were left out.
    #[serde(skip)]
    pub positions: Positions,
    /// A config file evaluated beside this one on every request, never enforced (its
    /// routes, limits, identity and limiter settings count; its listeners and admin do not).
    /// Relative to this file's directory.
    pub candidate: Option<String>,
}

/// Original indices of `listeners` and `routes` items (identity when nothing was left out).
#[derive(Debug, Default)]
pub struct Positions {
    pub listeners: Vec<usize>,
    pub routes: Vec<usize>,
    /// Upstreams that did not parse: routes naming them get no second error.
    pub broken_upstreams: Vec<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Listener {
    #[schemars(length(min = 1))]
    pub address: String,
    pub tls: Option<Tls>,
    pub timeouts: Option<ListenerTimeouts>,
    /// Open connections at once; beyond it new connections are closed at once.
    #[schemars(range(min = 1))]
    pub max_connections: Option<usize>,
    /// Requests on one connection before it is closed (HTTP/1.1 `Connection: close`, HTTP/2
    /// GOAWAY), so long-lived clients re-balance.
    pub max_requests_per_connection: Option<u64>,
    /// Largest request head (request line + headers), as `64KiB`: beyond it 431.
    #[schemars(pattern(SIZE))]
    pub max_header_bytes: Option<String>,
    /// Most header fields in a request: beyond it 431.
    pub max_headers: Option<usize>,
    /// Longest request target: beyond it 414.
    #[schemars(pattern(SIZE))]
    pub max_uri_bytes: Option<String>,
    pub http2: Option<Http2>,
    /// Expect a PROXY protocol v1/v2 header from a trusted proxy on every connection.
    #[serde(default)]
    pub proxy_protocol: bool,
    /// Share the port with another process already listening on it (a new binary taking over
    /// from the old one); without it, a port someone else serves is refused at start.
    #[serde(default)]
    pub share_port: bool,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListenerTimeouts {
    /// Until a request head is complete (also the first request of a new connection).
    #[schemars(pattern(POSITIVE_DURATION))]
    pub header_read: Option<String>,
    /// A keep-alive connection with no request in flight is closed after this long.
    #[schemars(pattern(POSITIVE_DURATION))]
    pub idle: Option<String>,
    #[schemars(pattern(POSITIVE_DURATION))]
    pub tls_handshake: Option<String>,
    /// A client that accepts no response bytes for this long is disconnected.
    #[schemars(pattern(POSITIVE_DURATION))]
    pub send: Option<String>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Http2 {
    pub max_concurrent_streams: Option<u32>,
    #[schemars(pattern(SIZE))]
    pub stream_window: Option<String>,
    #[schemars(pattern(SIZE))]
    pub connection_window: Option<String>,
    #[schemars(pattern(SIZE))]
    pub max_header_list: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    pub cert: String,
    pub key: String,
    /// More certificates, each chosen by SNI for the DNS names it carries.
    #[serde(default)]
    pub certificates: Vec<CertPair>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CertPair {
    pub cert: String,
    pub key: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Admin {
    pub address: String,
    /// A file holding the bearer token of the admin API (`/api/v1/`); without it the API is
    /// off. Read again on every reload, so a new token takes effect without a restart.
    pub token_file: Option<String>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Limiter {
    #[schemars(extend("x-choices" = ["local", "redis"]))]
    pub backend: Option<String>,
    pub redis: Option<Redis>,
    #[schemars(extend("x-choices" = ["open", "closed", "local"]))]
    pub on_failure: Option<String>,
    pub local_fallback: Option<LocalFallback>,
    pub local: Option<Local>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Redis {
    pub url: Option<String>,
    pub cluster: Option<Vec<String>>,
    /// The master a set of Sentinels names, instead of `url`.
    pub sentinel: Option<RedisSentinel>,
    /// The Redis servers' ACL user, when not in the URL.
    pub username: Option<String>,
    /// The Redis servers' password, when not in the URL (`${REDIS_PASSWORD}`).
    pub password: Option<String>,
    /// TLS files: a CA to trust, a client certificate and key.
    pub tls: Option<RedisTls>,
    /// The connections' `CLIENT SETNAME` (default `tollgate`).
    pub client_name: Option<String>,
    /// How long one check may wait for Redis before the limit's `on_failure` decides.
    #[schemars(pattern(DURATION))]
    pub timeout: Option<String>,
    /// Prefix of every key tollgate writes (default `tollgate:`).
    pub key_prefix: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedisSentinel {
    /// The master's name in the Sentinels' configuration.
    pub master: String,
    /// `host:port` of each Sentinel.
    pub nodes: Vec<String>,
    /// The Sentinels' own ACL user, if they require one.
    pub username: Option<String>,
    /// The Sentinels' own password (`requirepass` in sentinel.conf), if they require one.
    pub password: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedisTls {
    /// PEM file of the certificates to trust instead of the system roots.
    pub ca: Option<String>,
    /// PEM file of the client certificate chain, for servers that require one (with `key`).
    pub cert: Option<String>,
    /// PEM file of the client certificate's private key.
    pub key: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LocalFallback {
    pub divide_by: Option<u32>,
}

/// The `identity` section.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    pub jwt: Option<Jwt>,
}

/// `identity.jwt`: the keys and checks a bearer token passes before its claims identify it.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Jwt {
    /// File of the HS256 shared secret (at least 32 bytes; one trailing newline ignored).
    pub hs256_secret_file: Option<String>,
    /// JWKS file (`{"keys": [...]}`) of RS256 and ES256 public keys, chosen by `kid`.
    pub jwks_file: Option<String>,
    /// Accepted `iss` values; a token must carry one of them (default: not checked).
    #[serde(default)]
    pub issuers: Vec<String>,
    /// Accepted `aud` values; a token must name one of them (default: not checked).
    #[serde(default)]
    pub audiences: Vec<String>,
    /// How far `exp` and `nbf` may be off, for clock skew (default 60s).
    #[schemars(pattern(DURATION))]
    pub leeway: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Local {
    pub max_buckets: Option<usize>,
    /// Buckets one client address may hold in a limit keyed by something else than it.
    pub max_buckets_per_peer: Option<usize>,
}

#[derive(Debug, Deserialize, JsonSchema)]
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

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Upstream {
    #[schemars(length(min = 1))]
    pub targets: Vec<String>,
    #[schemars(pattern(DURATION))]
    pub connect_timeout: Option<String>,
    #[schemars(pattern(DURATION))]
    pub timeout: Option<String>,
    pub tls: Option<UpstreamTls>,
    pub keepalive: Option<Keepalive>,
    /// `round_robin` (default) or `least_request`.
    #[schemars(extend("x-choices" = ["round_robin", "least_request"]))]
    pub load_balancing: Option<String>,
    /// Extra attempts on other targets for a request that failed before it could be answered.
    pub retries: Option<u32>,
    pub health: Option<Health>,
    /// Requests in flight to each target at most: a number, or `adaptive` (learned from
    /// latency, within `adaptive`'s bounds). Requests past it wait in `queue`.
    pub max_in_flight: Option<MaxInFlight>,
    /// The adaptive cap's bounds and controller (with `max_in_flight: adaptive`).
    pub adaptive: Option<Adaptive>,
    /// Where requests wait while every target is at its cap.
    pub queue: Option<Queue>,
    /// How requests go to the targets: `http1` (default), `h2c` (HTTP/2 without TLS, by prior
    /// knowledge), `h2` (HTTP/2 over TLS, by ALPN) or `auto` (over TLS, as ALPN picks).
    #[schemars(extend("x-choices" = ["http1", "h2c", "h2", "auto"]))]
    pub protocol: Option<String>,
    /// HTTP/2 connections to the targets (with `protocol: h2c`, `h2` or `auto`).
    pub http2: Option<UpstreamHttp2>,
}

/// `upstreams.NAME.http2`: how HTTP/2 connections to the targets are shared.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UpstreamHttp2 {
    /// Streams (requests in flight) per connection at most: past it another connection is
    /// opened. At or below the backend's own `MAX_CONCURRENT_STREAMS`.
    #[schemars(range(min = 1))]
    pub max_concurrent_streams: Option<usize>,
}

/// `upstreams.NAME.max_in_flight`: a number, or `adaptive`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum MaxInFlight {
    Fixed(#[schemars(range(min = 1))] u64),
    #[schemars(extend("enum" = ["adaptive"]))]
    Word(String),
}

/// `upstreams.NAME.adaptive`: the learned cap's bounds and controller.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Adaptive {
    /// The lowest cap (and the concurrency no-load latency is probed at).
    pub min: Option<u64>,
    /// The highest cap.
    pub max: Option<u64>,
    /// How often the cap moves, at least (longer for slow backends: five no-load latencies).
    #[schemars(pattern(DURATION))]
    pub window: Option<String>,
    /// The latency over the no-load one that counts as keeping up (`1.1`: 10% more).
    pub tolerance: Option<f64>,
    /// How often the no-load latency is measured again.
    #[schemars(pattern(DURATION))]
    pub probe_every: Option<String>,
}

/// `upstreams.NAME.queue`: the waiting requests' bound and patience.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Queue {
    /// Requests waiting at once (0: refuse at once when every target is at its cap).
    pub size: Option<u64>,
    /// The longest a request waits for a slot before its `503`.
    #[schemars(pattern(DURATION))]
    pub timeout: Option<String>,
    /// The identity the queue is fair across, as a limit's `key` (default: the one the
    /// route's first limit counted the request under, else the client address).
    pub key: Option<Vec<String>>,
}

/// `upstreams.NAME.health`: when a target is taken out of rotation, and how it comes back.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Health {
    /// Consecutive failures that eject a target (0: passive checks off).
    pub max_fails: Option<u32>,
    /// The first ejection's length; each repeat doubles it.
    #[schemars(pattern(DURATION))]
    pub fail_timeout: Option<String>,
    /// The longest ejection.
    #[schemars(pattern(DURATION))]
    pub max_ejection: Option<String>,
    /// Upstream statuses counted as failures.
    #[serde(default)]
    pub failure_statuses: Vec<u16>,
    pub check: Option<HealthCheck>,
}

/// `upstreams.NAME.health.check`: the active health check.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthCheck {
    /// What is asked for: `GET path` (or `grpc` instead).
    pub path: Option<String>,
    /// gRPC's standard health check (`grpc.health.v1.Health/Check`) instead of `path`.
    pub grpc: Option<GrpcHealth>,
    #[schemars(pattern(DURATION))]
    pub interval: Option<String>,
    #[schemars(pattern(DURATION))]
    pub timeout: Option<String>,
    /// Consecutive passes that take a target back.
    pub healthy_threshold: Option<u32>,
    /// Consecutive failures that take it out.
    pub unhealthy_threshold: Option<u32>,
}

/// `upstreams.NAME.health.check.grpc`: the service asked about.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GrpcHealth {
    /// The service name sent in the check (empty, the default: the server as a whole).
    pub service: Option<String>,
}

/// `upstreams.NAME.keepalive`: the pool of idle connections to each target.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Keepalive {
    /// Idle connections kept per target, the whole proxy together (0: none are reused).
    pub max_idle: Option<usize>,
    /// How long a connection may sit idle before it is closed.
    #[schemars(pattern(DURATION))]
    pub idle_timeout: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTls {
    /// PEM file of the CA(s) to trust instead of the system's.
    pub ca: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Route {
    #[schemars(length(min = 1))]
    pub name: String,
    #[serde(rename = "match", default)]
    pub matcher: Match,
    pub upstream: Option<String>,
    pub respond: Option<Respond>,
    #[serde(default)]
    pub limits: Vec<Limit>,
    pub timeouts: Option<RouteTimeouts>,
    /// Largest request body, as `10MiB`: beyond it 413 (before reading when Content-Length
    /// says so).
    #[schemars(pattern(SIZE))]
    pub max_body: Option<String>,
    /// Proxy WebSocket upgrades on this route (off: `Upgrade` is stripped like any hop header).
    #[serde(default)]
    pub websocket: bool,
    /// Whether request and response bodies are buffered on this route (both by default).
    pub buffering: Option<RouteBuffering>,
    /// Send an idempotent request that reached a target which then failed to another target.
    #[serde(default)]
    pub retry_idempotent: bool,
    /// The route's class in its upstream's queue: `high`, `normal` (default) or `low`.
    #[schemars(extend("enum" = ["high", "normal", "low"]))]
    pub priority: Option<String>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteBuffering {
    pub request: Option<bool>,
    pub response: Option<bool>,
}

/// The proxy-wide `buffering` section.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Buffering {
    /// Directory of the temporary files bodies spill to.
    pub temp_dir: Option<String>,
    /// Bytes of one body kept in memory before the rest spills to a file.
    #[schemars(pattern(SIZE))]
    pub memory_per_body: Option<String>,
    /// Bytes of all buffered bodies in memory together.
    #[schemars(pattern(SIZE))]
    pub max_memory: Option<String>,
    /// Unread bytes one response may hold in its file.
    #[schemars(pattern(SIZE))]
    pub max_response_file: Option<String>,
    /// Bytes in temporary files, all bodies together: past it a response is streamed with
    /// backpressure and a request body that needs a file gets 503.
    #[schemars(pattern(SIZE))]
    pub max_spill: Option<String>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteTimeouts {
    /// Longest wait for the next piece of the request body: beyond it 408.
    #[schemars(pattern(DURATION))]
    pub body_idle: Option<String>,
    /// Whole request, body included; `0s` turns it off (for long uploads and streams).
    #[schemars(pattern(DURATION))]
    pub request: Option<String>,
    /// An open WebSocket tunnel with no byte either way for this long is closed.
    #[schemars(pattern(DURATION))]
    pub websocket_idle: Option<String>,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Match {
    pub host: Option<String>,
    /// Starts with `/`.
    #[schemars(regex(pattern = r"^/|\$\{"))]
    pub path: Option<String>,
    #[schemars(regex(pattern = r"^/|\$\{"))]
    pub path_prefix: Option<String>,
    #[schemars(length(min = 1))]
    pub methods: Option<Vec<String>>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// `sensitive` (default) or `insensitive`: compare the path without ASCII case, for
    /// backends that do (IIS).
    #[schemars(extend("x-choices" = ["sensitive", "insensitive"]))]
    pub path_case: Option<String>,
    /// With an exact `path`: also match it with a file extension (`/login.json`, as Spring
    /// MVC's suffix pattern matching serves it), routed and limited as the path.
    pub path_extensions: Option<bool>,
}

/// `grpc:`: tollgate's own answers to gRPC calls.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Grpc {
    /// The gRPC status of a call a rate limit refused: `resource_exhausted` (8, the default)
    /// or `unavailable` (14, as Envoy answers by default).
    #[schemars(extend("x-choices" = ["resource_exhausted", "unavailable"]))]
    pub limited_status: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
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
