//! The route's decision from its limits' outcomes, as the request path would reach it.

use serde::{Deserialize, Serialize};

use super::{Kind, LimitExplained, Outcome};
use crate::error::ProxyError;

/// The decision the proxy would make now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Decision {
    pub outcome: Verdict,
    /// The limit that decides a `limited` outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// Seconds until a `limited` request would be admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<f64>,
    /// The HTTP status the client would get when the proxy answers itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// For a gRPC call, the gRPC status of that answer (sent with HTTP 200, trailers-only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_status: Option<u8>,
    /// Why, in a sentence.
    pub reason: String,
}

/// A decision's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every enforced limit admits (or the route has none): forwarded or answered.
    Admitted,
    /// A limit rejects (a bucket, a ban, a concurrency cap): 429, or 503 failing closed.
    Limited,
    /// Every limit of the route exempts the client: nothing is counted.
    Exempt,
    /// No route matches: 404.
    NoRoute,
    /// Screening refuses the request before routing.
    Refused,
    /// An operator's ban (`/api/v1/bans`) refuses the client: 403, before any limit.
    OperatorBan,
}

impl Decision {
    /// No route matches: `404`.
    pub(super) fn no_route() -> Self {
        Self {
            outcome: Verdict::NoRoute,
            limit: None,
            retry_after_s: None,
            status: Some(404),
            grpc_status: None,
            reason: "no route matches the request".into(),
        }
    }

    /// Screening refuses the request with `e`.
    pub(super) fn refused(e: &ProxyError) -> Self {
        Self {
            outcome: Verdict::Refused,
            limit: None,
            retry_after_s: None,
            status: Some(e.status().as_u16()),
            grpc_status: None,
            reason: format!("refused before routing: {e}"),
        }
    }

    /// An operator's ban refuses the request before any limit: `403`.
    pub(super) fn operator_ban(ban: &crate::control::BanView) -> Self {
        Self {
            outcome: Verdict::OperatorBan,
            limit: None,
            retry_after_s: Some(ban.times.ttl_left_s as f64),
            status: Some(403),
            grpc_status: None,
            reason: format!("refused by an operator's ban {} ({})", ban.id, ban.reason),
        }
    }

    /// Not limited: `outcome` (admitted or exempt), for `reason`.
    /// A rate limit service call one descriptor's rule refuses outright (`requests_per_unit:
    /// 0`): nothing is taken from the others.
    pub(super) fn refuses_every_call(entries: &str) -> Self {
        Self {
            outcome: Verdict::Limited,
            limit: None,
            retry_after_s: None,
            status: Some(429),
            grpc_status: None,
            reason: format!(
                "the rule of descriptor `{entries}` refuses every call (requests_per_unit: 0)"
            ),
        }
    }

    fn passed(outcome: Verdict, reason: &str) -> Self {
        Self {
            outcome,
            limit: None,
            retry_after_s: None,
            status: None,
            grpc_status: None,
            reason: reason.to_owned(),
        }
    }
}

/// The route's decision from its limits' outcomes, in the order the request path takes them:
/// concurrency slots first (a request they refuse is checked no further), then a ban in force
/// (refused before any bucket), then the buckets, all or nothing (a rejection by one takes
/// nothing from the others).
pub(super) fn decide(limits: &[LimitExplained]) -> Decision {
    let refusing = |l: &&LimitExplained| {
        matches!(
            l.outcome,
            Outcome::Limited | Outcome::Banned | Outcome::FailedClosed
        )
    };
    let concurrency = limits
        .iter()
        .filter(|l| matches!(l.kind, Kind::Concurrency { .. }))
        .find(refusing);
    let banned = limits.iter().find(|l| l.outcome == Outcome::Banned);
    let first = concurrency
        .or(banned)
        .or_else(|| limits.iter().find(refusing));
    if let Some(l) = first {
        let (status, why) = match l.outcome {
            Outcome::Banned => (429, "the identity is banned"),
            Outcome::FailedClosed => (503, "Redis did not answer and the limit fails closed"),
            _ if matches!(l.kind, Kind::Concurrency { .. }) => (429, "every slot is taken"),
            _ => (429, "not enough tokens"),
        };
        let others = if limits.len() > 1 {
            "; nothing would be taken from the other limits"
        } else {
            ""
        };
        return Decision {
            outcome: Verdict::Limited,
            limit: Some(l.name.clone()),
            retry_after_s: Some(l.retry_after_s),
            status: Some(status),
            grpc_status: None,
            reason: format!("{why}{others}"),
        };
    }
    if !limits.is_empty() && limits.iter().all(|l| l.outcome == Outcome::Exempt) {
        let why = "every limit of the route exempts the client: nothing is counted";
        return Decision::passed(Verdict::Exempt, why);
    }
    let why = if limits.is_empty() {
        "the route has no limits"
    } else {
        "every enforced limit admits the request"
    };
    Decision::passed(Verdict::Admitted, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(name: &str, kind: Kind, outcome: Outcome) -> LimitExplained {
        LimitExplained {
            name: name.into(),
            kind,
            cost: 1,
            shadow: false,
            on_failure: "open".into(),
            ban: None,
            leasing: None,
            key: vec!["ip".into()],
            exempt: None,
            identity: None,
            now: None,
            ban_state: None,
            error: None,
            outcome,
            retry_after_s: if outcome == Outcome::Admitted {
                0.0
            } else {
                2.0
            },
            overridden: None,
        }
    }

    fn bucket() -> Kind {
        Kind::TokenBucket {
            rate: "1/s".into(),
            per_sec: 1.0,
            burst: 5,
        }
    }

    #[test]
    fn the_decision_takes_limits_in_the_request_paths_order() {
        let slots = Kind::Concurrency {
            max: 1,
            lease_s: 30.0,
        };
        // A bucket first in the route, slots second: the slots decide (they are taken first).
        let d = decide(&[
            limit("a", bucket(), Outcome::Limited),
            limit("b", slots, Outcome::Limited),
        ]);
        assert_eq!(
            (d.outcome, d.limit.as_deref()),
            (Verdict::Limited, Some("b"))
        );
        assert!(d.reason.contains("every slot is taken"), "{}", d.reason);
        // A ban refuses before any bucket.
        let d = decide(&[
            limit("a", bucket(), Outcome::Limited),
            limit("b", bucket(), Outcome::Banned),
        ]);
        assert_eq!(d.limit.as_deref(), Some("b"));
        // Shadow and failed-open limits admit; all exempt is exempt; none is admitted.
        let d = decide(&[
            limit("a", bucket(), Outcome::ShadowLimited),
            limit("b", bucket(), Outcome::FailedOpen),
        ]);
        assert_eq!(d.outcome, Verdict::Admitted);
        let d = decide(&[limit("a", bucket(), Outcome::Exempt)]);
        assert_eq!(d.outcome, Verdict::Exempt);
        assert_eq!(decide(&[]).reason, "the route has no limits");
        let d = decide(&[limit("a", bucket(), Outcome::FailedClosed)]);
        assert_eq!((d.outcome, d.status), (Verdict::Limited, Some(503)));
    }
}
