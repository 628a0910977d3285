//! Validation is the conversion: raw `file::File` -> `Snapshot`, collecting every problem.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use ipnet::IpNet;

use super::file;
use super::values;
use super::{Backend, LimiterSettings, Listener, Problem, Snapshot, TlsSettings};
use crate::body::BodyLimits;
use crate::forward::{Upstream, UpstreamSpec};
use crate::identity::{Alternative, Exemption, ForwardedHeader, KeySpec};
use crate::limiter::redis::RedisConfig;
use crate::limiter::{local::Buckets, FailurePolicy, Limit, Rate};
use crate::response::HeaderPolicy;
use crate::route::{Action, HostPattern, Matcher, PathPattern, Respond, Route};
use crate::server::ListenerSettings;

/// Collects problems with the field path each belongs to.
#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
            at: None,
        });
    }

    /// Keep the value, or record the error and return `None`.
    fn take<T>(&mut self, path: impl Into<String>, r: Result<T, String>) -> Option<T> {
        r.map_err(|e| self.add(path, e)).ok()
    }
}

/// Compile a parsed file. `previous` lends its limiter state to limits that did not change.
pub fn compile(raw: &file::File, previous: Option<&Snapshot>) -> Result<Snapshot, Vec<Problem>> {
    let mut p = Problems::default();
    let listeners = listeners(&raw.listeners, &raw.positions.listeners, &mut p);
    let admin = raw
        .admin
        .as_ref()
        .and_then(|a| p.take("admin.address", parse_addr(&a.address)));
    let trusted_proxies: Vec<IpNet> = raw
        .trusted_proxies
        .iter()
        .enumerate()
        .filter_map(|(i, s)| p.take(format!("trusted_proxies[{i}]"), parse_net(s)))
        .collect();
    let limiter = limiter(&raw.limiter, &mut p);
    let client_ip_header = match raw.client_ip_header.as_deref() {
        None | Some("x-forwarded-for") => ForwardedHeader::XForwardedFor,
        Some("forwarded") => ForwardedHeader::Forwarded,
        Some(other) => {
            p.add(
                "client_ip_header",
                format!("`{other}` is not x-forwarded-for or forwarded"),
            );
            ForwardedHeader::XForwardedFor
        }
    };
    let shutdown_timeout = duration_or(
        &mut p,
        "shutdown_timeout".into(),
        raw.shutdown_timeout.as_ref(),
        Duration::from_secs(30),
    );
    let upstreams = upstreams(&raw.upstreams, previous, &mut p);
    let old_limits: HashMap<&str, &Arc<Limit>> = previous
        .map(|s| s.limits().map(|l| (&*l.name, l)).collect())
        .unwrap_or_default();
    let mut ctx = RouteCtx {
        upstreams: &upstreams,
        limiter: &limiter,
        old_limits,
        limit_names: HashSet::new(),
        broken_upstreams: &raw.positions.broken_upstreams,
    };
    let mut route_names = HashSet::new();
    let mut routes = Vec::new();
    for (i, r) in raw.routes.iter().enumerate() {
        let path = format!("routes[{}]", raw.positions.routes.get(i).unwrap_or(&i));
        if !route_names.insert(r.name.as_str()) {
            p.add(
                format!("{path}.name"),
                format!("duplicate route name `{}`", r.name),
            );
        }
        if let Some(route) = route(r, &path, &mut ctx, &mut p) {
            routes.push(route);
        }
    }
    whole_file_checks(raw, &listeners, &trusted_proxies, &mut p);
    if !p.0.is_empty() {
        return Err(p.0);
    }
    Ok(Snapshot {
        route_index: crate::route::Index::new(&routes),
        routes,
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
        max_inflight: raw.max_inflight.unwrap_or(10_000),
        underscores_in_headers: raw.underscores_in_headers.unwrap_or(false),
        redis: None,
        fingerprints: fingerprints(raw),
        source: String::new(),
        inputs_digest: [0; 32],
    })
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

/// Rules that span sections of the file.
fn whole_file_checks(
    raw: &file::File,
    listeners: &[Listener],
    trusted: &[IpNet],
    p: &mut Problems,
) {
    if raw.max_inflight == Some(0) {
        p.add("max_inflight", "must be at least 1");
    }
    if trusted.is_empty() && raw.listeners.iter().any(|l| l.proxy_protocol) {
        let i = raw
            .listeners
            .iter()
            .position(|l| l.proxy_protocol)
            .unwrap_or(0);
        let i = raw.positions.listeners.get(i).copied().unwrap_or(i);
        p.add(
            format!("listeners[{i}].proxy_protocol"),
            "needs `trusted_proxies`: PROXY headers are accepted only from them",
        );
    }
    // Broken listener items were reported already; only a file with none asks for one.
    if listeners.is_empty() && raw.listeners.is_empty() && raw.positions.listeners.is_empty() {
        p.add(
            "listeners",
            "at least one listener is needed, as in `- address: 0.0.0.0:8000`",
        );
    }
}

fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("`{s}` is not an address like `0.0.0.0:8000` or `[::]:8000`"))
}

