//! The failure policy and all-or-nothing, against stores that fail or answer as told.

use std::future::Future;
use std::sync::Arc;

use futures_util::FutureExt as _;
use parking_lot::Mutex;

use super::settle;
use crate::identity::ClientId;
use crate::limiter::ban::BanEvent;
use crate::limiter::redis::Unavailable;
use crate::limiter::store::{Answer, Asked, Local, SlotTake, Store};
use crate::limiter::{local, Check, Limit, LimitResult, Moment, Outcome, Small, Verdict};

/// A store that cannot answer (Redis down, breaker open, timed out).
struct Failing(Unavailable);

impl Store for Failing {
    fn check<'s>(
        &'s self,
        _: Asked<'s>,
    ) -> impl Future<Output = Result<Answer, Unavailable>> + Send + 's {
        std::future::ready(Err(self.0))
    }

    fn take_slot<'s>(
        &'s self,
        _: &'s Limit,
        _: ClientId,
        _: u32,
    ) -> impl Future<Output = Result<SlotTake, Unavailable>> + Send + 's {
        std::future::ready(Err(self.0))
    }

    fn peek<'s>(
        &'s self,
        _: &'s Limit,
        _: ClientId,
        _: local::Peer,
        _: (Moment, Option<Moment>),
    ) -> impl Future<Output = Result<crate::limiter::peek::Peeked, Unavailable>> + Send + 's {
        std::future::ready(Err(self.0))
    }

    fn settle(&self, _: &Limit, _: ClientId, _: i64, _: local::Peer, _: Moment) {}
}

/// A store that answers with the verdicts it is given and remembers what it was asked: how
/// often, the lease tokens asked, and the requests counted from leases without asking it.
#[derive(Default)]
struct Told {
    admitted: Vec<bool>,
    bans: Vec<BanEvent>,
    asked: Mutex<usize>,
    lease_tokens: Mutex<u32>,
    leased: Mutex<usize>,
}

impl Store for Told {
    fn check<'s>(
        &'s self,
        asked: Asked<'s>,
    ) -> impl Future<Output = Result<Answer, Unavailable>> + Send + 's {
        *self.asked.lock() += 1;
        *self.lease_tokens.lock() += asked.leases.iter().map(|a| a.tokens).sum::<u32>();
        let verdicts = (self.admitted.iter().take(asked.checks.len()))
            .map(|&admitted| verdict(admitted))
            .collect();
        let bans = self.bans.iter().copied().collect();
        std::future::ready(Ok(Answer {
            verdicts,
            banned: None,
            bans,
        }))
    }

    /// Slots as in process: this store is told about buckets only.
    fn take_slot<'s>(
        &'s self,
        limit: &'s Limit,
        client: ClientId,
        max: u32,
    ) -> impl Future<Output = Result<SlotTake, Unavailable>> + Send + 's {
        std::future::ready(Ok(Local::slot(limit, client, max)))
    }

    /// Read in process: this store is told about checks only.
    fn peek<'s>(
        &'s self,
        limit: &'s Limit,
        client: ClientId,
        peer: local::Peer,
        at: (Moment, Option<Moment>),
    ) -> impl Future<Output = Result<crate::limiter::peek::Peeked, Unavailable>> + Send + 's {
        Local { fallback: false }.peek(limit, client, peer, at)
    }

    fn count_leased(&self) {
        *self.leased.lock() += 1;
    }

    fn settle(&self, _: &Limit, _: ClientId, _: i64, _: local::Peer, _: Moment) {}
}

fn verdict(admitted: bool) -> Verdict {
    Verdict {
        admitted,
        remaining: if admitted { 100 } else { 0 },
        reset_us: 1e6,
        retry_after_us: if admitted { 0.0 } else { 1e6 },
    }
}

/// The limits of one route, from `limits:` items of the YAML (in process, fallback at half).
fn limits(items: &str) -> Vec<Arc<Limit>> {
    limits_in("{ local_fallback: { divide_by: 2 } }", items)
}

/// `limits` kept in Redis (never asked here: the stores under test stand in for it).
fn shared_limits(items: &str) -> Vec<Arc<Limit>> {
    let limiter = "{ backend: redis, redis: { url: \"redis://127.0.0.1:1\" }, local_fallback: { divide_by: 2 } }";
    limits_in(limiter, items)
}

