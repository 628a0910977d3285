//! The configuration: load a YAML file, validate it completely, and compile it to a `Snapshot`.
//!
//! `file` mirrors the YAML, `compile` turns it into the types the request path uses, `locate`
//! maps field paths back to lines so every error points into the file.

pub mod compile;
pub mod file;
pub mod locate;
mod raw;
pub mod reload;
pub mod values;

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use ipnet::IpNet;

use crate::limiter::redis::{RedisConfig, RedisLimiter};
use crate::limiter::{FailurePolicy, Limit};
use crate::response::HeaderPolicy;
use crate::route::Route;

/// The compiled, validated configuration the request path reads. Immutable once built; a
/// reload builds a new one.
#[derive(Debug)]
pub struct Snapshot {
    pub routes: Vec<Route>,
    /// `routes` narrowed by path, for large tables.
    pub route_index: crate::route::Index,
    pub listeners: Vec<Listener>,
    pub admin: Option<SocketAddr>,
    pub trusted_proxies: Vec<IpNet>,
    pub client_ip_header: crate::identity::ForwardedHeader,
    pub headers: HeaderPolicy,
    pub limiter: LimiterSettings,
    /// How long in-flight requests may take to finish once SIGTERM or SIGINT arrives.
    pub shutdown_timeout: std::time::Duration,
    /// Requests in flight at once before new ones get 503.
    pub max_inflight: usize,
    /// Request headers with `_` in their names go upstream (`underscores_in_headers: true`);
    /// by default they are dropped.
    pub underscores_in_headers: bool,
    /// The shared store for `backend: redis`. Compiling never connects: the app attaches the
    /// client (`Snapshot::attach_redis`), so `tollgate check` stays offline.
    pub redis: Option<Arc<RedisLimiter>>,
    /// (name, hash of its YAML) for every route and upstream, to log what a reload changed.
    pub fingerprints: Vec<(String, u64)>,
    /// The YAML this snapshot was compiled from (served redacted on the admin `/config`).
    pub source: String,
    /// Digest of the config text and of every file it names, read *before* compiling: a file
    /// changed after that is seen as a change by the reload watcher, never missed.
    pub inputs_digest: [u8; 32],
}

impl Snapshot {
    /// Give a `backend: redis` snapshot its client: `previous`'s when the Redis settings did
    /// not change (keeping its connection, breaker and cache), else a new one. Needs a tokio
    /// runtime.
    pub fn attach_redis(&mut self, previous: Option<&Snapshot>) -> Result<(), String> {
        let Backend::Redis(cfg) = &self.limiter.backend else {
            return Ok(());
        };
        let reusable = previous.filter(|p| p.limiter.backend == self.limiter.backend);
        self.redis = match reusable.and_then(|p| p.redis.clone()) {
            Some(client) => Some(client),
            None => {
                let limiter = Arc::new(RedisLimiter::new(cfg)?);
                // The workers running now open their connections at once (a worker started
                // later does so as it starts).
                let warm = limiter.clone();
                crate::forward::on_every_worker(move || {
                    let limiter = warm.clone();
                    async move { limiter.warm_up_worker().await }
                });
                Some(limiter)
            }
        };
        Ok(())
    }

    /// Every limit of every route, in file order.
    pub fn limits(&self) -> impl Iterator<Item = &Arc<Limit>> {
        self.routes.iter().flat_map(|r| r.limits.iter())
    }

