//! One limit explained for one request: its settings, the exemption or identity that applies,
//! its state now (read, never charged) and the outcome a check now would have.

use serde::{Deserialize, Serialize};

use crate::identity::{ClientId, Exemption, RequestView};
use crate::limiter::peek::{self, Peeked};
use crate::limiter::redis::RedisLimiter;
use crate::limiter::{FailurePolicy, Limit, Rate, Tuning};

/// Hex digits of the identity's digest shown: enough to tell clients apart and to find them
/// in the logs (which print the whole digest), never the raw value.
const CLIENT_HEX: usize = 16;

/// Where and when the limits are read.
#[derive(Debug, Clone, Copy)]
pub(super) struct At<'a> {
    pub redis: Option<&'a RedisLimiter>,
    /// The proxy's clock, in µs (what its in-process buckets count on).
    pub now_us: f64,
    /// Who mints the request's new in-process buckets.
    pub peer: crate::limiter::local::Peer,
}

/// One limit of the route, for one request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LimitExplained {
    pub name: String,
    pub kind: Kind,
    pub cost: u32,
    pub shadow: bool,
    pub on_failure: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ban: Option<BanRule>,
    /// Leases of this limit's tokens, with the fleet's stated bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leasing: Option<LeaseRule>,
    /// The key's alternatives, in order.
    pub key: Vec<String>,
    /// The exemption that matched, if one did (then nothing else is read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exempt: Option<Exempted>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<Identity>,
    /// The bucket (or the slots) now, for this identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub now: Option<Now>,
    /// The identity's ban state, for a limit with a ban.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ban_state: Option<BanState>,
    /// Why the state could not be read (Redis did not answer): the failure policy applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub outcome: Outcome,
    /// Seconds until a request of `cost` would be admitted: 0 when it is now.
    pub retry_after_s: f64,
    /// The operator's override in force for this identity (as `GET /api/v1/overrides` lists
    /// it): its numbers replace the limit's in `now` and the outcome.
    #[serde(default, rename = "override", skip_serializing_if = "Option::is_none")]
    pub overridden: Option<serde_json::Value>,
}

/// What kind of limit, with its numbers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Kind {
    TokenBucket {
        rate: String,
        per_sec: f64,
        burst: u32,
    },
    Quota {
        count: u32,
        period: String,
        timezone: String,
    },
    /// `window: N/W` with its `algorithm`.
    Window {
        count: u32,
        window: String,
        algorithm: String,
    },
    Concurrency {
        max: u32,
        lease_s: f64,
    },
}

/// `ban:` as configured, in seconds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BanRule {
    pub after: u32,
    pub within_s: f64,
    pub for_s: f64,
    pub max_s: f64,
}

/// A limit's `leasing`: a replica holds at most `tokens` of one identity's bucket, given back
/// after `hold_s` unused; `bound` states what a fleet admits at most.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaseRule {
    pub tokens: u32,
    pub auto: bool,
    pub hold_s: f64,
    pub bound: String,
}

/// The `exempt` entry that matched: its index and the entry, values masked.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Exempted {
    pub index: usize,
    pub entry: String,
}

/// The identity the request counts under.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Identity {
    /// The index of the key's alternative that resolved; `None`: none was present, so the
    /// request counts in the one shared `anonymous` bucket.
    pub alternative: Option<usize>,
    /// That alternative (`header:X-API-Key`), or `anonymous`.
    pub source: String,
    /// The first hex digits of the identity's digest.
    pub client: String,
}

/// One limit's state now, for the identity.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Now {
    /// `local`, `redis`, or `local fallback` (Redis did not answer; the `local` policy).
    pub store: String,
    /// Where a check would count the identity: `own`, `new`, `peer_overflow`, `overflow`.
    pub counted_in: String,
    /// Whole tokens (quota: requests; concurrency: slots) left now, of `limit`.
    pub remaining: u64,
    pub limit: u64,
    /// Seconds until the bucket is full again (quota: the window's end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_s: Option<f64>,
    /// Requests of the identity in flight (concurrency limits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<u32>,
    /// Tokens the bucket owes (a cost settled past what it held): waited out before anything
    /// is admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owed: Option<u64>,
}

/// The identity's ban state now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BanState {
    /// Seconds left of the ban in force; 0 when none is.
    pub banned_s: f64,
    pub strikes: u32,
    pub level: u32,
}

/// How the limit comes out for the request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Admitted,
    Limited,
    /// Over a `shadow: true` limit: reported, not enforced.
    ShadowLimited,
    /// A ban in force refuses the identity outright.
    Banned,
    Exempt,
    /// Redis did not answer; the `open` policy admits without counting.
    FailedOpen,
    /// Redis did not answer; the `closed` policy rejects.
    FailedClosed,
}

