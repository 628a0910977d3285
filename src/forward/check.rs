//! The active health check: a task per upstream that asks every target for `path` each
//! `interval`, and takes a target out of rotation after `unhealthy_threshold` failures in a
//! row, back after `healthy_threshold` passes.
//!
//! A gRPC upstream is asked with gRPC's standard `grpc.health.v1.Health/Check`, encoded here:
//! one string field in, one enum field out, not worth a protobuf code generator's build time.
//!
//! The task runs on the control runtime, never on a worker, and lives exactly as long as its
//! upstream: it holds the health only weakly, and the upstream aborts it when dropped (a
//! reload that keeps the upstream keeps its checker and what it learned).

use std::sync::{Arc, Weak};

use futures_util::future::join_all;
use http::header::{CONNECTION, CONTENT_TYPE, HOST, TE, USER_AGENT};
use http::uri::Authority;
use http::{HeaderValue, Method, Request, Uri};
use http_body_util::BodyExt;
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

/// One check of one target: `Ok` for a 2xx or 3xx within the timeout (gRPC: `SERVING`), else
/// what went wrong.
async fn check(probe: &Probe, (authority, uri): &(Authority, Uri)) -> Result<(), String> {
    let mut req = Request::new(Guarded::empty());
    *req.uri_mut() = Uri::from(probe.spec.path.clone());
    if let Some(service) = &probe.spec.grpc {
        *req.method_mut() = Method::POST;
        *req.body_mut() = Guarded::fixed(grpc_health::request(service));
        let headers = req.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(TE, HeaderValue::from_static("trailers"));
    }
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
    let grpc = probe.spec.grpc.is_some();
    let asked = async {
        let res = probe
            .connector
            .request_once(uri, req, probe.protocol)
            .await
            .map_err(|e| super::error_chain(e.as_error()))?;
        let status = res.status();
        if grpc && status.is_success() {
            // A trailers-only answer (an error) has its status in the head.
            let head = crate::access_log::grpc_status(res.headers());
            let answer = res.collect().await.map_err(|e| e.to_string())?;
            return grpc_health::serving(head, answer);
        }
        if status.is_success() || status.is_redirection() {
            Ok(())
        } else {
            Err(format!("status {}", status.as_u16()))
        }
    };
    tokio::time::timeout(probe.spec.timeout, asked)
        .await
        .unwrap_or_else(|_| Err(format!("no response within {:?}", probe.spec.timeout)))
}

/// gRPC's health check, `grpc.health.v1.Health/Check`, in its wire form.
mod grpc_health {
    use bytes::{Buf, Bytes};
    use http_body_util::Collected;

    /// A length-prefixed `HealthCheckRequest { service = 1 }`.
    pub(super) fn request(service: &str) -> Bytes {
        let mut message = Vec::new();
        if !service.is_empty() {
            message.push(0x0a); // field 1, length-delimited
            put_varint(&mut message, service.len() as u64);
            message.extend_from_slice(service.as_bytes());
        }
        let mut framed = vec![0]; // not compressed
        framed.extend_from_slice(&u32::try_from(message.len()).unwrap_or(0).to_be_bytes());
        framed.extend_from_slice(&message);
        framed.into()
    }

    /// `Ok` for `grpc-status: 0` and a `HealthCheckResponse` whose status (field 1) is
    /// `SERVING` (1).
    pub(super) fn serving(head: Option<u16>, answer: Collected<Bytes>) -> Result<(), String> {
        let grpc_status =
            head.or_else(|| answer.trailers().and_then(crate::access_log::grpc_status));
        match grpc_status {
            Some(0) => {}
            Some(code) => return Err(format!("grpc-status {code}")),
            None => return Err("no grpc-status".into()),
        }
        let mut body = answer.to_bytes();
        if body.len() < 5 {
            return Err("no HealthCheckResponse".into());
        }
        body.advance(5);
        let status = field_1(&body).unwrap_or(0);
        if status == 1 {
            Ok(())
        } else {
            let name = ["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"];
            let name = name.get(status as usize).copied().unwrap_or("UNKNOWN");
            Err(format!("gRPC health status {name}"))
        }
    }

    /// The value of varint field 1 of a protobuf message, skipping any other field.
    fn field_1(mut m: &[u8]) -> Option<u64> {
        while !m.is_empty() {
            let key = varint(&mut m)?;
            match key & 7 {
                0 if key >> 3 == 1 => return varint(&mut m),
                0 => {
                    varint(&mut m)?;
                }
                2 => {
                    let n = usize::try_from(varint(&mut m)?).ok()?;
                    m = m.get(n..)?;
                }
                1 => m = m.get(8..)?,
                5 => m = m.get(4..)?,
                _ => return None,
            }
        }
        None
    }

    fn varint(m: &mut &[u8]) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = m.split_first()?;
            *m = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }

    fn put_varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn requests_and_answers_in_wire_form() {
            assert_eq!(&request("")[..], [0, 0, 0, 0, 0]);
            assert_eq!(
                &request("a.B")[..],
                [0, 0, 0, 0, 5, 0x0a, 3, b'a', b'.', b'B']
            );
            assert_eq!(field_1(&[0x08, 0x01]), Some(1));
            assert_eq!(field_1(&[0x12, 0x01, 0xff, 0x08, 0x02]), Some(2));
            assert_eq!(field_1(&[]), None);
        }
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
            grpc: None,
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
