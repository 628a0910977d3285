//! Memory, tollgate's and Redis's: the budget (`max_rss`), as Envoy's overload manager
//! (resident memory read every 250 ms; past it new requests get 503 and new connections are
//! refused until it is back under, and the allocator hands freed pages back), and the keys
//! Redis evicted, read at each sweep.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::state::State;

/// How often resident memory is read (one `/proc/self/statm` read).
const EVERY: Duration = Duration::from_millis(250);

/// Read resident memory and set `state.memory_over` until `stop`.
pub(super) async fn watch(state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = every.tick() => {}
        }
        let Some(budget) = state.runtime.load().settings.max_rss else {
            state.memory_over.store(false, Ordering::Relaxed);
            state.metrics.memory_over.set(0);
            continue;
        };
        let Some(rss) = resident() else { continue };
        let over = rss > budget;
        if state.memory_over.swap(over, Ordering::Relaxed) == over {
            continue;
        }
        state.metrics.memory_over.set(i64::from(over));
        if over {
            tracing::warn!(rss, max_rss = budget, "resident memory is past max_rss: new requests get 503 and new connections are refused");
            // Pages freed but kept by the allocator count in the RSS: hand them back first.
            tollgate_alloc::collect();
            state
                .workers
                .on_every(|_| async { tollgate_alloc::collect() });
        } else {
            tracing::info!(
                rss,
                max_rss = budget,
                "resident memory is under max_rss again: serving as usual"
            );
        }
    }
}

/// Read Redis's `evicted_keys` (summed over the nodes that answer), show it, and warn when it
/// grew since `before`: an evicted bucket hands its client a fresh allowance, an evicted
/// operators' entry is written back by the replicas. An ACL without `INFO` shows nothing.
pub(super) async fn evictions(
    state: &State,
    redis: &crate::limiter::redis::RedisLimiter,
    before: Option<u64>,
) -> Option<u64> {
    let info = redis
        .command(::redis::cmd("INFO").arg("stats"))
        .await
        .ok()?;
    let now = evicted_keys(&info);
    state
        .metrics
        .redis_evicted_keys
        .set(i64::try_from(now).unwrap_or(i64::MAX));
    if let Some(before) = before.filter(|b| now > *b) {
        tracing::warn!(evicted = now - before, "Redis evicted keys since the last look (maxmemory-policy): their clients got a fresh allowance");
    }
    Some(now)
}

/// The sum of every `evicted_keys:N` line in an `INFO` reply (one server's text, or a map of
/// a cluster's nodes to theirs).
fn evicted_keys(info: &::redis::Value) -> u64 {
    use ::redis::Value;
    match info {
        Value::BulkString(b) => String::from_utf8_lossy(b)
            .lines()
            .filter_map(|l| l.strip_prefix("evicted_keys:")?.trim().parse::<u64>().ok())
            .sum(),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => {
            evicted_keys(&Value::BulkString(text.clone().into_bytes()))
        }
        Value::Map(pairs) => pairs.iter().map(|(_, v)| evicted_keys(v)).sum(),
        Value::Array(items) => items.iter().map(evicted_keys).sum(),
        _ => 0,
    }
}

/// This process's resident memory in bytes.
#[cfg(target_os = "linux")]
fn resident() -> Option<u64> {
    let statm = procfs::process::Process::myself().ok()?.statm().ok()?;
    Some(statm.resident * procfs::page_size())
}

#[cfg(not(target_os = "linux"))]
fn resident() -> Option<u64> {
    None
}