fn parse_net(s: &str) -> Result<IpNet, String> {
    s.parse::<IpNet>()
        .or_else(|_| s.parse::<std::net::IpAddr>().map(IpNet::from))
        .map_err(|_| format!("`{s}` is not a CIDR like `10.0.0.0/8` or an IP address"))
}

fn listeners(raw: &[file::Listener], positions: &[usize], p: &mut Problems) -> Vec<Listener> {
    let mut seen = HashSet::new();
    raw.iter()
        .enumerate()
        .filter_map(|(i, l)| {
            let i = positions.get(i).copied().unwrap_or(i);
            let address = p.take(format!("listeners[{i}].address"), parse_addr(&l.address))?;
            // Port 0 asks for a free port: two of them are two listeners.
            if address.port() != 0 && !seen.insert(address) {
                p.add(
                    format!("listeners[{i}].address"),
                    format!("`{address}` is listed twice"),
                );
            }
            let tls = l
                .tls
                .as_ref()
                .and_then(|t| tls(t, &format!("listeners[{i}].tls"), p));
            let settings = listener_settings(l, &format!("listeners[{i}]"), p);
            Some(Listener {
                address,
                tls,
                settings,
            })
        })
        .collect()
}

fn listener_settings(l: &file::Listener, path: &str, p: &mut Problems) -> ListenerSettings {
    let defaults = ListenerSettings::default();
    let timeouts = l.timeouts.as_ref();
    let mut timeout = |key: &str, raw: Option<&String>, default: Duration| {
        let value = duration_or(p, format!("{path}.timeouts.{key}"), raw, default);
        if value.is_zero() {
            p.add(format!("{path}.timeouts.{key}"), "must be longer than zero");
        }
        value
    };
    let header_read_timeout = timeout(
        "header_read",
        timeouts.and_then(|t| t.header_read.as_ref()),
        defaults.header_read_timeout,
    );
    let idle_timeout = timeout(
        "idle",
        timeouts.and_then(|t| t.idle.as_ref()),
        defaults.idle_timeout,
    );
    let tls_handshake_timeout = timeout(
        "tls_handshake",
        timeouts.and_then(|t| t.tls_handshake.as_ref()),
        defaults.tls_handshake_timeout,
    );
    let mut sizes = Sizes { path, p };
    let h2 = l.http2.as_ref();
    let window = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    ListenerSettings {
        header_read_timeout,
        idle_timeout,
        tls_handshake_timeout,
        max_connections: sizes.count(
            "max_connections",
            l.max_connections.map(|v| v as u64),
            defaults.max_connections as u64,
        ) as usize,
        max_requests_per_connection: sizes.count(
            "max_requests_per_connection",
            l.max_requests_per_connection,
            defaults.max_requests_per_connection,
        ),
        max_header_bytes: sizes.bytes(
            "max_header_bytes",
            l.max_header_bytes.as_ref(),
            defaults.max_header_bytes as u64,
            8192,
        ) as usize,
        max_headers: sizes.count(
            "max_headers",
            l.max_headers.map(|v| v as u64),
            defaults.max_headers as u64,
        ) as usize,
        max_uri_bytes: sizes.bytes(
            "max_uri_bytes",
            l.max_uri_bytes.as_ref(),
            defaults.max_uri_bytes as u64,
            64,
        ) as usize,
        h2_max_concurrent_streams: window(sizes.count(
            "http2.max_concurrent_streams",
            h2.and_then(|h| h.max_concurrent_streams).map(u64::from),
            u64::from(defaults.h2_max_concurrent_streams),
        )),
        h2_stream_window: sizes.window(
            "http2.stream_window",
            h2.and_then(|h| h.stream_window.as_ref()),
            u64::from(defaults.h2_stream_window),
        ),
        h2_connection_window: sizes.window(
            "http2.connection_window",
            h2.and_then(|h| h.connection_window.as_ref()),
            u64::from(defaults.h2_connection_window),
        ),
        proxy_protocol: l.proxy_protocol,
        h2_max_header_list: sizes.window(
            "http2.max_header_list",
            h2.and_then(|h| h.max_header_list.as_ref()),
            u64::from(defaults.h2_max_header_list),
        ),
    }
}