fn limits_in(limiter: &str, items: &str) -> Vec<Arc<Limit>> {
    let yaml = format!(
        "listeners: [{{address: 127.0.0.1:0}}]\nlimiter: {limiter}\nroutes:\n  - name: r\n    respond: {{ status: 200 }}\n    limits:\n{items}"
    );
    let settings = crate::config::parse(&yaml).expect("a valid config");
    (settings.routes[0].limits.iter())
        .map(|spec| Limit::build(spec, None, &settings.limiter))
        .collect()
}

/// Decide one request of client `who` against `limits` with `store`, at `now` (µs).
fn decide(store: &impl Store, limits: &[Arc<Limit>], who: u128, now: f64) -> Small<LimitResult> {
    let checks: Small<Check<'_>> = (limits.iter())
        .map(|limit| Check {
            limit,
            client: ClientId(who),
        })
        .collect();
    let mut results: Small<LimitResult> = (limits.iter().enumerate())
        .map(|(i, l)| super::unchecked(i, l, Some(ClientId(who))))
        .collect();
    let enforced: Small<bool> = checks.iter().map(|c| !c.limit.shadow).collect();
    let asked = Asked {
        checks: &checks,
        enforced: &enforced,
        tuned: &[],
        peer: local::Peer::of("192.0.2.1".parse().unwrap()),
        now: Moment::from_us(now),
        wall: None,
        leases: &[],
    };
    settle(&mut results, store, asked)
        .now_or_never()
        .expect("these stores answer at once");
    results
}

fn outcomes(results: &[LimitResult]) -> Vec<Outcome> {
    results.iter().map(|r| r.outcome).collect()
}

#[test]
fn a_failed_store_applies_each_limits_policy() {
    let limits = limits(
        "      - { name: o, rate: 1/s, burst: 4, key: [ip], on_failure: open }\n      - { name: c, rate: 1/s, burst: 4, key: [ip], on_failure: closed }\n      - { name: s, rate: 1/s, burst: 4, key: [ip], on_failure: closed, shadow: true }\n      - { name: l, rate: 1/s, burst: 4, key: [ip], on_failure: local }\n",
    );
    let whys = [
        Unavailable::BreakerOpen,
        Unavailable::Timeout,
        Unavailable::Error,
    ];
    for (who, why) in (1..).zip(whys) {
        let results = decide(&Failing(why), &limits, who, 0.0);
        assert_eq!(
            outcomes(&results),
            [
                Outcome::FailedOpen,
                Outcome::FailedClosed,
                Outcome::FailedOpen,
                Outcome::Admitted
            ],
            "{why:?}: closed refuses, a shadow closed limit only reports, local counts here"
        );
        assert!(results.iter().all(|r| r.fallback), "every result says so");
    }
}

#[test]
fn the_local_policy_counts_at_the_fallback_share() {
    // burst 4 divided by 2 replicas: 2 requests per replica while the store is away.
    let limits =
        limits("      - { name: l, rate: 1/min, burst: 4, key: [ip], on_failure: local }\n");
    let store = Failing(Unavailable::Timeout);
    let seen: Vec<Outcome> = (0..3)
        .map(|_| decide(&store, &limits, 7, 0.0)[0].outcome)
        .collect();
    assert_eq!(
        seen,
        [Outcome::Admitted, Outcome::Admitted, Outcome::Limited]
    );
    // Another identity has its own fallback bucket.
    assert_eq!(
        decide(&store, &limits, 8, 0.0)[0].outcome,
        Outcome::Admitted
    );
}

#[test]
fn in_process_a_request_one_limit_refuses_takes_nothing_from_the_others() {
    let limits = limits(
        "      - { name: wide, rate: 1/min, burst: 5, key: [ip] }\n      - { name: narrow, rate: 1/min, burst: 1, key: [ip] }\n",
    );
    let store = Local { fallback: false };
    let first = decide(&store, &limits, 7, 0.0);
    assert_eq!(outcomes(&first), [Outcome::Admitted, Outcome::Admitted]);
    assert_eq!(first[0].verdict.map(|v| v.remaining), Some(4));
    for _ in 0..3 {
        let refused = decide(&store, &limits, 7, 0.0);
        assert_eq!(outcomes(&refused), [Outcome::Admitted, Outcome::Limited]);
    }
    // The wide limit alone: the three refused requests took none of its tokens.
    let alone = decide(&store, &limits[..1], 7, 0.0);
    assert_eq!(alone[0].verdict.map(|v| v.remaining), Some(3));
}

