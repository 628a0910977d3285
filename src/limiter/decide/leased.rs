//! A request whose route has a leased limit: the checks a lease held here covers are admitted
//! here; the rest (and the top-ups of leases running low) go to the shared store in one
//! check, all or nothing across both.

use super::{outcome, record, without_backend, Prepared};
use crate::limiter::leasing::{Ask, Plan};
use crate::limiter::store::{Asked, Store};
use crate::limiter::{Check, LimitResult, Moment, Outcome, Small, Tuning};

/// Decide `p`'s checks at `now`: from leases where they hold enough, the rest in `store`, the
/// failure policy for those when it cannot answer.
pub(super) async fn settle<S: Store>(
    p: &mut Prepared<'_>,
    store: &S,
    peer: crate::limiter::local::Peer,
    now: Moment,
) {
    let plans = plan(p, store, now);
    let slots = p.slots();
    // A leased limit refusing here: the request is refused without asking Redis anything.
    for (i, plan) in plans.iter().enumerate() {
        if let Plan::Refused { verdict } = plan {
            let r = &mut p.results[slots[i]];
            r.verdict = Some(*verdict);
            r.outcome = outcome(verdict, p.checks[i].limit);
        }
    }
    let refused_here = |i: usize| matches!(plans[i], Plan::Refused { .. }) && p.enforced[i];
    if (0..plans.len()).any(refused_here) {
        return;
    }
    // Redis is asked for the checks no lease covers, then the top-ups: the failure policy
    // applies to the first part only.
    let counted: Small<usize> = (0..plans.len())
        .filter(|&i| !matches!(plans[i], Plan::Spent { .. } | Plan::Refused { .. }))
        .collect();
    let top_ups: Small<usize> = (0..plans.len())
        .filter(|&i| matches!(plans[i], Plan::Spent { top_up, .. } if top_up > 0))
        .collect();
    for (i, plan) in plans.iter().enumerate() {
        if let Plan::Spent { verdict, .. } = plan {
            store.count_leased();
            let r = &mut p.results[slots[i]];
            r.verdict = Some(*verdict);
            r.outcome = outcome(verdict, p.checks[i].limit);
        }
    }
    let order: Small<usize> = counted.iter().chain(&top_ups).copied().collect();
    if !order.is_empty() {
        let (results, charged) = ask(p, &plans, &order, counted.len(), store, peer, now).await;
        for (j, &i) in order.iter().enumerate() {
            let top_up = j >= counted.len();
            // A top-up's request was admitted here: Redis's answer replaces it only when a
            // ban holds the identity fleet-wide.
            if !top_up || results[j].ban == crate::limiter::ban::BanEvent::Refused {
                p.results[slots[i]] = results[j];
            }
        }
        settle_leases(p, store, &plans, &order, &results, charged, now);
    }
    // All or nothing: a request refused anywhere takes nothing from the leases either.
    let refused =
        (p.results.iter()).any(|r| matches!(r.outcome, Outcome::Limited | Outcome::FailedClosed));
    if refused {
        for (i, plan) in plans.iter().enumerate() {
            if let (Plan::Spent { .. }, Some(leases)) = (plan, &p.checks[i].limit.leases) {
                let cost = Tuning::cost_of(&p.checks[i], p.tunings.get(i).copied().flatten());
                leases.put_back(p.checks[i].client, cost);
            }
        }
    }
}

/// Ask Redis for the checks `order` lists (the first `counted` counted, the rest top-ups):
/// their results, and whether Redis answered and charged the call (took every lease's tokens
/// it asked). When it cannot answer, the counted checks follow the failure policy.
async fn ask<S: Store>(
    p: &Prepared<'_>,
    plans: &[Plan],
    order: &[usize],
    counted: usize,
    store: &S,
    peer: crate::limiter::local::Peer,
    now: Moment,
) -> (Small<LimitResult>, bool) {
    let slots = p.slots();
    let checks: Small<Check<'_>> = order.iter().map(|&i| p.checks[i]).collect();
    let enforced: Small<bool> = order.iter().map(|&i| p.enforced[i]).collect();
    let tuned: Small<Option<&crate::limiter::Tuning>> = if p.tunings.is_empty() {
        Small::new()
    } else {
        order.iter().map(|&i| p.tunings[i]).collect()
    };
    let asks: Small<Ask> = order
        .iter()
        .map(|&i| match plans[i] {
            // A check refused here is never asked (see `settle`).
            Plan::Exact | Plan::Refused { .. } => Ask::default(),
            Plan::Take { extra } => Ask {
                tokens: extra,
                top_up: false,
            },
            Plan::Spent { top_up, .. } => Ask {
                tokens: top_up,
                top_up: true,
            },
        })
        .collect();
    let mut results: Small<LimitResult> = order.iter().map(|&i| p.results[slots[i]]).collect();
    let asked = Asked {
        checks: &checks,
        enforced: &enforced,
        tuned: &tuned,
        peer,
        now,
        wall: None,
        leases: &asks,
    };
    let charged = match store.check(asked).await {
        Ok(answer) => {
            record(&mut results, &checks, answer);
            (results.iter().zip(&enforced))
                .all(|(r, &e)| !e || r.verdict.is_some_and(|v| v.admitted))
        }
        Err(_) => {
            let part = Asked {
                checks: &checks[..counted],
                enforced: &enforced[..counted],
                tuned: if tuned.is_empty() {
                    &[]
                } else {
                    &tuned[..counted]
                },
                leases: &[],
                ..asked
            };
            without_backend(&mut results[..counted], part);
            false
        }
    };
    (results, charged)
}

/// Each check's plan; tokens of leases taken at other numbers go back to Redis now.
fn plan(p: &Prepared<'_>, store: &impl Store, now: Moment) -> Small<Plan> {
    (p.checks.iter().enumerate())
        .map(|(i, c)| {
            let Some(leases) = &c.limit.leases else {
                return Plan::Exact;
            };
            let tuning = p.tunings.get(i).copied().flatten();
            let rate = tuning.map_or(&c.limit.rate, |t| &t.rate);
            let cost = Tuning::cost_of(c, tuning);
            let (plan, back) = leases.plan(c.client, cost, rate, now.us());
            if let Some(back) = back {
                store.give_back(c.limit, back);
            }
            plan
        })
        .collect()
}

/// The leases' side of Redis's answer: what a take or top-up got when the call charged.
fn settle_leases(
    p: &Prepared<'_>,
    store: &impl Store,
    plans: &[Plan],
    order: &[usize],
    results: &[LimitResult],
    charged: bool,
    now: Moment,
) {
    for (j, &i) in order.iter().enumerate() {
        let c = &p.checks[i];
        let Some(leases) = &c.limit.leases else {
            continue;
        };
        let asked = match plans[i] {
            Plan::Take { extra } => extra,
            Plan::Spent { top_up, .. } => top_up,
            Plan::Exact | Plan::Refused { .. } => continue,
        };
        if results[j].ban == crate::limiter::ban::BanEvent::Refused {
            // Banned fleet-wide: the lease ends, its tokens back in the bucket.
            if let Some(back) = leases.end(c.client) {
                store.give_back(c.limit, back);
            }
            continue;
        }
        match results[j].verdict {
            Some(v) if charged && v.admitted => {
                leases.granted(c.client, asked, v.remaining, v.reset_us, now.us());
            }
            // This limit's own bucket refused (not another limit, not a failure's fallback).
            Some(v) if !v.admitted && !results[j].fallback => {
                leases.refused(c.client, &v, now.us());
            }
            _ => leases.not_granted(c.client),
        }
    }
}