const H2_MAX_WINDOW: u64 = (1 << 31) - 1;

/// Reads the size and count keys of one listener, reporting bad values under `path`.
struct Sizes<'a, 'b> {
    path: &'a str,
    p: &'b mut Problems,
}

impl Sizes<'_, '_> {
    fn bytes(&mut self, key: &str, raw: Option<&String>, default: u64, min: u64) -> u64 {
        let field = format!("{}.{key}", self.path);
        let value = raw
            .and_then(|s| self.p.take(field.clone(), values::size(s)))
            .unwrap_or(default);
        if value < min {
            self.p.add(field, format!("must be at least {min} bytes"));
        }
        value
    }

    /// An HTTP/2 window or list size: 1 KiB to 2^31-1 bytes (RFC 9113 6.9.1).
    fn window(&mut self, key: &str, raw: Option<&String>, default: u64) -> u32 {
        let value = self.bytes(key, raw, default, 1024);
        if value > H2_MAX_WINDOW {
            self.p.add(
                format!("{}.{key}", self.path),
                format!("must be at most {H2_MAX_WINDOW} bytes (2^31-1, the HTTP/2 limit)"),
            );
        }
        u32::try_from(value.min(H2_MAX_WINDOW)).unwrap_or(u32::MAX)
    }

    fn count(&mut self, key: &str, raw: Option<u64>, default: u64) -> u64 {
        if raw == Some(0) {
            self.p
                .add(format!("{}.{key}", self.path), "must be at least 1");
        }
        raw.unwrap_or(default).max(1)
    }
}

/// Load the listener's certificates now, so `check` and a reload catch a bad file.
fn tls(t: &file::Tls, path: &str, p: &mut Problems) -> Option<TlsSettings> {
    let first = crate::tls::CertFiles {
        cert: t.cert.clone().into(),
        key: t.key.clone().into(),
    };
    let more = t.certificates.iter().map(|c| crate::tls::CertFiles {
        cert: c.cert.clone().into(),
        key: c.key.clone().into(),
    });
    let files: Vec<_> = std::iter::once(first).chain(more).collect();
    let config = p.take(path.to_owned(), crate::tls::server_config(&files))?;
    Some(TlsSettings { files, config })
}

fn policy(s: &str) -> Result<FailurePolicy, String> {
    match s {
        "open" => Ok(FailurePolicy::Open),
        "closed" => Ok(FailurePolicy::Closed),
        "local" => Ok(FailurePolicy::Local),
        _ => Err(format!(
            "`{s}` is not a failure policy (open, closed or local)"
        )),
    }
}

