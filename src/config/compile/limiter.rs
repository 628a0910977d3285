//! The `limiter` section: the backend (in process or Redis), failure policy and fallback.

use std::time::Duration;

use super::{duration_or, Problems};
use crate::config::file;
use crate::config::settings::{
    Backend, FailurePolicy, LimiterSettings, RedisConfig, RedisTls, SentinelSpec,
};

pub(super) fn policy(s: &str) -> Result<FailurePolicy, String> {
    match s {
        "open" => Ok(FailurePolicy::Open),
        "closed" => Ok(FailurePolicy::Closed),
        "local" => Ok(FailurePolicy::Local),
        _ => Err(format!(
            "`{s}` is not a failure policy (open, closed or local)"
        )),
    }
}

/// `backend`, with its `redis:` block: Redis where asked and its block is valid, else local.
fn backend(raw: &file::Limiter, p: &mut Problems) -> Backend {
    let redis = raw.redis.as_ref().and_then(|r| redis(r, p));
    match raw.backend.as_deref() {
        None | Some("local") => {
            if raw.redis.is_some() {
                p.add("limiter.redis", "is set but `limiter.backend` is `local`: set `backend: redis` to use it, or remove the block");
            }
            Backend::Local
        }
        Some("redis") => match redis {
            Some(cfg) => Backend::Redis(Box::new(cfg)),
            None => {
                if raw.redis.is_none() {
                    p.add(
                        "limiter.redis",
                        "`backend: redis` needs a `redis:` block with `url`, `cluster` or `sentinel`",
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
    }
}

pub(super) fn limiter(raw: &file::Limiter, p: &mut Problems) -> LimiterSettings {
    let on_failure = raw
        .on_failure
        .as_deref()
        .and_then(|s| p.take("limiter.on_failure", policy(s)))
        .unwrap_or(FailurePolicy::Open);
    let backend = backend(raw, p);
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
    let max_buckets_per_peer = raw
        .local
        .as_ref()
        .and_then(|l| l.max_buckets_per_peer)
        .unwrap_or(1000);
    if max_buckets_per_peer == 0 {
        p.add(
            "limiter.local.max_buckets_per_peer",
            "must be at least 1 (set it to max_buckets for no per-address cap)",
        );
    }
    LimiterSettings {
        backend,
        on_failure,
        divide_by: divide_by.max(1),
        max_buckets: max_buckets.max(1),
        max_buckets_per_peer: max_buckets_per_peer.max(1),
    }
}

/// Where the Redis servers are: one `url`, a `cluster`'s nodes, or none (a Sentinel's); `None`
/// (with the problem) for no choice or several.
fn servers(r: &file::Redis, p: &mut Problems) -> Option<(Option<String>, Vec<String>)> {
    Some(match (&r.url, &r.cluster, &r.sentinel) {
        (Some(url), None, None) => (Some(url.clone()), Vec::new()),
        (None, Some(nodes), None) if !nodes.is_empty() => (None, nodes.clone()),
        (None, None, Some(_)) => (None, Vec::new()),
        (None, Some(_), None) => {
            p.add("limiter.redis.cluster", "needs at least one node URL");
            return None;
        }
        (None, None, None) => {
            p.add(
                "limiter.redis",
                "needs `url` (one server), `cluster` (a list of node URLs) or `sentinel`",
            );
            return None;
        }
        _ => {
            p.add(
                "limiter.redis",
                "use one of `url` (one server), `cluster` and `sentinel`, not several",
            );
            return None;
        }
    })
}

/// Every server URL parsed, and the password, username and TLS settings checked against them;
/// `false` when any is wrong.
fn urls_and_credentials(
    r: &file::Redis,
    url: Option<&str>,
    cluster: &[String],
    p: &mut Problems,
) -> bool {
    let mut ok = true;
    // Every server URL: parsed, and whether it asks for TLS and carries a password.
    let mut urls = Vec::new();
    if let Some(u) = url {
        urls.push(redis_url("limiter.redis.url".into(), u, p));
    }
    for (i, node) in cluster.iter().enumerate() {
        urls.push(redis_url(format!("limiter.redis.cluster[{i}]"), node, p));
    }
    ok &= urls.iter().all(Option::is_some);
    let urls: Vec<_> = urls.into_iter().flatten().collect();
    if r.password.is_some() && urls.iter().any(|u| u.redis_settings().password().is_some()) {
        p.add(
            "limiter.redis.password",
            "is also in the URL: set the password in one place",
        );
        ok = false;
    }
    if r.username.is_some() && r.password.is_none() {
        p.add("limiter.redis.username", "needs `password` as well");
        ok = false;
    }
    if r.tls.is_some()
        && urls
            .iter()
            .any(|u| !matches!(u.addr(), redis::ConnectionAddr::TcpTls { .. }))
    {
        p.add(
            "limiter.redis.tls",
            "is set but the URL is `redis://`: use `rediss://` for TLS",
        );
        ok = false;
    }
    ok
}

fn redis(r: &file::Redis, p: &mut Problems) -> Option<RedisConfig> {
    let (url, cluster) = servers(r, p)?;
    let mut ok = urls_and_credentials(r, url.as_deref(), &cluster, p);
    let sentinel = r.sentinel.as_ref().and_then(|s| sentinel(s, p));
    ok &= r.sentinel.is_none() || sentinel.is_some();
    let tls = r.tls.as_ref().and_then(|t| tls(t, p));
    ok &= r.tls.is_none() || tls.is_some();
    let client_name = r.client_name.clone().unwrap_or_else(|| "tollgate".into());
    if client_name.is_empty()
        || client_name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
    {
        p.add(
            "limiter.redis.client_name",
            "must be a non-empty name without spaces (Redis refuses others)",
        );
        ok = false;
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
        sentinel,
        username: r.username.clone(),
        password: r.password.clone(),
        tls,
        client_name,
        timeout,
        key_prefix: r.key_prefix.clone().unwrap_or_else(|| "tollgate:".into()),
    })
}

/// A Redis URL parsed, or a problem at `path`.
fn redis_url(path: String, url: &str, p: &mut Problems) -> Option<redis::ConnectionInfo> {
    if url.starts_with("redis+sentinel://") || url.starts_with("rediss+sentinel://") {
        p.add(
            path,
            "Sentinel is configured as `sentinel: { master: NAME, nodes: [host:port, ...] }`, not as a URL",
        );
        return None;
    }
    let r = redis::IntoConnectionInfo::into_connection_info(url)
        .map_err(|e| format!("`{url}` is not a Redis URL (redis://[user:password@]host:port[/db] or rediss://...): {e}"));
    p.take(path, r)
}

fn sentinel(s: &file::RedisSentinel, p: &mut Problems) -> Option<SentinelSpec> {
    let mut ok = true;
    if s.master.is_empty() {
        p.add("limiter.redis.sentinel.master", "must name the master");
        ok = false;
    }
    if s.nodes.is_empty() {
        p.add(
            "limiter.redis.sentinel.nodes",
            "needs at least one Sentinel (host:port)",
        );
        ok = false;
    }
    for (i, node) in s.nodes.iter().enumerate() {
        let fine = node.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
        if !fine {
            p.add(
                format!("limiter.redis.sentinel.nodes[{i}]"),
                format!("`{node}` is not host:port"),
            );
            ok = false;
        }
    }
    if s.username.is_some() && s.password.is_none() {
        p.add(
            "limiter.redis.sentinel.username",
            "needs `password` as well",
        );
        ok = false;
    }
    ok.then(|| SentinelSpec {
        master: s.master.clone(),
        nodes: s.nodes.clone(),
        username: s.username.clone(),
        password: s.password.clone(),
    })
}

/// Read and parse the TLS files now, so `tollgate check` reports them.
fn tls(t: &file::RedisTls, p: &mut Problems) -> Option<RedisTls> {
    use rustls::pki_types::pem::{self, PemObject};
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let read = |key: &str, path: &str, p: &mut Problems| {
        let at = format!("limiter.redis.tls.{key}");
        let bytes = p.take(
            at.clone(),
            std::fs::read(path).map_err(|e| format!("cannot read `{path}`: {e}")),
        )?;
        let parsed = if key == "key" {
            PrivateKeyDer::from_pem_slice(&bytes)
                .map(|_| ())
                .map_err(|e| match e {
                    pem::Error::NoItemsFound => format!("`{path}` holds no PEM private key"),
                    e => format!("`{path}` is not a PEM private key file: {e}"),
                })
        } else {
            match CertificateDer::pem_slice_iter(&bytes).collect::<Result<Vec<_>, _>>() {
                Ok(certs) if !certs.is_empty() => Ok(()),
                Ok(_) => Err(format!("`{path}` holds no PEM certificate")),
                Err(e) => Err(format!("`{path}` is not a PEM certificate file: {e}")),
            }
        };
        p.take(at, parsed).map(|()| bytes)
    };
    let ca = t.ca.as_deref().map(|f| read("ca", f, p));
    let client = match (t.cert.as_deref(), t.key.as_deref()) {
        (Some(cert), Some(key)) => {
            let cert = read("cert", cert, p);
            let key = read("key", key, p);
            Some(cert.zip(key))
        }
        (None, None) => None,
        (Some(_), None) => {
            p.add("limiter.redis.tls.cert", "needs `key` as well");
            Some(None)
        }
        (None, Some(_)) => {
            p.add("limiter.redis.tls.key", "needs `cert` as well");
            Some(None)
        }
    };
    let ca = match ca {
        Some(None) => return None,
        Some(Some(ca)) => Some(ca),
        None => None,
    };
    let client = match client {
        Some(None) => return None,
        Some(Some(pair)) => Some(pair),
        None => None,
    };
    if let Some((cert, key)) = &client {
        p.take("limiter.redis.tls.cert", usable_client_cert(cert, key))?;
    }
    Some(RedisTls { ca, client })
}

/// Whether rustls takes `cert` (PEM chain) with `key` as a client certificate: it refuses a
/// key that does not match and a v1 certificate, which would otherwise fail every connect.
fn usable_client_cert(cert: &[u8], key: &[u8]) -> Result<(), String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| e.to_string())?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_client_auth_cert(chain, key)
        .map(drop)
        .map_err(|e| format!("is not usable with `key` as a client certificate: {e}"))
}