/// Explain `limit` for the request `view`. The steps are the request path's, in its order:
/// exemption, identity, then the state read for that identity, judged by the numbers that
/// apply to it (the limit's, or its fallback's when Redis did not answer). Anything else that
/// applies to one identity (a ban, other numbers) is one more step between the identity and
/// the judgement.
pub(super) async fn explain(
    limit: &Limit,
    view: &RequestView<'_>,
    at: &At<'_>,
    tuned: Option<(&Tuning, serde_json::Value)>,
) -> LimitExplained {
    let mut out = describe(limit);
    if let Some(i) = view.exemption(&limit.exempt) {
        out.exempt = Some(Exempted {
            index: i,
            entry: masked(&limit.exempt[i]),
        });
        out.outcome = Outcome::Exempt;
        return out;
    }
    let alternative = view.alternative(&limit.key);
    let source = alternative.map_or_else(|| "anonymous".to_owned(), |i| out.key[i].clone());
    let client = view.resolve(&limit.key);
    judged(limit, (client, alternative, source), at, tuned, out).await
}

/// `limit` explained for a rate limit service descriptor whose entries (`source`, as given)
/// digest to `client`.
pub(super) async fn for_descriptor(
    limit: &Limit,
    (client, source): (ClientId, String),
    at: &At<'_>,
    tuned: Option<(&Tuning, serde_json::Value)>,
) -> LimitExplained {
    let mut out = describe(limit);
    // Its identity is the descriptor's entries, not a key of the request's.
    out.key = vec!["descriptor".into()];
    judged(limit, (client, None, source), at, tuned, out).await
}

/// `explain`, once the identity is known: `client`, from the key's `alternative` named
/// `source` (a rate limit service's descriptor has no key: its entries are the identity).
pub(super) async fn judged(
    limit: &Limit,
    (mut client, alternative, source): (ClientId, Option<usize>, String),
    at: &At<'_>,
    tuned: Option<(&Tuning, serde_json::Value)>,
    mut out: LimitExplained,
) -> LimitExplained {
    // A quota override counts in a bucket of its own, as the request path does.
    if let Some(salt) = tuned.as_ref().and_then(|(t, _)| t.fresh) {
        client = ClientId(client.0 ^ salt);
    }
    let mut hex = client.hex();
    hex.truncate(CLIENT_HEX);
    out.identity = Some(Identity {
        alternative,
        source,
        client: hex,
    });
    let Some((mut peeked, store)) = read(limit, client, at, &mut out).await else {
        return out;
    };
    let fallback = store == LOCAL_FALLBACK;
    let mut numbers = Numbers::of(limit, fallback);
    // The `local` failure policy keeps the limit's own numbers, not the override's.
    if let (Some((t, view)), false) = (tuned, fallback) {
        numbers.rate = &t.rate;
        if let (Some(w), Some(count)) = (&mut peeked.window, t.quota) {
            w.count = count;
        }
        out.overridden = Some(view);
    }
    judge(limit, &numbers, &peeked, store, &mut out);
    out
}

/// The store `explain` names when Redis did not answer and the `local` policy counts instead.
const LOCAL_FALLBACK: &str = "local fallback";

/// `client`'s state under `limit`, and the store it came from; `None` when Redis did not
/// answer and the failure policy decides without any (the outcome is then set in `out`).
async fn read(
    limit: &Limit,
    client: ClientId,
    at: &At<'_>,
    out: &mut LimitExplained,
) -> Option<(Peeked, &'static str)> {
    let Some(r) = at.redis else {
        let p = peek::in_process(limit, client, at.peer, at.now_us, false);
        return Some((p, "local"));
    };
    let e = match r.peek(limit, client).await {
        Ok(p) => return Some((p, "redis")),
        Err(e) => e,
    };
    out.error = Some(format!("Redis did not answer: {e}"));
    match (limit.on_failure, limit.shadow) {
        (FailurePolicy::Local, _) => {
            let p = peek::in_process(limit, client, at.peer, at.now_us, true);
            Some((p, LOCAL_FALLBACK))
        }
        (FailurePolicy::Closed, false) => {
            out.outcome = Outcome::FailedClosed;
            None
        }
        (FailurePolicy::Open | FailurePolicy::Closed, _) => {
            out.outcome = Outcome::FailedOpen;
            None
        }
    }
}

/// The numbers a limit's state is judged by for one request.
struct Numbers<'a> {
    rate: &'a Rate,
    /// A concurrency limit's slots.
    slots: Option<u32>,
}

impl<'a> Numbers<'a> {
    /// `limit`'s own numbers, or with `fallback` those the `local` failure policy enforces.
    fn of(limit: &'a Limit, fallback: bool) -> Self {
        Self {
            rate: if fallback {
                &limit.fallback
            } else {
                &limit.rate
            },
            slots: limit
                .concurrency
                .map(|c| if fallback { c.fallback } else { c.max }),
        }
    }
}