fn limiter(raw: &file::Limiter, p: &mut Problems) -> LimiterSettings {
    let on_failure = raw
        .on_failure
        .as_deref()
        .and_then(|s| p.take("limiter.on_failure", policy(s)))
        .unwrap_or(FailurePolicy::Open);
    let redis = raw.redis.as_ref().and_then(|r| redis(r, p));
    let backend = match raw.backend.as_deref() {
        None | Some("local") => {
            if raw.redis.is_some() {
                p.add("limiter.redis", "is set but `limiter.backend` is `local`: set `backend: redis` to use it, or remove the block");
            }
            Backend::Local
        }
        Some("redis") => match redis {
            Some(cfg) => Backend::Redis(cfg),
            None => {
                if raw.redis.is_none() {
                    p.add(
                        "limiter.redis",
                        "`backend: redis` needs a `redis:` block with `url` or `cluster`",
                    );
                }
                Backend::Local
            }
        },
        Some(other) => {
            p.add(
                "limiter.backend",
                format!("`{other}` is not a backend (local or redis)"),
            );
            Backend::Local
        }
    };
    let divide_by = raw
        .local_fallback
        .as_ref()
        .and_then(|f| f.divide_by)
        .unwrap_or(1);
    if divide_by == 0 {
        p.add("limiter.local_fallback.divide_by", "must be at least 1");
    }
    let max_buckets = raw
        .local
        .as_ref()
        .and_then(|l| l.max_buckets)
        .unwrap_or(1_000_000);
    if max_buckets == 0 {
        p.add("limiter.local.max_buckets", "must be at least 1");
    }
    LimiterSettings {
        backend,
        on_failure,
        divide_by: divide_by.max(1),
        max_buckets: max_buckets.max(1),
    }
}

fn redis(r: &file::Redis, p: &mut Problems) -> Option<RedisConfig> {
    let check_url = |path: String, url: &str, p: &mut Problems| {
        let r = redis::IntoConnectionInfo::into_connection_info(url)
            .map(|_| ())
            .map_err(|e| format!("`{url}` is not a Redis URL (redis://[user:password@]host:port[/db] or rediss://...): {e}"));
        p.take(path, r)
    };
    let (url, cluster) = match (&r.url, &r.cluster) {
        (Some(url), None) => (Some(url.clone()), Vec::new()),
        (None, Some(nodes)) if !nodes.is_empty() => (None, nodes.clone()),
        (None, Some(_)) => {
            p.add("limiter.redis.cluster", "needs at least one node URL");
            return None;
        }
        (None, None) => {
            p.add(
                "limiter.redis",
                "needs `url` (one server) or `cluster` (a list of node URLs)",
            );
            return None;
        }
        (Some(_), Some(_)) => {
            p.add(
                "limiter.redis",
                "use `url` (one server) or `cluster`, not both",
            );
            return None;
        }
    };
    let mut ok = url
        .as_deref()
        .is_none_or(|u| check_url("limiter.redis.url".into(), u, p).is_some());
    for (i, node) in cluster.iter().enumerate() {
        ok &= check_url(format!("limiter.redis.cluster[{i}]"), node, p).is_some();
    }
    let timeout = duration_or(
        p,
        "limiter.redis.timeout".into(),
        r.timeout.as_ref(),
        Duration::from_millis(50),
    );
    if timeout.is_zero() {
        p.add("limiter.redis.timeout", "must be longer than zero");
    }
    ok.then(|| RedisConfig {
        url,
        cluster,
        timeout,
        key_prefix: r.key_prefix.clone().unwrap_or_else(|| "tollgate:".into()),
    })
}

fn duration_or(
    p: &mut Problems,
    path: String,
    raw: Option<&String>,
    default: Duration,
) -> Duration {
    raw.and_then(|s| p.take(path, values::duration(s)))
        .unwrap_or(default)
}

