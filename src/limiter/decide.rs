//! One request against all limits of its route: exemptions, identities, the backend, and the
//! failure policy when the shared store cannot answer.

use std::sync::Arc;

use super::store::{Answer, Asked, Local, Store};
use super::{
    local, Check, Decision, FailurePolicy, Limit, LimitResult, Moment, Outcome, Rate, Small,
    Verdict,
};
use crate::identity::{ClientId, RequestView};

/// An operator's override of one limit for one identity (see `control`). A token bucket keeps
/// its key and its state, counted at the other rate. A quota's state is its window's share
/// used (`window`), so the same key at another count would keep the share, not the count: an
/// exhausted quota would stay exhausted however high the count. So a quota override counts in
/// a bucket of its own (`fresh`, mixed into the identity's digest), from zero, for as long as
/// it lasts; `rate` is then its count over the period's nominal length, as a quota's is.
#[derive(Debug, Clone, PartialEq)]
pub struct Tuning {
    pub rate: Rate,
    pub quota: Option<u32>,
    /// Mixed into the identity's digest: the quota override's own bucket.
    pub fresh: Option<u128>,
    /// What this request costs instead of the limit's `cost` (an RLS call's `hits_addend`);
    /// kept when a failed store's fallback drops the other numbers.
    pub cost: Option<u32>,
}

impl Tuning {
    /// What check `c` costs, with `tuning` for it.
    pub(crate) fn cost_of(c: &Check<'_>, tuning: Option<&Tuning>) -> u32 {
        tuning.and_then(|t| t.cost).unwrap_or(c.limit.cost)
    }
}

/// Decide a request against `limits` (a route's limits, in route order) in `store` (the
/// shared one; `None`: in process), at `now` on the limiter's clock, with `tuned[i]` replacing
/// the numbers of `limits[i]` for this request (an empty slice: none replaced). What the store
/// cannot answer follows each limit's failure policy, whose fallback keeps the limits' own
/// numbers.
pub async fn decide<S: Store>(
    store: Option<&S>,
    limits: &[Arc<Limit>],
    view: &RequestView<'_>,
    now: Moment,
    tuned: &[Option<&Tuning>],
) -> Decision {
    let Some(store) = store else {
        return decide_in_process(limits, view, now, tuned);
    };
    let p = Prepared::of(limits, view, tuned);
    run(store, p, local::Peer::of(view.client_ip), now).await
}

/// `decide` for checks whose identities are known already (`clients[i]` is limit `i`'s,
/// `None` when it is exempt), from `peer`: a rate limit service call's descriptors.
pub async fn decide_checks<S: Store>(
    store: Option<&S>,
    limits: &[Arc<Limit>],
    clients: &[Option<ClientId>],
    tuned: &[Option<&Tuning>],
    peer: local::Peer,
    now: Moment,
) -> Decision {
    let mut p = Prepared::known(limits, clients, tuned);
    match store {
        Some(store) => run(store, p, peer, now).await,
        None => {
            if !p.checks.is_empty() {
                let (results, asked) = p.split(peer, now);
                let answer = Local { fallback: false }.decide(asked);
                record(results, asked.checks, answer);
            }
            Decision { results: p.results }
        }
    }
}

/// Ask `store` for `p`'s checks: through the leases held here when a limit leases.
async fn run<S: Store>(store: &S, mut p: Prepared<'_>, peer: local::Peer, now: Moment) -> Decision {
    if p.checks.iter().any(|c| c.limit.count_when.is_some()) {
        counted::admit(&mut p, store, peer, (now, None)).await;
    } else if p.checks.iter().any(|c| c.limit.leases.is_some()) {
        leased::settle(&mut p, store, peer, now).await;
    } else if !p.checks.is_empty() {
        let (results, asked) = p.split(peer, now);
        settle(results, store, asked).await;
    }
    Decision { results: p.results }
}

/// `decide` without Redis: the in-process store answers at once, so no future is built
/// (and moved between the stages' futures) for it.
pub fn decide_in_process(
    limits: &[Arc<Limit>],
    view: &RequestView<'_>,
    now: Moment,
    tuned: &[Option<&Tuning>],
) -> Decision {
    if let ([limit], []) = (limits, tuned) {
        if let Some(result) = lone(limit, view, now) {
            return Decision {
                results: smallvec::smallvec![result],
            };
        }
    }
    let mut p = Prepared::of(limits, view, tuned);
    let peer = local::Peer::of(view.client_ip);
    if p.checks.iter().any(|c| c.limit.count_when.is_some()) {
        use futures_util::FutureExt as _;
        let store = Local { fallback: false };
        // The in-process store answers at once: this future is ready when first polled.
        let _ = counted::admit(&mut p, &store, peer, (now, None)).now_or_never();
    } else if !p.checks.is_empty() {
        let (results, asked) = p.split(peer, now);
        let answer = Local { fallback: false }.decide(asked);
        record(results, asked.checks, answer);
    }
    Decision { results: p.results }
}

