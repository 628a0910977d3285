//! The wire to Redis: one shared connection (a server or a cluster), the bucket script's
//! arguments, and the parsing of its reply.

use std::time::Duration;

use ::redis::cluster::{ClusterClientBuilder, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use ::redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, ConnectionAddr, IntoConnectionInfo, RedisError,
    Script, ScriptInvocation, TlsCertificates, TlsMode, Value,
};

use super::managed::{Managed, Target};
use super::watch::Watch;
use super::{Bucket, RedisConfig};
use crate::config::settings::{RedisTls, SentinelSpec};
use crate::limiter::ban::BanEvent;
use crate::limiter::{Counting, Period, Small, Verdict};
use std::fmt::Write as _;

/// The atomic N-bucket check; its header documents KEYS, ARGV and the reply.
pub(super) const BUCKET_LUA: &str = include_str!("../bucket.lua");

/// How long one TCP (and TLS) connection attempt may take. Independent of the per-check
/// timeout: a reconnect runs in the background, and checks waiting on it are cut by theirs.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long asking the Sentinels where the master is may take (each is tried in turn).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// What the script is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Charge every admitting bucket if every enforced one admits.
    Check,
    /// Give back what a `Check` took.
    Refund,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Check => "check",
            Mode::Refund => "refund",
        }
    }
}

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
    /// groups of identical checks: how many checks, and their buckets. The reply is the
    /// checks' replies, group by group.
    pub(super) async fn run_batch<'b, 'a: 'b, C>(
        &self,
        script: &Script,
        groups: impl Iterator<Item = (usize, C)> + Clone,
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

/// The script's epoch (`EPOCH` in `bucket.lua`), in microseconds since the UNIX epoch.
pub(super) const SCRIPT_EPOCH_US: i64 = 1_700_000_000_000_000;

/// A quota bucket's script arguments: its count, and the bounds of the windows around the
/// proxy's now (see `bucket.lua`'s `window`), in microseconds since the script's epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct QuotaArgs {
    pub(super) count: u32,
    pub(super) bounds: [i64; 4],
    /// A sliding or exact window's length in µs: Redis finds its windows by its own clock.
    pub(super) slides: Option<(Counting, i64)>,
}

impl QuotaArgs {
    pub(super) fn of(q: &crate::limiter::QuotaSpec, wall_us: f64) -> Self {
        let slides = match (q.counting, q.period) {
            (Counting::Sliding | Counting::Exact, Period::Every(secs)) => {
                Some((q.counting, i64::from(secs) * 1_000_000))
            }
            _ => None,
        };
        Self {
            count: q.count,
            bounds: crate::limiter::window::around(q, wall_us).map(|b| b - SCRIPT_EPOCH_US),
            slides,
        }
    }
}

/// Each bucket's key and its five script arguments (see `bucket.lua`).
fn push_buckets<'b, 'a: 'b>(
    call: &mut ScriptInvocation<'_>,
    buckets: impl Iterator<Item = &'b Bucket<'a>>,
) {
    for b in buckets {
        call.key(b.key.as_str());
        match &b.quota {
            Some(q) => {
                call.arg(q.count).arg(0);
            }
            None => {
                exact(call, b.rate.token_us());
                exact(call, b.rate.window_us());
            }
        }
        call.arg(b.cost).arg(u8::from(b.enforced));
        if b.quota.is_none() && b.ban.is_none() && b.lease == 0 {
            call.arg("-");
            continue;
        }
        let mut w = String::with_capacity(96);
        if b.lease > 0 {
            let _ = write!(w, "l {}", b.lease);
        }
        match b.quota.as_ref().map(|q| (q, q.slides)) {
            Some((_, Some((Counting::Exact, len)))) => {
                let _ = write!(w, "x {len}");
            }
            Some((_, Some((_, len)))) => {
                let _ = write!(w, "s {len}");
            }
            Some((q, None)) => {
                let [s0, s1, s2, s3] = q.bounds;
                let _ = write!(w, "q {s0} {s1} {s2} {s3}");
            }
            None => {}
        }
        if let Some(ban) = &b.ban {
            let sep = if w.is_empty() { "" } else { " " };
            let _ = write!(
                w,
                "{sep}b {} {} {} {}",
                ban.after, ban.within_us, ban.first_us, ban.max_us
            );
        }
        call.arg(w);
    }
}

/// `x` as a script argument that parses back to the same double, so Lua computes with exactly
/// the numbers `limiter::step` uses: a whole number (most rates give whole microseconds) in
/// plain digits, anything else by ryu (the shortest string that round-trips), which costs
/// several times more.
fn exact(call: &mut ScriptInvocation<'_>, x: f64) {
    // Below 2^53 every whole double is exact as an integer.
    const WHOLE: f64 = 9_007_199_254_740_992.0;
    if x.fract() == 0.0 && x.abs() < WHOLE {
        // Whole and within i64 (checked above): the conversion is exact.
        #[allow(clippy::cast_possible_truncation)]
        call.arg(x as i64);
    } else {
        call.arg(x);
    }
}