/// Fill in `out`'s state and outcome from what was read: a ban in force refuses; else the
/// slots or the bucket decide.
fn judge(limit: &Limit, n: &Numbers<'_>, p: &Peeked, store: &str, out: &mut LimitExplained) {
    if let Some(b) = p.ban {
        out.ban_state = Some(BanState {
            banned_s: secs(b.banned_us),
            strikes: b.strikes,
            level: b.level,
        });
        if b.banned_us > 0.0 {
            out.outcome = Outcome::Banned;
            out.retry_after_s = secs(b.banned_us);
            return;
        }
    }
    let refused = if limit.shadow {
        Outcome::ShadowLimited
    } else {
        Outcome::Limited
    };
    if let Some(max) = n.slots {
        out.now = Some(Now {
            store: store.to_owned(),
            counted_in: "own".to_owned(),
            remaining: u64::from(max.saturating_sub(p.in_flight)),
            limit: u64::from(max),
            reset_s: None,
            in_flight: Some(p.in_flight),
            owed: None,
        });
        let full = p.in_flight >= max;
        out.outcome = if full { refused } else { Outcome::Admitted };
        // A refused request is told to come back in a second (`concurrency`).
        out.retry_after_s = if full { 1.0 } else { 0.0 };
        return;
    }
    let (now, request) = p.bucket(n.rate, limit.cost);
    out.now = Some(Now {
        store: store.to_owned(),
        counted_in: p.counted.as_str().to_owned(),
        remaining: now.remaining,
        limit: u64::from(p.window.map_or(n.rate.burst, |w| w.count)),
        reset_s: Some(secs(now.reset_us.max(0.0))),
        in_flight: None,
        owed: Some(p.owed(n.rate)).filter(|&o| o > 0),
    });
    out.outcome = if request.admitted {
        Outcome::Admitted
    } else {
        refused
    };
    out.retry_after_s = secs(request.retry_after_us);
}

/// The limit's settings, with no request read yet (its outcome: admitted).
fn describe(limit: &Limit) -> LimitExplained {
    let kind = match (&limit.quota, &limit.concurrency) {
        (Some(q), _) if q.is_window() => Kind::Window {
            count: q.count,
            window: q.period.describe(),
            algorithm: q.counting.as_str().to_owned(),
        },
        (Some(q), _) => Kind::Quota {
            count: q.count,
            period: q.period.describe(),
            timezone: q.tz.iana_name().unwrap_or("UTC").to_owned(),
        },
        (None, Some(c)) => Kind::Concurrency {
            max: c.max,
            lease_s: c.lease.as_secs_f64(),
        },
        (None, None) => Kind::TokenBucket {
            rate: crate::config::settings::Rate::describe(limit.rate.per_sec),
            per_sec: limit.rate.per_sec,
            burst: limit.rate.burst,
        },
    };
    let secs = |us: u64| us as f64 / 1e6;
    LimitExplained {
        name: limit.name.to_string(),
        kind,
        cost: limit.cost,
        shadow: limit.shadow,
        on_failure: format!("{:?}", limit.on_failure).to_lowercase(),
        ban: limit.ban.map(|b| BanRule {
            after: b.after,
            within_s: secs(b.within_us),
            for_s: secs(b.first_us),
            max_s: secs(b.max_us),
        }),
        leasing: limit.leases.as_ref().map(|l| {
            let spec = l.spec();
            LeaseRule {
                tokens: spec.tokens,
                auto: spec.auto,
                hold_s: spec.hold.as_secs_f64(),
                bound: format!(
                    "R replicas admit at most {} + {}/s x t + R x {} in any interval t",
                    limit.rate.burst, limit.rate.per_sec, spec.tokens
                ),
            }
        }),
        key: limit.key.0.iter().map(ToString::to_string).collect(),
        exempt: None,
        identity: None,
        now: None,
        ban_state: None,
        error: None,
        outcome: Outcome::Admitted,
        retry_after_s: 0.0,
        overridden: None,
    }
}

/// Microseconds as seconds, rounded up to the millisecond (as the bucket script rounds: a
/// wait is never shown shorter than it is, nor a refusal's as none).
fn secs(us: f64) -> f64 {
    (us / 1e3).ceil() / 1e3
}

/// An exemption as shown: a network as written, a `SOURCE=VALUE` without its value (often an
/// internal API key, masked as `/config` masks it).
fn masked(e: &Exemption) -> String {
    match e {
        Exemption::Net(net) => net.to_string(),
        Exemption::Equals(source, _) => format!("{source}=***"),
    }
}
