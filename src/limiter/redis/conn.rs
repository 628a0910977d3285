//! The connection to Redis: one shared connection to a server, a Sentinel's master or a
//! cluster, and the bucket script's calls on it (their wire format is in `wire`).

use std::time::Duration;

use ::redis::cluster::{ClusterClientBuilder, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use ::redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, ConnectionAddr, IntoConnectionInfo, RedisError,
    Script, ScriptInvocation, TlsCertificates, TlsMode, Value,
};

use super::managed::{Managed, Target};
use super::sentinel::Watch;
use super::wire::{push_buckets, Mode};
use super::{Bucket, RedisConfig};
use crate::config::settings::{RedisTls, SentinelSpec};

/// How long one TCP (and TLS) connection attempt may take. Independent of the per-check
/// timeout: a reconnect runs in the background, and checks waiting on it are cut by theirs.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long asking the Sentinels where the master is may take (each is tried in turn).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// One multiplexed connection, shared by the requests of one worker thread; cloning it is
/// cheap (an `Arc`).
#[derive(Clone)]
pub(super) enum RedisConn {
    /// One server, or the master Sentinel names.
    Single(Managed),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConn::Single(_) => "RedisConn::Single",
            RedisConn::Cluster(_) => "RedisConn::Cluster",
        })
    }
}