#[test]
fn a_shadow_limit_over_its_numbers_reports_and_refuses_nothing() {
    let limits = limits(
        "      - { name: real, rate: 1/min, burst: 5, key: [ip] }\n      - { name: dry, rate: 1/min, burst: 1, key: [ip], shadow: true }\n",
    );
    let store = Local { fallback: false };
    decide(&store, &limits, 7, 0.0);
    let second = decide(&store, &limits, 7, 0.0);
    assert_eq!(
        outcomes(&second),
        [Outcome::Admitted, Outcome::ShadowLimited]
    );
    assert_eq!(second[0].verdict.map(|v| v.remaining), Some(3), "counted");
}

#[test]
fn a_stores_verdicts_and_ban_events_become_the_results() {
    let limits = limits(
        "      - { name: a, rate: 1/s, burst: 4, key: [ip] }\n      - { name: b, rate: 1/s, burst: 4, key: [ip], ban: { after: 3, within: 1m, for: 10m, max: 1h } }\n",
    );
    let store = Told {
        admitted: vec![true, false],
        bans: vec![BanEvent::None, BanEvent::Started(600_000_000)],
        ..Told::default()
    };
    let results = decide(&store, &limits, 7, 0.0);
    assert_eq!(outcomes(&results), [Outcome::Admitted, Outcome::Limited]);
    assert_eq!(results[1].ban, BanEvent::Started(600_000_000));
    assert!(results.iter().all(|r| !r.fallback));
    assert_eq!(
        *store.asked.lock(),
        1,
        "one call for every limit of the request"
    );
}

#[test]
fn exempt_limits_are_not_asked_of_any_store() {
    let limits = limits("      - { name: a, rate: 1/s, burst: 4, key: [ip] }\n");
    let mut results: Small<LimitResult> =
        smallvec::smallvec![super::unchecked(0, &limits[0], None)];
    let asked = Asked {
        checks: &[],
        enforced: &[],
        tuned: &[],
        peer: local::Peer::of("192.0.2.1".parse().unwrap()),
        now: Moment::from_us(0.0),
        wall: None,
        leases: &[],
    };
    settle(&mut results, &Failing(Unavailable::Error), asked)
        .now_or_never()
        .expect("answers at once");
    assert_eq!(
        results[0].outcome,
        Outcome::Exempt,
        "a failed store changes nothing"
    );
    assert!(!results[0].fallback);
}

#[test]
fn a_request_a_closed_limit_refuses_takes_no_local_fallback_token() {
    let limits = limits(
        "      - { name: l, rate: 1/min, burst: 4, key: [ip], on_failure: local }\n      - { name: c, rate: 1/min, burst: 4, key: [ip], on_failure: closed }\n",
    );
    let store = Failing(Unavailable::Error);
    for _ in 0..5 {
        let refused = decide(&store, &limits, 7, 0.0);
        assert_eq!(
            outcomes(&refused),
            [Outcome::Admitted, Outcome::FailedClosed]
        );
        assert_eq!(refused[0].verdict, None, "the local limit was not counted");
    }
    // The local limit alone still has its whole fallback share (burst 4 / 2 replicas).
    let alone = decide(&store, &limits[..1], 7, 0.0);
    assert_eq!(alone[0].verdict.map(|v| v.remaining), Some(1));
}