/// A route's one limit, most routes' case, when it is a plain token bucket (no quota, ban or
/// concurrency): its bucket judged directly, without the lists of checks, flags and verdicts
/// a store is asked and answers with. `None`: the general path decides it.
fn lone(limit: &Limit, view: &RequestView<'_>, now: Moment) -> Option<LimitResult> {
    if limit.concurrency.is_some()
        || limit.quota.is_some()
        || limit.bans.is_some()
        || limit.count_when.is_some()
    {
        return None;
    }
    if view.is_exempt(&limit.exempt) {
        return Some(unchecked(0, limit, None));
    }
    let client = view.resolve(&limit.key);
    let item = local::Item {
        buckets: &limit.local,
        client,
        peer: local::Peer::of(view.client_ip),
        rate: &limit.rate,
        cost: limit.cost,
        window: None,
    };
    let v = local::check_one(&item, !limit.shadow, now.us());
    Some(LimitResult {
        verdict: Some(v),
        outcome: outcome(&v, limit),
        ..unchecked(0, limit, Some(client))
    })
}

/// A request's limits before a store is asked: every limit's result so far, and the checks
/// of those not exempt (with their overrides, and whether each is enforced).
struct Prepared<'a> {
    results: smallvec::SmallVec<[LimitResult; 2]>,
    checks: Small<Check<'a>>,
    /// Aligned with `checks`; left empty when nothing is tuned.
    tunings: Small<Option<&'a Tuning>>,
    enforced: Small<bool>,
}

