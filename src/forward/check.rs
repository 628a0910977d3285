//! The active health check: a task per upstream that asks every target for `path` each
//! `interval`, and takes a target out of rotation after `unhealthy_threshold` failures in a
//! row, back after `healthy_threshold` passes.
//!
//! The task runs on the control runtime, never on a worker, and lives exactly as long as its
//! upstream: it holds the health only weakly, and the upstream aborts it when dropped (a
//! reload that keeps the upstream keeps its checker and what it learned).

use std::sync::{Arc, Weak};

use futures_util::future::join_all;
use http::header::{CONNECTION, HOST, USER_AGENT};
use http::uri::Authority;
use http::{HeaderValue, Request, Uri};
use tokio::task::AbortHandle;
use tokio::time::MissedTickBehavior;

use super::health::Health;
use crate::body::Guarded;
use crate::config::settings::CheckSpec;
use crate::pool::Connector;

/// The running check of one upstream; dropping it stops the task.
#[derive(Debug)]
pub struct Checker(AbortHandle);

impl Drop for Checker {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the task needs: where each target is, and how to reach it.
#[derive(Debug)]
pub struct Probe {
    pub upstream: Arc<str>,
    pub spec: CheckSpec,
    pub connector: Connector,
    /// The version the upstream speaks: checks go in it too.
    pub protocol: crate::config::settings::Protocol,
    /// Each target's authority (its `Host`) and `scheme://authority/` (for the connector).
    pub targets: Vec<(Authority, Uri)>,
}

/// Start checking on the current tokio runtime; `None` outside one (a harness that builds a
/// runtime without serving: there is nothing to keep healthy).
pub fn start(probe: Probe, health: &Arc<Health>) -> Option<Checker> {
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    let task = runtime.spawn(run(probe, Arc::downgrade(health)));
    Some(Checker(task.abort_handle()))
}

/// A target's streak, as the checker counts it.
#[derive(Debug, Clone, Copy, Default)]
struct Streak {
    down: bool,
    /// Passes in a row while down, failures in a row while up.
    count: u32,
}

impl Streak {
    /// Count one check; `true` when it changed the target's state.
    fn count(&mut self, passed: bool, spec: &CheckSpec) -> bool {
        if passed == self.down {
            self.count += 1;
            let needed = if self.down {
                spec.healthy_threshold
            } else {
                spec.unhealthy_threshold
            };
            if self.count >= needed {
                self.down = !self.down;
                self.count = 0;
                return true;
            }
        } else {
            self.count = 0;
        }
        false
    }
}

async fn run(probe: Probe, health: Weak<Health>) {
    let mut streaks = vec![Streak::default(); probe.targets.len()];
    let mut every = tokio::time::interval(probe.spec.interval);
    every.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let results = join_all(probe.targets.iter().map(|t| check(&probe, t))).await;
        let Some(health) = health.upgrade() else {
            return;
        };
        for (i, (result, streak)) in results.into_iter().zip(&mut streaks).enumerate() {
            if !streak.count(result.is_ok(), &probe.spec) {
                continue;
            }
            health.set_down(i, streak.down);
            let target = probe.targets[i].0.as_str();
            match result {
                Err(why) => tracing::warn!(
                    upstream = &*probe.upstream,
                    target,
                    why,
                    "upstream target failed its health check: out of rotation"
                ),
                Ok(()) => tracing::info!(
                    upstream = &*probe.upstream,
                    target,
                    "upstream target passes its health check again: back in rotation"
                ),
            }
        }
    }
}

/// One check of one target: `Ok` for a 2xx or 3xx within the timeout, else what went wrong.
async fn check(probe: &Probe, (authority, uri): &(Authority, Uri)) -> Result<(), String> {
    let mut req = Request::new(Guarded::empty());
    *req.uri_mut() = Uri::from(probe.spec.path.clone());
    let headers = req.headers_mut();
    headers.insert(
        HOST,
        HeaderValue::from_str(authority.as_str()).map_err(|e| e.to_string())?,
    );
    headers.insert(
        USER_AGENT,
        HeaderValue::from_static("tollgate-health-check"),
    );
    // One check, one connection: a pooled one would hide a target that accepts no new ones.
    if probe.protocol == crate::config::settings::Protocol::Http1 {
        headers.insert(CONNECTION, HeaderValue::from_static("close"));
    }
    let asked = probe.connector.request_once(uri, req, probe.protocol);
    match tokio::time::timeout(probe.spec.timeout, asked).await {
        Err(_) => Err(format!("no response within {:?}", probe.spec.timeout)),
        Ok(Err(e)) => Err(super::error_chain(e.as_error())),
        Ok(Ok(res)) if res.status().is_success() || res.status().is_redirection() => Ok(()),
        Ok(Ok(res)) => Err(format!("status {}", res.status().as_u16())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn thresholds_take_a_target_out_and_back() {
        let spec = CheckSpec {
            path: http::uri::PathAndQuery::from_static("/healthz"),
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            healthy_threshold: 3,
            unhealthy_threshold: 2,
        };
        let mut s = Streak::default();
        let verdicts: Vec<(bool, bool)> = [false, true, false, false, true, true, false, true]
            .into_iter()
            .map(|passed| (s.count(passed, &spec), s.down))
            .collect();
        assert_eq!(
            verdicts,
            [
                (false, false),
                (false, false),
                (false, false),
                (true, true), // two failures in a row
                (false, true),
                (false, true),
                (false, true), // a failure breaks the streak of passes
                (false, true),
            ]
        );
        assert!(!s.count(true, &spec));
        assert!(s.count(true, &spec), "three passes in a row");
        assert!(!s.down);
    }
}
