//! The `limiter` section: the backend (in process or Redis), failure policy and fallback.

use std::time::Duration;

use super::{duration_or, Problems};
use crate::config::file;
use crate::config::settings::{Backend, FailurePolicy, LimiterSettings, RedisConfig};

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

pub(super) fn limiter(raw: &file::Limiter, p: &mut Problems) -> LimiterSettings {
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