/// `keepalive.idle_timeout` when unset (as Go's and Traefik's transport).
const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

fn upstreams(
    raw: &std::collections::BTreeMap<String, file::Upstream>,
    previous: Option<&Snapshot>,
    p: &mut Problems,
) -> HashMap<String, Option<Arc<Upstream>>> {
    // The previous config's upstreams: an unchanged one is kept, with its warm connections.
    let old: HashMap<&str, &Arc<Upstream>> = previous
        .map(|s| s.upstreams().map(|u| (&*u.name, u)).collect())
        .unwrap_or_default();
    let mut out = HashMap::new();
    for (name, u) in raw {
        let path = format!("upstreams.{name}");
        if u.targets.is_empty() {
            p.add(
                format!("{path}.targets"),
                "needs at least one target, as in `[127.0.0.1:8080]`",
            );
        }
        let parsed: Vec<(Scheme, Authority)> = u
            .targets
            .iter()
            .enumerate()
            .filter_map(|(i, t)| p.take(format!("{path}.targets[{i}]"), target(t)))
            .collect();
        let scheme = parsed.first().map_or(Scheme::HTTP, |(s, _)| s.clone());
        if parsed.iter().any(|(s, _)| *s != scheme) {
            p.add(
                format!("{path}.targets"),
                "mixes http and https targets: use one scheme per upstream",
            );
        }
        let targets: Vec<Authority> = parsed.into_iter().map(|(_, a)| a).collect();
        let ca = u
            .tls
            .as_ref()
            .and_then(|t| t.ca.as_deref())
            .map(std::path::Path::new);
        if ca.is_some() && scheme != Scheme::HTTPS {
            p.add(format!("{path}.tls"), "is only used with https:// targets");
        }
        let tls = if scheme == Scheme::HTTPS {
            p.take(format!("{path}.tls.ca"), crate::forward::client_tls(ca))
        } else {
            Some(plain_tls())
        };
        let connect = duration_or(
            p,
            format!("{path}.connect_timeout"),
            u.connect_timeout.as_ref(),
            Duration::from_secs(5),
        );
        let timeout = duration_or(
            p,
            format!("{path}.timeout"),
            u.timeout.as_ref(),
            Duration::from_secs(30),
        );
        let keepalive = u.keepalive.as_ref();
        let idle_timeout = duration_or(
            p,
            format!("{path}.keepalive.idle_timeout"),
            keepalive.and_then(|k| k.idle_timeout.as_ref()),
            DEFAULT_IDLE_TIMEOUT,
        );
        let max_idle = keepalive.and_then(|k| k.max_idle);
        for (field, d) in [
            ("connect_timeout", connect),
            ("timeout", timeout),
            ("keepalive.idle_timeout", idle_timeout),
        ] {
            if d.is_zero() {
                p.add(format!("{path}.{field}"), "must be longer than zero");
            }
        }
        // A broken upstream is still known by name, so routes using it get no second error.
        let upstream = tls
            .filter(|_| !targets.is_empty() && targets.len() == u.targets.len())
            .map(|tls| {
                let spec = UpstreamSpec {
                    scheme,
                    targets,
                    connect_timeout: connect,
                    timeout,
                    max_idle,
                    idle_timeout,
                    tls,
                };
                let fingerprint = upstream_fingerprint(&spec, ca);
                match old.get(name.as_str()) {
                    Some(kept) if kept.fingerprint == fingerprint => Arc::clone(kept),
                    _ => Arc::new(Upstream::new(name, spec, fingerprint)),
                }
            });
        out.insert(name.clone(), upstream);
    }
    out
}

