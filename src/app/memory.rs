//! Memory, tollgate's and Redis's: the budget (`max_rss`), as Envoy's overload manager
//! (resident memory read every 250 ms; past it new requests get 503 and new connections are
//! refused until it is back under, and the allocator hands freed pages back), and what Redis
//! forgot (the keys it evicted, the servers that restarted), read at each sweep.

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
    let mut ticks_over = 0u32;
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
            // Still over: what the load freed since (connections closed, bodies sent) is
            // handed back once a second, so an idle proxy gets under again on its own.
            if over {
                ticks_over += 1;
                if ticks_over.is_multiple_of(4) {
                    collect_everywhere(&state);
                }
            }
            continue;
        }
        ticks_over = 0;
        state.metrics.memory_over.set(i64::from(over));
        if over {
            tracing::warn!(rss, max_rss = budget, "resident memory is past max_rss: new requests get 503 and new connections are refused");
            // Pages freed but kept by the allocator count in the RSS: hand them back first.
            collect_everywhere(&state);
        } else {
            tracing::info!(
                rss,
                max_rss = budget,
                "resident memory is under max_rss again: serving as usual"
            );
        }
    }
}

/// Have the allocator hand freed pages back, on this thread and every worker's (its caches
/// are per thread).
fn collect_everywhere(state: &State) {
    tollgate_alloc::collect();
    state
        .workers
        .on_every(|_| async { tollgate_alloc::collect() });
}

/// What the last look at Redis saw: `evicted_keys` summed over its servers, and their
/// `run_id`s.
#[derive(Default)]
pub(super) struct RedisSeen {
    evicted: Option<u64>,
    run_ids: Vec<String>,
}

/// Read Redis's `INFO` (every server's, on a cluster) and compare it with `before`. Evicted
/// keys are shown, and a warning logged when they grew: an evicted bucket hands its client a
/// fresh allowance, an evicted operators' entry is written back by the replicas. A `run_id`
/// that is gone (a server restarted, or left) empties the negative cache, as a reconnect does:
/// rejections learnt from counts Redis may have lost must not outlive them. An ACL without
/// `INFO` shows nothing.
pub(super) async fn look_at_redis(
    state: &State,
    redis: &crate::limiter::redis::RedisLimiter,
    before: RedisSeen,
) -> RedisSeen {
    let Ok(info) = redis.command(&::redis::cmd("INFO")).await else {
        return before;
    };
    let mut lines = Vec::new();
    info_lines(&info, &mut lines);
    let evicted: u64 = lines
        .iter()
        .filter_map(|l| l.strip_prefix("evicted_keys:")?.trim().parse::<u64>().ok())
        .sum();
    let mut run_ids: Vec<String> = lines
        .iter()
        .filter_map(|l| Some(l.strip_prefix("run_id:")?.trim().to_owned()))
        .collect();
    run_ids.sort_unstable();
    state
        .metrics
        .redis_evicted_keys
        .set(i64::try_from(evicted).unwrap_or(i64::MAX));
    if let Some(was) = before.evicted.filter(|b| evicted > *b) {
        tracing::warn!(evicted = evicted - was, "Redis evicted keys since the last look (maxmemory-policy): their clients got a fresh allowance");
    }
    let gone = before
        .run_ids
        .iter()
        .filter(|id| run_ids.binary_search(id).is_err())
        .count();
    if gone > 0 {
        tracing::warn!(
            servers = gone,
            "a Redis server restarted or left (its run_id changed): quota rejections cached from it are forgotten"
        );
        redis.saw_restart();
    }
    RedisSeen {
        evicted: Some(evicted),
        run_ids,
    }
}

/// Every line of an `INFO` reply (one server's text, or a map of a cluster's nodes to theirs).
fn info_lines(info: &::redis::Value, out: &mut Vec<String>) {
    use ::redis::Value;
    match info {
        Value::BulkString(b) => out.extend(String::from_utf8_lossy(b).lines().map(str::to_owned)),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => {
            out.extend(text.lines().map(str::to_owned));
        }
        Value::Map(pairs) => pairs.iter().for_each(|(_, v)| info_lines(v, out)),
        Value::Array(items) => items.iter().for_each(|v| info_lines(v, out)),
        _ => {}
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