impl<'a> Prepared<'a> {
    fn of(limits: &'a [Arc<Limit>], view: &RequestView<'_>, tuned: &[Option<&'a Tuning>]) -> Self {
        let mut results = smallvec::SmallVec::with_capacity(limits.len());
        let mut checks: Small<Check<'_>> = Small::new();
        let mut tunings: Small<Option<&Tuning>> = Small::new();
        for (index, limit) in limits.iter().enumerate() {
            // Concurrency limits are taken by `take_slots`, not here.
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
        let enforced = checks.iter().map(|c| !c.limit.shadow).collect();
        Self {
            results,
            checks,
            tunings,
            enforced,
        }
    }

    /// `of`, for identities known already (`clients[i]` is limit `i`'s; `None`: exempt).
    fn known(
        limits: &'a [Arc<Limit>],
        clients: &[Option<ClientId>],
        tuned: &[Option<&'a Tuning>],
    ) -> Self {
        let mut results = smallvec::SmallVec::with_capacity(limits.len());
        let (mut checks, mut tunings) = (Small::new(), Small::new());
        for (index, limit) in limits.iter().enumerate() {
            if limit.concurrency.is_some() {
                continue;
            }
            // A quota override counts in a bucket of its own, as in `of`.
            let fresh = tuned.get(index).copied().flatten().and_then(|t| t.fresh);
            let client = (clients.get(index).copied().flatten())
                .map(|id| fresh.map_or(id, |salt| ClientId(id.0 ^ salt)));
            results.push(unchecked(index, limit, client));
            if let Some(client) = client {
                checks.push(Check { limit, client });
                if !tuned.is_empty() {
                    tunings.push(tuned.get(index).copied().flatten());
                }
            }
        }
        let enforced = checks.iter().map(|c| !c.limit.shadow).collect();
        Self {
            results,
            checks,
            tunings,
            enforced,
        }
    }

    /// The result slot of each check (exempt limits have results and no check).
    fn slots(&self) -> Small<usize> {
        (self.results.iter().enumerate())
            .filter(|(_, r)| r.outcome != Outcome::Exempt)
            .map(|(i, _)| i)
            .collect()
    }

    /// The results to fill in, and what to ask a store for them.
    fn split(&mut self, peer: local::Peer, now: Moment) -> (&mut [LimitResult], Asked<'_>) {
        let asked = Asked {
            checks: &self.checks,
            enforced: &self.enforced,
            tuned: &self.tunings,
            peer,
            now,
            wall: None,
            leases: &[],
        };
        (&mut self.results, asked)
    }
}

/// Ask `store` for `asked`'s checks and fill in `results` (every limit of the route, the
/// exempt ones included): from its answer, or by each limit's failure policy when it has none.
pub(super) async fn settle<S: Store>(results: &mut [LimitResult], store: &S, asked: Asked<'_>) {
    match store.check(asked).await {
        Ok(answer) => record(results, asked.checks, answer),
        Err(_) => without_backend(results, asked),
    }
}

/// `decide` in process for a request whose identities are known already (`clients[i]` is
/// limit `i`'s, `None` when it is exempt), at `now`, microseconds since the Unix epoch, which
/// is also the wall-clock time quotas count in: how `tollgate simulate` replays a logged
/// request. Concurrency limits are skipped, as `decide` skips them.
pub fn decide_known(
    limits: &[Arc<Limit>],
    clients: &[Option<ClientId>],
    peer: local::Peer,
    now: Moment,
) -> Decision {
    let mut p = Prepared::known(limits, clients, &[]);
    if p.checks.iter().any(|c| c.limit.count_when.is_some()) {
        use futures_util::FutureExt as _;
        let store = Local { fallback: false };
        // The in-process store answers at once: this future is ready when first polled.
        let _ = counted::admit(&mut p, &store, peer, (now, Some(now))).now_or_never();
    } else if !p.checks.is_empty() {
        let (results, mut asked) = p.split(peer, now);
        asked.wall = Some(now);
        let answer = Local { fallback: false }.decide(asked);
        record(results, asked.checks, answer);
    }
    Decision { results: p.results }
}

/// `counted::count` in process for a replayed request (`decide_known`'s): its logged
/// response's `status` charged to the `count_when` limits that list it.
pub fn count_known(
    limits: &[Arc<Limit>],
    clients: &[Option<ClientId>],
    status: u16,
    peer: local::Peer,
    now: Moment,
) {
    use futures_util::FutureExt as _;
    let none = None::<&Local>;
    let _ = counted::count(none, limits, clients, status, peer, (now, Some(now))).now_or_never();
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

/// Fill in the results of the checked (non-exempt) limits from a store's answer, in one walk:
/// each verdict (when a ban refused the request first, only its limit has one) and each ban
/// event, logged.
fn record(results: &mut [LimitResult], checks: &[Check<'_>], answer: Answer) {
    let checked = results.iter_mut().filter(|r| r.outcome != Outcome::Exempt);
    let mut bans = answer.bans.into_iter();
    for (i, (r, c)) in checked.zip(checks).enumerate() {
        let verdict = match answer.banned {
            Some((banned, v)) => (banned == i).then_some(v),
            None => answer.verdicts.get(i).copied(),
        };
        if let Some(v) = verdict {
            r.verdict = Some(v);
            r.outcome = outcome(&v, c.limit);
        }
        if let Some(event) = bans.next() {
            r.ban = event;
            super::ban::log(c, event);
        }
    }
}

/// The shared store did not answer: each limit follows its `on_failure` policy. `local` limits
/// are checked together in process at their fallback numbers (all or nothing among
/// themselves).
///
/// A request an enforced `closed` limit refuses takes nothing from the `local` ones either:
/// all or nothing holds while the store is away too.
fn without_backend(results: &mut [LimitResult], asked: Asked<'_>) {
    let refused = (asked.checks.iter())
        .any(|c| c.limit.on_failure == FailurePolicy::Closed && !c.limit.shadow);
    let local: Small<Check<'_>> = if refused {
        Small::new()
    } else {
        (asked.checks.iter())
            .filter(|c| c.limit.on_failure == FailurePolicy::Local)
            .copied()
            .collect()
    };
    let enforced: Small<bool> = local.iter().map(|c| !c.limit.shadow).collect();
    let fallback = Asked {
        checks: &local,
        enforced: &enforced,
        tuned: &[],
        ..asked
    };
    let answer = Local { fallback: true }.decide(fallback);
    let mut local_verdicts = answer.verdicts.into_iter();
    let checked = results.iter_mut().filter(|r| r.outcome != Outcome::Exempt);
    for (r, c) in checked.zip(asked.checks) {
        r.fallback = true;
        r.outcome = match c.limit.on_failure {
            FailurePolicy::Open => Outcome::FailedOpen,
            FailurePolicy::Closed if c.limit.shadow => Outcome::FailedOpen,
            FailurePolicy::Closed => Outcome::FailedClosed,
            // Not counted: the closed limit refuses the request.
            FailurePolicy::Local if refused => Outcome::Admitted,
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

pub(crate) mod counted;
mod leased;
pub(crate) mod settled;
pub(crate) mod slots;
#[cfg(test)]
mod tests;