/// What makes two upstreams the same for a reload: scheme, targets, timeouts, keep-alive
/// settings, and the bytes of the CA file (a renewed CA must reach new connections).
fn upstream_fingerprint(spec: &UpstreamSpec, ca: Option<&std::path::Path>) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(spec.scheme.as_str().as_bytes());
    for t in &spec.targets {
        h.update(b"\0");
        h.update(t.as_str().as_bytes());
    }
    h.update(&spec.connect_timeout.as_nanos().to_le_bytes());
    h.update(&spec.timeout.as_nanos().to_le_bytes());
    h.update(&spec.max_idle.map_or(u64::MAX, |n| n as u64).to_le_bytes());
    h.update(&spec.idle_timeout.as_nanos().to_le_bytes());
    if let Some(ca) = ca {
        h.update(b"\0ca\0");
        h.update(&std::fs::read(ca).unwrap_or_default());
    }
    *h.finalize().as_bytes()
}

/// `host:port` or `http://host:port` (http), `https://host[:port]` (https, port 443 by default).
fn target(s: &str) -> Result<(Scheme, Authority), String> {
    let (scheme, bare, default_port) = if let Some(rest) = s.strip_prefix("https://") {
        (Scheme::HTTPS, rest, Some(443))
    } else {
        (Scheme::HTTP, s.strip_prefix("http://").unwrap_or(s), None)
    };
    let bare = bare.strip_suffix('/').unwrap_or(bare);
    let bad = || {
        format!("`{s}` is not a target like `127.0.0.1:8080`, `backend.internal:80` or `https://api.internal`")
    };
    let authority = bare.parse::<Authority>().map_err(|_| bad())?;
    if authority.host().is_empty() || bare.contains(['/', '@', '?']) {
        return Err(bad());
    }
    match (authority.port_u16(), default_port) {
        (Some(_), _) => Ok((scheme, authority)),
        (None, Some(port)) => {
            let with_port = format!("{}:{port}", authority.host());
            Ok((scheme, with_port.parse().map_err(|_| bad())?))
        }
        (None, None) => Err(format!("`{s}` needs a port, as in `{bare}:8080`")),
    }
}

/// A placeholder TLS client for plain-http upstreams: never used for a handshake.
fn plain_tls() -> Arc<rustls::ClientConfig> {
    static PLAIN: std::sync::LazyLock<Arc<rustls::ClientConfig>> = std::sync::LazyLock::new(|| {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map(|b| {
                b.with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth()
            });
        Arc::new(
            config.unwrap_or_else(|_| unreachable!("ring supports the default protocol versions")),
        )
    });
    PLAIN.clone()
}

struct RouteCtx<'a> {
    upstreams: &'a HashMap<String, Option<Arc<Upstream>>>,
    limiter: &'a LimiterSettings,
    old_limits: HashMap<&'a str, &'a Arc<Limit>>,
    limit_names: HashSet<String>,
    broken_upstreams: &'a [String],
}

fn valid_name(s: &str) -> Result<(), String> {
    if s.len() > 128 {
        return Err(format!("name `{s}` is longer than 128 characters"));
    }
    let ok = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "name `{s}` may only use letters, digits, `_`, `.` and `-`"
        ))
    }
}

fn route(r: &file::Route, path: &str, ctx: &mut RouteCtx<'_>, p: &mut Problems) -> Option<Route> {
    p.take(format!("{path}.name"), valid_name(&r.name));
    let matcher = matcher(&r.matcher, &format!("{path}.match"), p);
    let action = match (&r.upstream, &r.respond) {
        (Some(name), None) => match ctx.upstreams.get(name) {
            Some(u) => u.clone().map(Action::Forward),
            None => {
                if !ctx.broken_upstreams.contains(name) {
                    p.add(
                        format!("{path}.upstream"),
                        format!("unknown upstream `{name}`"),
                    );
                }
                None
            }
        },
        (None, Some(respond)) => respond_action(respond, &format!("{path}.respond"), p),
        (Some(_), Some(_)) => {
            p.add(path, "a route has either `upstream` or `respond`, not both");
            None
        }
        (None, None) => {
            p.add(path, "a route needs `upstream: NAME` or `respond: {...}`");
            None
        }
    };
    let limits: Vec<Arc<Limit>> = r
        .limits
        .iter()
        .enumerate()
        .filter_map(|(i, l)| limit(l, &format!("{path}.limits[{i}]"), ctx, p))
        .collect();
    let body = body_limits(r, path, p);
    Some(Route {
        name: r.name.as_str().into(),
        matcher: matcher?,
        action: action?,
        rendered: limits
            .iter()
            .map(|l| crate::response::Rendered::of(l))
            .collect(),
        limits,
        body,
        websocket: r.websocket,
        websocket_idle: websocket_idle(r, path, p),
        counters: std::sync::OnceLock::new(),
    })
}