    /// Every upstream a route forwards to, once each (routes may share one), in file order.
    pub fn upstreams(&self) -> impl Iterator<Item = &Arc<crate::forward::Upstream>> {
        let mut seen = std::collections::HashSet::new();
        self.routes
            .iter()
            .filter_map(|r| match &r.action {
                crate::route::Action::Forward(u) => Some(u),
                crate::route::Action::Respond(_) => None,
            })
            .filter(move |u| seen.insert(Arc::as_ptr(u)))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Listener {
    pub address: SocketAddr,
    pub tls: Option<TlsSettings>,
    pub settings: crate::server::ListenerSettings,
}

/// A TLS listener's certificates, loaded.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    pub files: Vec<crate::tls::CertFiles>,
    pub config: Arc<rustls::ServerConfig>,
}

impl PartialEq for TlsSettings {
    /// Same files, same settings: what a reload compares (the contents are reloaded anyway).
    fn eq(&self, other: &Self) -> bool {
        self.files == other.files
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Backend {
    Local,
    Redis(RedisConfig),
}

#[derive(Debug, Clone, PartialEq)]
pub struct LimiterSettings {
    pub backend: Backend,
    pub on_failure: FailurePolicy,
    pub divide_by: u32,
    pub max_buckets: usize,
}

/// One thing wrong with a config, with where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Field path such as `routes[1].limits[0].rate`; empty for syntax errors.
    pub path: String,
    pub message: String,
    /// 1-based line and column, when known.
    pub at: Option<(usize, usize)>,
}

/// Everything wrong with one config file.
#[derive(Debug, Clone)]
pub struct ConfigError {
    pub file: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        write!(
            f,
            "{}: {n} problem{}",
            self.file,
            if n == 1 { "" } else { "s" }
        )?;
        for p in &self.problems {
            write!(f, "\n  {}", self.file)?;
            if let Some((line, col)) = p.at {
                write!(f, ":{line}:{col}")?;
            }
            if p.path.is_empty() {
                write!(f, ": {}", p.message)?;
            } else {
                write!(f, ": {}: {}", p.path, p.message)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// Read, parse and compile the file at `path`.
pub fn load(path: &Path, previous: Option<&Snapshot>) -> Result<Snapshot, ConfigError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: name.clone(),
        problems: vec![Problem {
            path: String::new(),
            message: format!("cannot read the file: {e}"),
            at: None,
        }],
    })?;
    let digest = inputs_digest(&text);
    let mut snapshot = parse(&text, previous).map_err(|problems| ConfigError {
        file: name,
        problems,
    })?;
    snapshot.inputs_digest = digest;
    Ok(snapshot)
}

/// A digest of config text and of the certificate, key and CA files it names, as they are on
/// disk now.
pub fn inputs_digest(text: &str) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&(text.len() as u64).to_le_bytes());
    h.update(text.as_bytes());
    for file in referenced_files(text) {
        match std::fs::read(&file) {
            Ok(bytes) => {
                h.update(&(bytes.len() as u64).to_le_bytes());
                h.update(&bytes);
            }
            Err(_) => {
                h.update(b"missing");
            }
        }
    }
    *h.finalize().as_bytes()
}

/// The files a config names: listener certificates and keys, upstream CA bundles.
pub fn referenced_files(text: &str) -> Vec<std::path::PathBuf> {
    let Ok(root) = serde_yaml::from_str::<serde_yaml::Value>(text) else {
        return Vec::new();
    };
    let mut files = Vec::new();
    let mut take = |v: Option<&serde_yaml::Value>| {
        if let Some(p) = v.and_then(serde_yaml::Value::as_str) {
            files.push(std::path::PathBuf::from(p));
        }
    };
    for listener in root
        .get("listeners")
        .and_then(|l| l.as_sequence())
        .into_iter()
        .flatten()
    {
        let Some(tls) = listener.get("tls") else {
            continue;
        };
        take(tls.get("cert"));
        take(tls.get("key"));
        for pair in tls
            .get("certificates")
            .and_then(|c| c.as_sequence())
            .into_iter()
            .flatten()
        {
            take(pair.get("cert"));
            take(pair.get("key"));
        }
    }
    for (_, upstream) in root
        .get("upstreams")
        .and_then(|u| u.as_mapping())
        .into_iter()
        .flatten()
    {
        take(upstream.get("tls").and_then(|t| t.get("ca")));
    }
    files
}

/// Parse and compile config text, reporting every problem found, in file order.
pub fn parse(text: &str, previous: Option<&Snapshot>) -> Result<Snapshot, Vec<Problem>> {
    let (raw, mut problems) = raw::read(text);
    let compiled = raw.map(|raw| compile::compile(&raw, previous));
    match compiled {
        Some(Ok(mut snapshot)) if problems.is_empty() => {
            text.clone_into(&mut snapshot.source);
            return Ok(snapshot);
        }
        Some(Err(more)) => problems.extend(more),
        Some(Ok(_)) | None => {}
    }
    let locations = locate::Locations::index(text);
    for p in &mut problems {
        if let Some((under, key)) = p.path.split_once('\u{0}') {
            let exact = locations.key_under(under, key);
            p.path = exact.unwrap_or_else(|| {
                if under.is_empty() {
                    key.to_owned()
                } else {
                    format!("{under}.{key}")
                }
            });
        }
        if p.at.is_none() {
            p.at = locations.find(&p.path);
        }
    }
    problems.sort_by_key(|p| p.at.unwrap_or((usize::MAX, 0)));
    Err(problems)
}
