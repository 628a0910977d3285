//! One request against all limits of its route: exemptions, identities, the backend, and the
//! failure policy when the shared store cannot answer.

use std::sync::Arc;

use super::redis::RedisLimiter;
use super::{local, Check, Decision, FailurePolicy, Limit, LimitResult, Outcome, Small, Verdict};
use crate::identity::RequestView;

/// Decide a request against `limits` (a route's limits, in route order): in Redis when `redis`
/// is given (through worker `worker`'s connection), else in process. `now` is the in-process
/// clock, in microseconds.
pub async fn decide(
    redis: Option<&RedisLimiter>,
    worker: Option<usize>,
    limits: &[Arc<Limit>],
    view: &RequestView<'_>,
    now: f64,
) -> Decision {
    let mut results = smallvec::SmallVec::with_capacity(limits.len());
    let mut checks: Small<Check<'_>> = Small::new();
    for (index, limit) in limits.iter().enumerate() {
        // Concurrency limits are taken by `concurrency::acquire`, not here.
        if limit.concurrency.is_some() {
            continue;
        }
        let exempt = view.is_exempt(&limit.exempt);
        let client = (!exempt).then(|| view.resolve(&limit.key));
        results.push(LimitResult {
            index,
            outcome: if exempt {
                Outcome::Exempt
            } else {
                Outcome::Admitted
            },
            verdict: None,
            fallback: false,
            shadow: limit.shadow,
            client,
        });
        if let Some(client) = client {
            checks.push(Check { limit, client });
        }
    }
    if checks.is_empty() {
        return Decision { results };
    }
    let enforced: Small<bool> = checks.iter().map(|c| !c.limit.shadow).collect();
    // Who minted a new in-process bucket: the exhaustion policy caps buckets per peer.
    let peer = local::Peer::of(view.client_ip);
    match redis {
        None => record(
            &mut results,
            &checks,
            &in_process(&checks, &enforced, peer, now, false),
            false,
        ),
        // Boxed so that the Redis call's state does not inflate every request's future, in a
        // statement of its own: a temporary of the `.await` statement would be kept unboxed.
        Some(r) => {
            let check = crate::boxed(|| r.check_on(worker, &checks, &enforced));
            match check.await {
                Ok(verdicts) => record(&mut results, &checks, &verdicts, false),
                Err(_) => without_backend(&mut results, &checks, peer, now),
            }
        }
    }
    Decision { results }
}

/// The in-process check, at each limit's own rate or at its stricter fallback rate.
fn in_process(
    checks: &[Check<'_>],
    enforced: &[bool],
    peer: local::Peer,
    now: f64,
    fallback: bool,
) -> Small<Verdict> {
    let items: Small<local::Item<'_>> = checks
        .iter()
        .map(|c| local::Item {
            buckets: &c.limit.local,
            client: c.client,
            peer,
            rate: if fallback {
                &c.limit.fallback
            } else {
                &c.limit.rate
            },
            cost: c.limit.cost,
        })
        .collect();
    local::check(&items, enforced, now)
}

/// Fill in the results of the checked (non-exempt) limits from their verdicts.
fn record(results: &mut [LimitResult], checks: &[Check<'_>], verdicts: &[Verdict], fallback: bool) {
    let checked = results.iter_mut().filter(|r| r.outcome != Outcome::Exempt);
    for ((r, c), v) in checked.zip(checks).zip(verdicts) {
        r.verdict = Some(*v);
        r.fallback = fallback;
        r.outcome = outcome(v, c.limit);
    }
}

/// The shared store did not answer: each limit follows its `on_failure` policy. `local` limits
/// are checked together in process (still all-or-nothing among themselves).
fn without_backend(results: &mut [LimitResult], checks: &[Check<'_>], peer: local::Peer, now: f64) {
    let local: Small<Check<'_>> = checks
        .iter()
        .filter(|c| c.limit.on_failure == FailurePolicy::Local)
        .copied()
        .collect();
    let enforced: Small<bool> = local.iter().map(|c| !c.limit.shadow).collect();
    let mut local_verdicts = in_process(&local, &enforced, peer, now, true).into_iter();
    let checked = results.iter_mut().filter(|r| r.outcome != Outcome::Exempt);
    for (r, c) in checked.zip(checks) {
        r.fallback = true;
        r.outcome = match c.limit.on_failure {
            FailurePolicy::Open => Outcome::FailedOpen,
            FailurePolicy::Closed if c.limit.shadow => Outcome::FailedOpen,
            FailurePolicy::Closed => Outcome::FailedClosed,
            FailurePolicy::Local => {
                let v = local_verdicts.next().unwrap_or(Verdict {
                    admitted: true,
                    remaining: 0,
                    reset_us: 0.0,
                    retry_after_us: 0.0,
                });
                r.verdict = Some(v);
                outcome(&v, c.limit)
            }
        };
    }
}

/// A bucket's verdict as the limit's outcome: a shadow limit's rejection is only reported.
fn outcome(v: &Verdict, limit: &Limit) -> Outcome {
    match (v.admitted, limit.shadow) {
        (true, _) => Outcome::Admitted,
        (false, true) => Outcome::ShadowLimited,
        (false, false) => Outcome::Limited,
    }
}