fn websocket_idle(r: &file::Route, path: &str, p: &mut Problems) -> Duration {
    let key = format!("{path}.timeouts.websocket_idle");
    let idle = duration_or(
        p,
        key.clone(),
        r.timeouts.as_ref().and_then(|t| t.websocket_idle.as_ref()),
        Duration::from_secs(3600),
    );
    if idle.is_zero() {
        p.add(key, "must be longer than zero");
    }
    idle
}

fn body_limits(r: &file::Route, path: &str, p: &mut Problems) -> BodyLimits {
    let d = BodyLimits::default();
    let t = r.timeouts.as_ref();
    let idle = duration_or(
        p,
        format!("{path}.timeouts.body_idle"),
        t.and_then(|t| t.body_idle.as_ref()),
        d.idle,
    );
    if idle.is_zero() {
        p.add(
            format!("{path}.timeouts.body_idle"),
            "must be longer than zero",
        );
    }
    let request = duration_or(
        p,
        format!("{path}.timeouts.request"),
        t.and_then(|t| t.request.as_ref()),
        d.request.unwrap_or_default(),
    );
    let max_bytes = r
        .max_body
        .as_ref()
        .and_then(|s| p.take(format!("{path}.max_body"), values::size(s)))
        .unwrap_or(d.max_bytes);
    BodyLimits {
        idle,
        request: (!request.is_zero()).then_some(request),
        max_bytes,
    }
}

fn matcher(m: &file::Match, path: &str, p: &mut Problems) -> Option<Matcher> {
    let host = m
        .host
        .as_ref()
        .and_then(|h| p.take(format!("{path}.host"), HostPattern::parse(h)));
    let must_start_with_slash = |s: &String| {
        if s.starts_with('/') {
            Ok(s.clone())
        } else {
            Err(format!("`{s}` must start with `/`"))
        }
    };
    let path_pattern = match (&m.path, &m.path_prefix) {
        (None, None) => PathPattern::Any,
        (Some(x), None) => {
            PathPattern::Exact(p.take(format!("{path}.path"), must_start_with_slash(x))?)
        }
        (None, Some(x)) => {
            PathPattern::Prefix(p.take(format!("{path}.path_prefix"), must_start_with_slash(x))?)
        }
        (Some(_), Some(_)) => {
            p.add(path, "use `path` (exact) or `path_prefix`, not both");
            return None;
        }
    };
    if m.methods.as_ref().is_some_and(Vec::is_empty) {
        p.add(
            format!("{path}.methods"),
            "is empty, so the route could never match: list methods or remove the key",
        );
    }
    let methods = m.methods.as_ref().map(|ms| {
        ms.iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let r = Method::from_bytes(s.to_ascii_uppercase().as_bytes())
                    .map_err(|_| format!("`{s}` is not an HTTP method"));
                p.take(format!("{path}.methods[{i}]"), r)
            })
            .collect()
    });
    let headers = m
        .headers
        .iter()
        .filter_map(|(k, v)| {
            let name = p.take(
                format!("{path}.headers.{k}"),
                HeaderName::from_bytes(k.as_bytes())
                    .map_err(|_| format!("`{k}` is not a valid header name")),
            );
            let value = p.take(
                format!("{path}.headers.{k}"),
                HeaderValue::from_str(v).map_err(|_| format!("`{v}` is not a valid header value")),
            );
            Some((name?, value?))
        })
        .collect();
    Some(Matcher {
        host,
        path: path_pattern,
        methods,
        headers,
    })
}

