//! A request's concurrency slots taken in a store, by each limit's failure policy where the
//! store cannot answer (the slots and their guard are `concurrency`'s).

use std::sync::Arc;

use crate::identity::RequestView;
use crate::limiter::concurrency::{self, Guard};
use crate::limiter::store::{Local, Store};
use crate::limiter::{FailurePolicy, Limit, LimitResult, Outcome, Small};

/// Take a slot of each of `limits`' concurrency limits for the request, in route order, in
/// `store`; where it cannot answer, by each limit's failure policy (`local`: in process, at
/// the stricter fallback cap). Stops at the first limit that rejects, and then holds nothing
/// (the guard is empty: what was taken is given back at once).
pub async fn acquire<S: Store>(
    store: &S,
    limits: &[Arc<Limit>],
    view: &RequestView<'_>,
) -> (Guard, Small<LimitResult>) {
    let mut guard = Guard::default();
    let mut results = Small::new();
    for (index, limit) in limits.iter().enumerate() {
        let Some(spec) = limit.concurrency else {
            continue;
        };
        let mut result = LimitResult {
            index,
            outcome: Outcome::Exempt,
            verdict: None,
            fallback: false,
            shadow: limit.shadow,
            client: None,
            ban: crate::limiter::ban::BanEvent::None,
        };
        if view.is_exempt(&limit.exempt) {
            results.push(result);
            continue;
        }
        let client = view.resolve(&limit.key);
        result.client = Some(client);
        let taken = match store.take_slot(limit, client, cap(limit, spec.max)).await {
            Ok(taken) => Some(taken),
            Err(_) => {
                result.fallback = true;
                let Ok(taken) = by_policy(limit, client, cap(limit, spec.fallback)) else {
                    result.outcome = Outcome::FailedClosed;
                    results.push(result);
                    return (Guard::default(), results);
                };
                taken
            }
        };
        let max = if result.fallback {
            spec.fallback
        } else {
            spec.max
        };
        result.outcome = match taken {
            None => Outcome::FailedOpen,
            Some(Ok((held, n))) => {
                guard.hold(held);
                if n > max {
                    Outcome::ShadowLimited
                } else {
                    Outcome::Admitted
                }
            }
            Some(Err(_)) => {
                result.verdict = Some(concurrency::FULL);
                result.outcome = Outcome::Limited;
                results.push(result);
                return (Guard::default(), results);
            }
        };
        results.push(result);
    }
    (guard, results)
}

/// The cap a limit takes a slot under: a shadow limit always takes its slot, and reports when
/// it would have been over.
fn cap(limit: &Limit, max: u32) -> u32 {
    if limit.shadow {
        u32::MAX
    } else {
        max
    }
}

/// A slot where the store could not answer, by the limit's failure policy: none, admitted
/// without one (`open`, and a `closed` shadow limit, which never refuses); one taken in process
/// at the fallback cap `max` (`local`); or refused (`closed`).
fn by_policy(
    limit: &Limit,
    client: crate::identity::ClientId,
    max: u32,
) -> Result<Option<crate::limiter::store::SlotTake>, ()> {
    match limit.on_failure {
        FailurePolicy::Open => Ok(None),
        FailurePolicy::Closed if limit.shadow => Ok(None),
        FailurePolicy::Closed => Err(()),
        FailurePolicy::Local => Ok(Some(Local::slot(limit, client, max))),
    }
}
