//! One request against all limits of its route: exemptions, identities, the backend, and the
//! failure policy when the shared store cannot answer.

use std::sync::Arc;

use super::redis::RedisLimiter;
use super::{
    local, quota, Check, Decision, FailurePolicy, Limit, LimitResult, Outcome, Rate, Small, Verdict,
};
use crate::identity::{ClientId, RequestView};

/// An operator's override of one limit for one identity (see `control`). A token bucket keeps
/// its key and its state, counted at the other rate. A quota's state is its window's share
/// used (`quota`), so the same key at another count would keep the share, not the count: an
/// exhausted quota would stay exhausted however high the count. So a quota override counts in
/// a bucket of its own (`fresh`, mixed into the identity's digest), from zero, for as long as
/// it lasts; `rate` is then its count over the period's nominal length, as a quota's is.
#[derive(Debug, Clone, PartialEq)]
pub struct Tuning {
    pub rate: Rate,
    pub quota: Option<u32>,
    /// Mixed into the identity's digest: the quota override's own bucket.
    pub fresh: Option<u128>,
}

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
    decide_tuned(redis, worker, limits, view, now, &[]).await
}

/// `decide`, with `tuned[i]` replacing the numbers of `limits[i]` for this request (an empty
/// slice: none replaced). The fallback of a failed store keeps the limits' own numbers.
pub async fn decide_tuned(
    redis: Option<&RedisLimiter>,
    worker: Option<usize>,
    limits: &[Arc<Limit>],
    view: &RequestView<'_>,
    now: f64,
    tuned: &[Option<&Tuning>],
) -> Decision {
    let mut results = smallvec::SmallVec::with_capacity(limits.len());
    let mut checks: Small<Check<'_>> = Small::new();
    // Aligned with `checks`; left empty when nothing is tuned.
    let mut tunings: Small<Option<&Tuning>> = Small::new();
    for (index, limit) in limits.iter().enumerate() {
        // Concurrency limits are taken by `concurrency::acquire`, not here.
        if limit.concurrency.is_some() {
            continue;
        }
        let exempt = view.is_exempt(&limit.exempt);
        let fresh = tuned.get(index).copied().flatten().and_then(|t| t.fresh);
        let client = (!exempt).then(|| {
            let id = view.resolve(&limit.key);
            fresh.map_or(id, |salt| crate::identity::ClientId(id.0 ^ salt))
        });
        results.push(unchecked(index, limit, client));
        if let Some(client) = client {
            checks.push(Check { limit, client });
            if !tuned.is_empty() {
                tunings.push(tuned.get(index).copied().flatten());
            }
        }
    }
    if checks.is_empty() {
        return Decision { results };
    }
    let enforced: Small<bool> = checks.iter().map(|c| !c.limit.shadow).collect();
    // Who minted a new in-process bucket: the exhaustion policy caps buckets per peer.
    let peer = local::Peer::of(view.client_ip);
    match redis {
        None => {
            let numbers = Numbers::Own(&tunings);
            local_decision(
                &mut results,
                &checks,
                (&enforced, numbers),
                peer,
                (now, None),
            );
        }
        // Boxed so that the Redis call's state does not inflate every request's future, in a
        // statement of its own: a temporary of the `.await` statement would be kept unboxed.
        Some(r) => {
            let check = crate::boxed(|| r.check_tuned(worker, &checks, &enforced, &tunings));
            match check.await {
                Ok((verdicts, bans)) => {
                    record(&mut results, &checks, &verdicts, false);
                    let checked = results.iter_mut().filter(|r| r.outcome != Outcome::Exempt);
                    for ((r, c), event) in checked.zip(&checks).zip(bans) {
                        r.ban = event;
                        super::ban::log(c, event);
                    }
                }
                Err(_) => without_backend(&mut results, &checks, peer, now),
            }
        }
    }
    Decision { results }
}

/// `decide` in process for a request whose identities are known already (`clients[i]` is
/// limit `i`'s, `None` when it is exempt), at `now`, microseconds since the Unix epoch, which
/// is also the wall-clock time quotas count in: how `tollgate simulate` replays a logged
/// request. Concurrency limits are skipped, as `decide` skips them.
pub fn decide_known(
    limits: &[Arc<Limit>],
    clients: &[Option<ClientId>],
    peer: local::Peer,
    now: f64,
) -> Decision {
    let mut results = smallvec::SmallVec::with_capacity(limits.len());
    let mut checks: Small<Check<'_>> = Small::new();
    for (index, limit) in limits.iter().enumerate() {
        if limit.concurrency.is_some() {
            continue;
        }
        let client = clients.get(index).copied().flatten();
        results.push(unchecked(index, limit, client));
        if let Some(client) = client {
            checks.push(Check { limit, client });
        }
    }
    if !checks.is_empty() {
        let enforced: Small<bool> = checks.iter().map(|c| !c.limit.shadow).collect();
        let numbers = (&enforced[..], Numbers::Own(&[]));
        local_decision(&mut results, &checks, numbers, peer, (now, Some(now)));
    }
    Decision { results }
}