fn respond_action(r: &file::Respond, path: &str, p: &mut Problems) -> Option<Action> {
    let status = p.take(
        format!("{path}.status"),
        StatusCode::from_u16(r.status)
            .ok()
            .filter(|s| (200..=599).contains(&s.as_u16()))
            .ok_or_else(|| format!("`{}` is not a final HTTP status (200-599)", r.status)),
    );
    let mut headers = HeaderMap::new();
    for (k, v) in &r.headers {
        let kv = HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| format!("`{k}` is not a valid header name"))
            .and_then(|n| {
                Ok((
                    n,
                    HeaderValue::from_str(v)
                        .map_err(|_| format!("`{v}` is not a valid header value"))?,
                ))
            });
        if let Some((n, v)) = p.take(format!("{path}.headers.{k}"), kv) {
            headers.insert(n, v);
        }
    }
    Some(Action::Respond(Respond {
        status: status?,
        body: Bytes::from(r.body.clone()),
        headers,
    }))
}

fn limit(
    l: &file::Limit,
    path: &str,
    ctx: &mut RouteCtx<'_>,
    p: &mut Problems,
) -> Option<Arc<Limit>> {
    p.take(format!("{path}.name"), valid_name(&l.name));
    if !ctx.limit_names.insert(l.name.clone()) {
        p.add(
            format!("{path}.name"),
            format!(
                "duplicate limit name `{}` (limit names are global: they name buckets)",
                l.name
            ),
        );
    }
    let rate = p.take(format!("{path}.rate"), values::rate(&l.rate));
    let burst = match (l.burst, rate) {
        (Some(0), _) => {
            p.add(format!("{path}.burst"), "must be at least 1");
            None
        }
        (Some(b), _) => Some(b),
        (None, Some(r)) => Some(r.count.ceil().clamp(1.0, f64::from(u32::MAX)) as u32),
        (None, None) => None,
    };
    let cost = l.cost.unwrap_or(1);
    if cost == 0 {
        p.add(format!("{path}.cost"), "must be at least 1");
    }
    if let Some(b) = burst {
        if cost > b {
            p.add(
                format!("{path}.cost"),
                format!("cost {cost} is larger than burst {b}: no request could ever pass"),
            );
        }
    }
    if l.key.is_empty() {
        p.add(
            format!("{path}.key"),
            "needs at least one source, as in `[ip]`",
        );
    }
    let key = KeySpec(
        l.key
            .iter()
            .enumerate()
            .filter_map(|(i, k)| p.take(format!("{path}.key[{i}]"), Alternative::parse(k)))
            .collect(),
    );
    let exempt = l
        .exempt
        .iter()
        .enumerate()
        .filter_map(|(i, e)| p.take(format!("{path}.exempt[{i}]"), Exemption::parse(e)))
        .collect();
    let on_failure = match &l.on_failure {
        Some(s) => p.take(format!("{path}.on_failure"), policy(s))?,
        None => ctx.limiter.on_failure,
    };
    let rate = Rate {
        per_sec: rate?.per_sec(),
        burst: burst?,
    };
    let local = match ctx.old_limits.get(l.name.as_str()) {
        Some(old) if old.rate == rate => old.local.clone(),
        _ => Arc::new(Buckets::new(ctx.limiter.max_buckets)),
    };
    let fallback = Rate {
        per_sec: rate.per_sec / f64::from(ctx.limiter.divide_by),
        burst: (rate.burst / ctx.limiter.divide_by).max(1),
    };
    Some(Arc::new(Limit {
        name: l.name.as_str().into(),
        rate,
        cost,
        shadow: l.shadow,
        key,
        exempt,
        on_failure,
        local,
        fallback,
    }))
}