/// Concurrency limits follow their failure policy as buckets do: a store that cannot take a
/// slot admits (`open`, and a `closed` shadow limit), refuses (`closed`, holding nothing) or
/// takes the slot in process at the fallback cap (`local`: 4 halved).
#[test]
fn a_failed_store_applies_each_concurrency_limits_policy() {
    let view_of = |limits: &[Arc<Limit>]| {
        let req = http::Request::new(());
        let arrival = crate::identity::Arrival::of(&req, "192.0.2.1".parse().unwrap());
        let view = arrival.view(false, None);
        crate::limiter::take_slots(&Failing(Unavailable::Timeout), limits, &view)
            .now_or_never()
            .expect("a failing store answers at once")
    };
    let open = limits("      - { name: o, concurrency: 4, key: [ip], on_failure: open }\n");
    let (held, results) = view_of(&open);
    assert_eq!(
        (held.len(), outcomes(&results)),
        (0, vec![Outcome::FailedOpen])
    );
    let shadow = limits(
        "      - { name: s, concurrency: 4, key: [ip], on_failure: closed, shadow: true }\n",
    );
    assert_eq!(outcomes(&view_of(&shadow).1), [Outcome::FailedOpen]);
    let closed = limits(
        "      - { name: l, concurrency: 4, key: [ip], on_failure: local }\n      - { name: c, concurrency: 4, key: [ip], on_failure: closed }\n",
    );
    let (held, results) = view_of(&closed);
    assert_eq!(
        (held.len(), outcomes(&results)),
        (0, vec![Outcome::Admitted, Outcome::FailedClosed]),
        "refused by `c`: the slot `l` took is given back"
    );
    let local = limits("      - { name: l, concurrency: 4, key: [ip], on_failure: local }\n");
    let guards: Vec<_> = (0..3).map(|_| view_of(&local)).collect();
    let got: Vec<_> = guards.iter().map(|(_, r)| r[0].outcome).collect();
    assert_eq!(
        got,
        [Outcome::Admitted, Outcome::Admitted, Outcome::Limited],
        "in process at the fallback cap, 4 / 2"
    );
    assert!(guards.iter().all(|(_, r)| r[0].fallback));
}

/// One request from 192.0.2.1 against `limits` through `decide`, `store` the shared store.
fn request(store: &impl Store, limits: &[Arc<Limit>]) -> Vec<Outcome> {
    let req = http::Request::new(());
    let arrival = crate::identity::Arrival::of(&req, "192.0.2.1".parse().unwrap());
    let view = arrival.view(false, None);
    let decision = super::decide(Some(store), limits, &view, Moment::from_us(0.0), &[])
        .now_or_never()
        .expect("these stores answer at once");
    outcomes(&decision.results)
}

/// A leased limit's lease is taken in the same call as the checks, then spent here without
/// asking the store, each request so spent counted as leased.
#[test]
fn a_hot_identity_spends_its_lease_without_asking_the_store() {
    let limits = shared_limits(
        "      - { name: t, rate: 100/s, burst: 100, key: [ip], leasing: { tokens: 10, hold: 1s } }\n",
    );
    let store = Told {
        admitted: vec![true],
        ..Told::default()
    };
    for _ in 0..20 {
        assert_eq!(request(&store, &limits), [Outcome::Admitted]);
    }
    let (asked, leased) = (*store.asked.lock(), *store.leased.lock());
    assert!(*store.lease_tokens.lock() >= 9, "a lease was asked for");
    assert!(leased >= 9, "requests spent from the lease: {leased}");
    assert!(asked < 20 - 9 + 3, "the store asked {asked} times of 20");
}

/// A leased limit follows its failure policy when the store cannot answer, as any limit does,
/// and a hot identity gets no lease from a store that did not answer.
#[test]
fn a_failed_store_applies_each_leased_limits_policy() {
    let leased = |policy: &str| {
        shared_limits(&format!(
            "      - {{ name: t, rate: 1/min, burst: 4, key: [ip], on_failure: {policy}, leasing: {{ tokens: 2, hold: 1s }} }}\n"
        ))
    };
    let store = Failing(Unavailable::Timeout);
    let open = leased("open");
    let closed = leased("closed");
    for _ in 0..6 {
        assert_eq!(request(&store, &open), [Outcome::FailedOpen]);
        assert_eq!(request(&store, &closed), [Outcome::FailedClosed]);
    }
    let local = leased("local");
    let seen: Vec<Outcome> = (0..3).flat_map(|_| request(&store, &local)).collect();
    assert_eq!(
        seen,
        [Outcome::Admitted, Outcome::Admitted, Outcome::Limited],
        "in process at the fallback share, 4 / 2"
    );
}