impl RedisConn {
    /// Set up the connection without waiting for it: Redis may well be down at startup, and
    /// the proxy must start anyway and apply its failure policy until Redis answers.
    pub(super) fn open(cfg: &RedisConfig) -> Result<Self, String> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err("the Redis limiter must be created inside the tokio runtime".into());
        }
        match (&cfg.url, cfg.cluster.as_slice(), &cfg.sentinel) {
            (Some(url), [], None) => Self::single(cfg, url),
            (None, nodes, None) if !nodes.is_empty() => Self::cluster(cfg, nodes),
            (None, [], Some(s)) => Self::sentinel(cfg, s),
            _ => Err("limiter.redis needs exactly one of `url`, `cluster` and `sentinel`".into()),
        }
    }

    fn single(cfg: &RedisConfig, url: &str) -> Result<Self, String> {
        // Never echo the URL: it may carry a password.
        let mut info = url
            .into_connection_info()
            .map_err(|e| format!("limiter.redis.url: {e}"))?;
        if let Some(password) = &cfg.password {
            let mut redis = info.redis_settings().clone().set_password(password);
            if let Some(user) = &cfg.username {
                redis = redis.set_username(user);
            }
            info = info.set_redis_settings(redis);
        }
        let client = match &cfg.tls {
            Some(tls) => Client::build_with_tls(info, certificates(tls)),
            None => Client::open(info),
        }
        .map_err(|e| format!("limiter.redis: {e}"))?;
        Ok(Self::managed(cfg, Target::Server(client), None))
    }

    fn sentinel(cfg: &RedisConfig, s: &SentinelSpec) -> Result<Self, String> {
        let nodes: Vec<ConnectionAddr> = s
            .nodes
            .iter()
            .map(|node| {
                // Validated as host:port when the config was compiled; `[::1]` loses its brackets.
                let (host, port) = node.rsplit_once(':').unwrap_or((node, "26379"));
                let host = host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_owned();
                let port = port.parse().unwrap_or(26379);
                if cfg.tls.is_some() {
                    ConnectionAddr::TcpTls {
                        host,
                        port,
                        insecure: false,
                        tls_params: None,
                    }
                } else {
                    ConnectionAddr::Tcp(host, port)
                }
            })
            .collect();
        let watch = Watch::of(
            s,
            &nodes,
            cfg.tls.as_ref().map(certificates).as_ref(),
            cfg.username.as_deref(),
            cfg.password.as_deref(),
        )?;
        let mut b = SentinelClientBuilder::new(nodes, &s.master, SentinelServerType::Master)
            .map_err(|e| format!("limiter.redis.sentinel: {e}"))?;
        if let Some(password) = &cfg.password {
            b = b.set_client_to_redis_password(password);
        }
        if let Some(user) = &cfg.username {
            b = b.set_client_to_redis_username(user);
        }
        if let Some(password) = &s.password {
            b = b.set_client_to_sentinel_password(password);
        }
        if let Some(user) = &s.username {
            b = b.set_client_to_sentinel_username(user);
        }
        if let Some(tls) = &cfg.tls {
            b = b
                .set_client_to_redis_tls_mode(TlsMode::Secure)
                .set_client_to_redis_certificates(certificates(tls))
                .set_client_to_sentinel_tls_mode(TlsMode::Secure)
                .set_client_to_sentinel_certificates(certificates(tls));
        }
        let client = b
            .build()
            .map_err(|e| format!("limiter.redis.sentinel: {e}"))?;
        Ok(Self::managed(
            cfg,
            Target::Sentinel(tokio::sync::Mutex::new(client)),
            Some(watch),
        ))
    }

    /// A connection that reconnects by itself, started in the background now, so the first
    /// request does not pay for it.
    fn managed(cfg: &RedisConfig, target: Target, watch: Option<Watch>) -> Self {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(None);
        RedisConn::Single(Managed::new(
            target,
            cfg.client_name.clone(),
            config,
            RESOLVE_TIMEOUT,
            watch,
        ))
    }

    fn cluster(cfg: &RedisConfig, nodes: &[String]) -> Result<Self, String> {
        let mut b = ClusterClientBuilder::new(nodes.iter().map(String::as_str));
        if let Some(password) = &cfg.password {
            b = b.password(password);
        }
        if let Some(user) = &cfg.username {
            b = b.username(user);
        }
        if let Some(tls) = &cfg.tls {
            b = b.certs(certificates(tls));
        }
        let client = b
            // Retries also carry MOVED/ASK redirections, so keep a few, but short.
            .retries(3)
            .min_retry_wait(5)
            .max_retry_wait(100)
            .build()
            .map_err(|e| format!("limiter.redis.cluster: {e}"))?;
        let config = ClusterConfig::new()
            .set_connection_timeout(CONNECT_TIMEOUT)
            .set_response_timeout(CONNECT_TIMEOUT);
        // Connects to the nodes in the background; commands wait for it (and our timeout).
        Ok(RedisConn::Cluster(
            client.get_pending_async_connection_with_config(config),
        ))
    }

    /// Times this connection was replaced after an error, by itself.
    pub(super) fn reconnects(&self) -> u64 {
        match self {
            RedisConn::Single(m) => m.reconnects(),
            RedisConn::Cluster(_) => 0,
        }
    }

    /// Times this connection followed a Sentinel failover to another master.
    pub(super) fn failovers(&self) -> u64 {
        match self {
            RedisConn::Single(m) => m.switches(),
            RedisConn::Cluster(_) => 0,
        }
    }

    /// PING, for readiness: on a cluster it goes to one node, which shows the cluster client
    /// is connected.
    pub(super) async fn ping(&self) -> Result<(), RedisError> {
        let ping = ::redis::cmd("PING");
        let _: Value = match self {
            RedisConn::Single(m) => ping.query_async(&mut m.clone()).await?,
            RedisConn::Cluster(c) => ping.query_async(&mut c.clone()).await?,
        };
        Ok(())
    }

    /// Any command (on a cluster, routed by its key): for the operators' entries (`control`).
    pub(super) async fn query(&self, cmd: &::redis::Cmd) -> Result<Value, RedisError> {
        match self {
            RedisConn::Single(m) => cmd.query_async(&mut m.clone()).await,
            RedisConn::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }

    /// SCRIPT LOAD `script` (on a cluster, on every master), so its first EVALSHA finds it.
    pub(super) async fn load_script(&self, script: &Script) -> Result<(), RedisError> {
        let call = script.prepare_invoke();
        match self {
            RedisConn::Single(m) => call.load_async(&mut m.clone()).await?,
            RedisConn::Cluster(c) => call.load_async(&mut c.clone()).await?,
        };
        Ok(())
    }

    /// Run the bucket script on `buckets` (which, on a cluster, must share a slot). The
    /// invocation is EVALSHA, falling back to SCRIPT LOAD + EVALSHA on NOSCRIPT (after a
    /// restart, a failover or a SCRIPT FLUSH); on a cluster SCRIPT LOAD goes to every master.
    pub(super) async fn run<'b, 'a: 'b>(
        &self,
        script: &Script,
        mode: Mode,
        buckets: impl Iterator<Item = &'b Bucket<'a>>,
    ) -> Result<Value, RedisError> {
        let mut call = script.prepare_invoke();
        call.arg(mode.as_str());
        push_buckets(&mut call, buckets);
        self.invoke(&call).await
    }

    /// Run several independent checks as one script call ("batch" mode). `groups` yields
    /// groups of identical checks: how many checks (0 for a settlement's charge, -1 for its
    /// refund), and their buckets. The reply is the checks' replies, group by group.
    pub(super) async fn run_batch<'b, 'a: 'b, C>(
        &self,
        script: &Script,
        groups: impl Iterator<Item = (i64, C)> + Clone,
    ) -> Result<Value, RedisError>
    where
        C: ExactSizeIterator<Item = &'b Bucket<'a>>,
    {
        let mut call = script.prepare_invoke();
        call.arg("batch").arg(groups.clone().count());
        for (checks, buckets) in groups {
            call.arg(checks).arg(buckets.len());
            push_buckets(&mut call, buckets);
        }
        self.invoke(&call).await
    }

    pub(super) async fn invoke(&self, call: &ScriptInvocation<'_>) -> Result<Value, RedisError> {
        match self {
            RedisConn::Single(m) => call.invoke_async(&mut m.clone()).await,
            RedisConn::Cluster(c) => call.invoke_async(&mut c.clone()).await,
        }
    }
}

/// The TLS files as the redis crate takes them.
fn certificates(tls: &RedisTls) -> TlsCertificates {
    TlsCertificates {
        client_tls: tls.client.as_ref().map(|(cert, key)| ClientTlsConfig {
            client_cert: cert.clone(),
            client_key: key.clone(),
        }),
        root_cert: tls.ca.clone(),
    }
}