/// Limit `index`'s result before its bucket is asked: exempt without a `client`.
fn unchecked(index: usize, limit: &Limit, client: Option<ClientId>) -> LimitResult {
    LimitResult {
        index,
        outcome: if client.is_some() {
            Outcome::Admitted
        } else {
            Outcome::Exempt
        },
        verdict: None,
        fallback: false,
        shadow: limit.shadow,
        client,
        ban: super::ban::BanEvent::None,
    }
}

/// The in-process decision: a banned identity is refused before any bucket is asked (Redis's
/// bans come back with its verdicts instead), then the buckets all or nothing, then strikes.
/// `at` is the in-process clock and, when given, the wall-clock time quotas count in.
fn local_decision(
    results: &mut [LimitResult],
    checks: &[Check<'_>],
    (enforced, numbers): (&[bool], Numbers<'_>),
    peer: local::Peer,
    (now, wall): (f64, Option<f64>),
) {
    if local_bans(results, checks, now) {
        return;
    }
    let verdicts = in_process(checks, enforced, peer, (now, wall), numbers);
    record(results, checks, &verdicts, false);
    strikes(results, checks, now);
}

/// Refuse the request if an in-process ban holds one of its identities: that limit's result
/// says so, and nothing is checked. Returns whether it did; notes the bans seen lifted.
fn local_bans(results: &mut [LimitResult], checks: &[Check<'_>], now: f64) -> bool {
    let checked = results.iter_mut().filter(|r| r.outcome != Outcome::Exempt);
    for (r, c) in checked.zip(checks) {
        let Some(bans) = &c.limit.bans else {
            continue;
        };
        let (left, event) = bans.banned(c.client, now);
        r.ban = event;
        super::ban::log(c, event);
        if let Some(left) = left {
            r.outcome = Outcome::Limited;
            r.verdict = Some(Verdict {
                admitted: false,
                remaining: 0,
                reset_us: left,
                retry_after_us: left,
            });
            return true;
        }
    }
    false
}

/// Count a strike for each limit with a ban that rejected the request; the one that bans
/// answers with the ban's length as its retry time.
fn strikes(results: &mut [LimitResult], checks: &[Check<'_>], now: f64) {
    let checked = results.iter_mut().filter(|r| r.outcome != Outcome::Exempt);
    for (r, c) in checked.zip(checks) {
        let (Some(bans), Outcome::Limited) = (&c.limit.bans, r.outcome) else {
            continue;
        };
        let event = bans.strike(c.client, now);
        if let super::ban::BanEvent::Started(length) = event {
            r.ban = event;
            if let Some(v) = &mut r.verdict {
                v.retry_after_us = length as f64;
                v.reset_us = v.reset_us.max(length as f64);
            }
            super::ban::log(c, event);
        }
    }
}

/// Which numbers an in-process check counts with.
#[derive(Clone, Copy)]
enum Numbers<'a> {
    /// Each limit's own, or its override's (aligned with the checks; empty: none).
    Own(&'a [Option<&'a Tuning>]),
    /// The stricter fallback numbers of a failed store.
    Fallback,
}

/// The in-process check, at each limit's own rate (or its override's) or at its stricter
/// fallback rate.
fn in_process(
    checks: &[Check<'_>],
    enforced: &[bool],
    peer: local::Peer,
    (now, wall_at): (f64, Option<f64>),
    numbers: Numbers<'_>,
) -> Small<Verdict> {
    // Quotas count in calendar windows, on the wall clock (read once, and only for them).
    let wall = checks
        .iter()
        .any(|c| c.limit.quota.is_some())
        .then(|| wall_at.unwrap_or_else(local::wall_us));
    let items: Small<local::Item<'_>> = checks
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let tuning = match numbers {
                Numbers::Own(tuned) => tuned.get(i).copied().flatten(),
                Numbers::Fallback => None,
            };
            let fallback = matches!(numbers, Numbers::Fallback);
            local::Item {
                buckets: &c.limit.local,
                client: c.client,
                peer,
                rate: match tuning {
                    Some(t) => &t.rate,
                    None if fallback => &c.limit.fallback,
                    None => &c.limit.rate,
                },
                cost: c.limit.cost,
                window: c.limit.quota.as_ref().zip(wall).map(|(q, wall)| {
                    let count = match tuning.and_then(|t| t.quota) {
                        Some(n) => n,
                        None if fallback => q.fallback_count,
                        None => q.count,
                    };
                    quota::window(q, wall, count)
                }),
            }
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
    let mut local_verdicts =
        in_process(&local, &enforced, peer, (now, None), Numbers::Fallback).into_iter();
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
