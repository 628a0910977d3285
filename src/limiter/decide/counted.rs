//! Limits with `count_when`: checked at admission without being charged (their state read,
//! as `peek` reads it), counted once a response of their statuses comes (`count`).
//!
//! A request such a limit refuses is asked of the store after all, for that limit alone: it is
//! refused again, which counts the ban's strike and charges nothing; the route's other limits
//! are not asked (all or nothing). Otherwise the other limits are checked as usual.

use super::{outcome, record, settle, without_backend, Prepared};
use crate::limiter::store::{Asked, Store};
use crate::limiter::{local, Check, LimitResult, Moment, Small, Tuning};

/// Decide `p`'s checks at `now` when some limit counts only on certain responses.
pub(super) async fn admit<S: Store>(
    p: &mut Prepared<'_>,
    store: &S,
    peer: local::Peer,
    (now, wall): (Moment, Option<Moment>),
) {
    let slots = p.slots();
    let (mut refused, mut failed, mut rest) = (Small::new(), Small::new(), Small::new());
    for (i, c) in p.checks.iter().enumerate() {
        if c.limit.count_when.is_none() {
            rest.push(i);
            continue;
        }
        let tuning = p.tunings.get(i).copied().flatten();
        let Ok(mut peeked) = store.peek(c.limit, c.client, peer, (now, wall)).await else {
            failed.push(i);
            continue;
        };
        if let (Some(w), Some(count)) = (&mut peeked.window, tuning.and_then(|t| t.quota)) {
            w.count = count;
        }
        let rate = tuning.map_or(&c.limit.rate, |t| &t.rate);
        let (_, mut v) = peeked.bucket(rate, Tuning::cost_of(c, tuning));
        if let Some(left) = peeked.ban.map(|b| b.banned_us).filter(|&us| us > 0.0) {
            v.admitted = false;
            v.retry_after_us = v.retry_after_us.max(left);
        }
        let r = &mut p.results[slots[i]];
        r.verdict = Some(v);
        r.outcome = outcome(&v, c.limit);
        if !v.admitted && p.enforced[i] {
            refused.push(i);
        }
    }
    if !refused.is_empty() {
        // Refused again by the store: the ban's strike, nothing charged.
        ask(p, &slots, &refused, store, peer, (now, wall)).await;
        return;
    }
    if !failed.is_empty() {
        let mut results = subset_results(p, &slots, &failed);
        let (checks, enforced, tuned) = subset(p, &failed);
        let asked = asked(&checks, &enforced, &tuned, peer, (now, wall));
        without_backend(&mut results, asked);
        put_back(p, &slots, &failed, &results);
    }
    if !rest.is_empty() {
        ask(p, &slots, &rest, store, peer, (now, wall)).await;
    }
}

/// Ask `store` for the checks `which`, their results put in place.
async fn ask<S: Store>(
    p: &mut Prepared<'_>,
    slots: &[usize],
    which: &[usize],
    store: &S,
    peer: local::Peer,
    at: (Moment, Option<Moment>),
) {
    let mut results = subset_results(p, slots, which);
    let (checks, enforced, tuned) = subset(p, which);
    settle(
        &mut results,
        store,
        asked(&checks, &enforced, &tuned, peer, at),
    )
    .await;
    put_back(p, slots, which, &results);
}

type Subset<'a> = (Small<Check<'a>>, Small<bool>, Small<Option<&'a Tuning>>);

fn subset<'a>(p: &Prepared<'a>, which: &[usize]) -> Subset<'a> {
    let tuned = if p.tunings.is_empty() {
        Small::new()
    } else {
        which.iter().map(|&i| p.tunings[i]).collect()
    };
    (
        which.iter().map(|&i| p.checks[i]).collect(),
        which.iter().map(|&i| p.enforced[i]).collect(),
        tuned,
    )
}

fn asked<'a>(
    checks: &'a [Check<'a>],
    enforced: &'a [bool],
    tuned: &'a [Option<&'a Tuning>],
    peer: local::Peer,
    (now, wall): (Moment, Option<Moment>),
) -> Asked<'a> {
    Asked {
        checks,
        enforced,
        tuned,
        peer,
        now,
        wall,
        leases: &[],
    }
}

fn subset_results(p: &Prepared<'_>, slots: &[usize], which: &[usize]) -> Small<LimitResult> {
    which.iter().map(|&i| p.results[slots[i]]).collect()
}

fn put_back(p: &mut Prepared<'_>, slots: &[usize], which: &[usize], results: &[LimitResult]) {
    for (&i, r) in which.iter().zip(results) {
        p.results[slots[i]] = *r;
    }
}

/// Count a response of `status` against `limits` (a route's, in route order) for the
/// identities `clients[i]` the request was decided under: the limits whose `count_when`
/// holds `status` are charged, all or nothing among themselves (a limit already spent is
/// refused again: the ban's strike). What the store cannot answer is not counted.
pub async fn count<S: Store>(
    store: Option<&S>,
    limits: &[std::sync::Arc<crate::limiter::Limit>],
    clients: &[Option<crate::identity::ClientId>],
    status: u16,
    peer: local::Peer,
    (now, wall): (Moment, Option<Moment>),
) {
    let counted: Small<Option<crate::identity::ClientId>> = (limits.iter().zip(clients))
        .map(|(l, c)| c.filter(|_| l.count_when.is_some_and(|s| s.contains(status))))
        .collect();
    let mut p = Prepared::known(limits, &counted, &[]);
    if p.checks.is_empty() {
        return;
    }
    let (results, mut asked) = p.split(peer, now);
    asked.wall = wall;
    match store {
        Some(store) => settle(results, store, asked).await,
        None => {
            let answer = crate::limiter::store::Local { fallback: false }.decide(asked);
            record(results, asked.checks, answer);
        }
    }
}
