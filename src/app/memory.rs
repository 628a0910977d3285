//! The memory budget (`max_rss`), as Envoy's overload manager: resident memory read every
//! 250 ms; past the budget new requests get 503 and new connections are refused until it is
//! back under, and the allocator is asked to hand freed pages back to the system.

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
