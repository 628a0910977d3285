//! The `upstreams` section: targets, scheme, timeouts, keep-alive and trust (balancing,
//! retries and health are `health`'s).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, Scheme};

use super::{duration_or, health, Problems};
use crate::config::file;
use crate::config::settings::{Protocol, UpstreamSpec};

/// `keepalive.idle_timeout` when unset (as Go's and Traefik's transport).
const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Every upstream by name; `None` for one with problems (still known, so routes naming it get
/// no second error).
pub(super) fn upstreams(
    raw: &std::collections::BTreeMap<String, file::Upstream>,
    p: &mut Problems,
) -> HashMap<String, Option<Arc<UpstreamSpec>>> {
    let mut out = HashMap::new();
    for (name, u) in raw {
        let path = format!("upstreams.{name}");
        let (scheme, targets) = targets(u, &path, p);
        let ca = u
            .tls
            .as_ref()
            .and_then(|t| t.ca.as_deref())
            .map(std::path::Path::new);
        if ca.is_some() && scheme != Scheme::HTTPS {
            p.add(format!("{path}.tls"), "is only used with https:// targets");
        }
        let tls = if scheme == Scheme::HTTPS {
            p.take(format!("{path}.tls.ca"), crate::tls::client_config(ca))
        } else {
            Some(plain_tls())
        };
        let (connect, timeout, idle_timeout) = timeouts(u, &path, p);
        let max_idle = u.keepalive.as_ref().and_then(|k| k.max_idle);
        let protocol = protocol(u.protocol.as_deref(), &scheme, &path, p);
        let max_streams = max_streams(u.http2.as_ref(), protocol, &path, p);
        let (balance, retries, health) = health::resilience(u, &path, p);
        if protocol == Protocol::Http1 && health.check.as_ref().is_some_and(|c| c.grpc.is_some()) {
            p.add(
                format!("{path}.health.check.grpc"),
                "gRPC's health check needs an HTTP/2 upstream: set `protocol: h2c` (or `h2`)",
            );
        }
        let (capacity, queue_key) = super::capacity::capacity(u, &path, p);
        // A broken upstream is still known by name, so routes using it get no second error.
        let upstream = tls
            .filter(|_| !targets.is_empty() && targets.len() == u.targets.len())
            .map(|tls| {
                let mut spec = UpstreamSpec {
                    name: name.as_str().into(),
                    scheme,
                    protocol,
                    max_streams,
                    targets,
                    connect_timeout: connect,
                    timeout,
                    max_idle,
                    idle_timeout,
                    tls,
                    balance,
                    retries,
                    health,
                    capacity,
                    queue_key,
                    fingerprint: [0; 32],
                };
                spec.fingerprint = upstream_fingerprint(&spec, ca);
                Arc::new(spec)
            });
        out.insert(name.clone(), upstream);
    }
    out
}

/// `targets`, parsed, with the one scheme they share.
fn targets(u: &file::Upstream, path: &str, p: &mut Problems) -> (Scheme, Vec<Authority>) {
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
    (scheme, parsed.into_iter().map(|(_, a)| a).collect())
}

/// `connect_timeout`, `timeout` and `keepalive.idle_timeout`, each longer than zero.
fn timeouts(u: &file::Upstream, path: &str, p: &mut Problems) -> (Duration, Duration, Duration) {
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
    for (field, d) in [
        ("connect_timeout", connect),
        ("timeout", timeout),
        ("keepalive.idle_timeout", idle_timeout),
    ] {
        if d.is_zero() {
            p.add(format!("{path}.{field}"), "must be longer than zero");
        }
    }
    (connect, timeout, idle_timeout)
}

/// `protocol`, checked against the targets' scheme.
fn protocol(raw: Option<&str>, scheme: &Scheme, path: &str, p: &mut Problems) -> Protocol {
    let tls = *scheme == Scheme::HTTPS;
    let (protocol, wrong) = match raw.unwrap_or("http1") {
        "http1" => (Protocol::Http1, None),
        "h2c" => (
            Protocol::H2c,
            tls.then_some("`h2c` is HTTP/2 without TLS, for http:// targets; over TLS write `h2`"),
        ),
        "h2" => (
            Protocol::H2,
            (!tls).then_some("`h2` is HTTP/2 over TLS, for https:// targets; without TLS write `h2c`"),
        ),
        "auto" => (
            Protocol::Auto,
            (!tls).then_some(
                "`auto` picks the version by TLS (ALPN), for https:// targets; for http:// targets write `http1` or `h2c`",
            ),
        ),
        other => {
            p.add(
                format!("{path}.protocol"),
                format!("`{other}` is not an upstream protocol (http1, h2c, h2 or auto)"),
            );
            return Protocol::Http1;
        }
    };
    if let Some(wrong) = wrong {
        p.add(format!("{path}.protocol"), wrong);
    }
    protocol
}

/// The streams an HTTP/2 connection carries at most before another is opened: 100 by
/// default, the least RFC 9113 recommends a server allows (nginx allows 128, Go 250).
fn max_streams(
    http2: Option<&file::UpstreamHttp2>,
    protocol: Protocol,
    path: &str,
    p: &mut Problems,
) -> usize {
    let Some(http2) = http2 else {
        return DEFAULT_MAX_STREAMS;
    };
    if protocol == Protocol::Http1 {
        p.add(
            format!("{path}.http2"),
            "is for HTTP/2 upstreams: set `protocol: h2c`, `h2` or `auto`",
        );
    }
    match http2.max_concurrent_streams {
        Some(0) => {
            p.add(
                format!("{path}.http2.max_concurrent_streams"),
                "must be at least 1",
            );
            DEFAULT_MAX_STREAMS
        }
        n => n.unwrap_or(DEFAULT_MAX_STREAMS),
    }
}

const DEFAULT_MAX_STREAMS: usize = 100;

/// What makes two upstreams the same for a reload: scheme, targets, timeouts, keep-alive,
/// balancing, retry and health settings, whether it is capped and its queue's key, and the bytes of the CA file (a renewed CA must reach
/// new connections).
fn upstream_fingerprint(spec: &UpstreamSpec, ca: Option<&std::path::Path>) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(spec.scheme.as_str().as_bytes());
    h.update(spec.protocol.as_str().as_bytes());
    h.update(&spec.max_streams.to_le_bytes());
    for t in &spec.targets {
        h.update(b"\0");
        h.update(t.as_str().as_bytes());
    }
    h.update(&spec.connect_timeout.as_nanos().to_le_bytes());
    h.update(&spec.timeout.as_nanos().to_le_bytes());
    h.update(&spec.max_idle.map_or(u64::MAX, |n| n as u64).to_le_bytes());
    h.update(&spec.idle_timeout.as_nanos().to_le_bytes());
    // Debug is a complete, stable rendering of these plain values.
    h.update(format!("{:?}{}{:?}", spec.balance, spec.retries, spec.health).as_bytes());
    // Whether there is a gate at all, and what the queue is fair across: the caps and the
    // queue's bounds change in place on a reload.
    h.update(format!("{}{:?}", spec.capacity.is_some(), spec.queue_key).as_bytes());
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