/// What the script answered for a "check".
#[derive(Debug)]
pub(super) struct Reply {
    pub(super) all_admitted: bool,
    pub(super) verdicts: Small<Verdict>,
    /// What each bucket's ban did (`BanEvent::None` for a bucket without one).
    pub(super) bans: Small<BanEvent>,
}

/// Parse the script's reply for buckets whose enforcement `enforced` yields, in order;
/// `None` if it is not what the script returns.
pub(super) fn parse_reply(
    value: &Value,
    enforced: impl ExactSizeIterator<Item = bool>,
) -> Option<Reply> {
    parse_items(reply_bytes(value)?, enforced)
}

/// The packed reply of a "check" or "batch" (see `bucket.lua`).
pub(super) fn reply_bytes(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        _ => None,
    }
}

/// Bytes of one bucket's reply: four big-endian doubles.
pub(super) const BUCKET_REPLY: usize = 32;

/// Parse one check's reply (`n` buckets of `BUCKET_REPLY` bytes) for the `n` buckets whose
/// enforcement `enforced` yields. A bucket admits when its retry time is 0; the check, when
/// every enforced one does.
pub(super) fn parse_items(
    bytes: &[u8],
    enforced: impl ExactSizeIterator<Item = bool>,
) -> Option<Reply> {
    if bytes.len() != BUCKET_REPLY * enforced.len() {
        return None;
    }
    let mut all_admitted = true;
    let mut bans = Small::new();
    let verdicts = bytes
        .chunks_exact(BUCKET_REPLY)
        .zip(enforced)
        .map(|(b, enforced)| {
            let value = |i: usize| {
                let mut be = [0u8; 8];
                be.copy_from_slice(&b[8 * i..8 * i + 8]);
                f64::from_be_bytes(be)
            };
            let (remaining, reset_us, retry_after_us) = (value(0), value(1), value(2));
            if !(remaining >= 0.0 && reset_us.is_finite() && retry_after_us >= 0.0) {
                return None;
            }
            bans.push(match value(3) {
                1.0 => BanEvent::Refused,
                2.0 => BanEvent::Lifted,
                // The retry of the check that began a ban is the ban's length.
                3.0 => BanEvent::Started(retry_after_us as u64),
                _ => BanEvent::None,
            });
            let admitted = retry_after_us == 0.0;
            all_admitted &= admitted || !enforced;
            Some(Verdict {
                admitted,
                // Whole and non-negative (checked above); `as` saturates beyond u64.
                remaining: remaining as u64,
                reset_us,
                retry_after_us,
            })
        })
        .collect::<Option<Small<_>>>()?;
    Some(Reply {
        all_admitted,
        verdicts,
        bans,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(values: &[f64]) -> Value {
        Value::BulkString(values.iter().flat_map(|v| v.to_be_bytes()).collect())
    }

    #[test]
    fn parses_the_scripts_reply() {
        let reply = packed(&[4.0, 333_334.0, 0.0, 0.0, 0.0, 1_000_000.0, 250_001.0, 0.0]);
        let r = parse_reply(&reply, [true, true].into_iter()).unwrap();
        assert!(!r.all_admitted);
        assert!(r.verdicts[0].admitted && r.verdicts[0].remaining == 4);
        assert!((r.verdicts[0].reset_us - 333_334.0).abs() < 1e-9);
        assert!(!r.verdicts[1].admitted);
        assert!((r.verdicts[1].retry_after_us - 250_001.0).abs() < 1e-9);
        // A shadow bucket's rejection does not reject the check.
        assert!(
            parse_reply(&reply, [true, false].into_iter())
                .unwrap()
                .all_admitted
        );
        assert!(parse_reply(&reply, [true; 3].into_iter()).is_none());
        assert!(parse_reply(&Value::Okay, [].into_iter()).is_none());
        assert!(parse_reply(&Value::Array(vec![Value::Int(4)]), [true].into_iter()).is_none());
        assert!(parse_reply(&packed(&[-1.0, 0.0, 0.0, 0.0]), [true].into_iter()).is_none());
        assert!(parse_reply(&packed(&[f64::NAN, 0.0, 0.0, 0.0]), [true].into_iter()).is_none());
        let banned = parse_reply(&packed(&[0.0, 9e6, 9e6, 3.0]), [true].into_iter()).unwrap();
        assert_eq!(banned.bans[0], BanEvent::Started(9_000_000));
    }
}
