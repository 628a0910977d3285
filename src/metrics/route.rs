//! The metrics of one route, fetched from the families once per route and runtime so that the
//! request path builds no label and hashes nothing to count: requests by status code, their
//! duration, and each limit's decisions.

use std::sync::{Arc, OnceLock};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::family::Family;

use super::top::MostLimited;
use crate::limiter::{Decision, LimitResult, Outcome};
use crate::sharded;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: String,
    pub code: u16,
    pub class: StatusClass,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: String,
}

/// The status class label, `2xx`, `4xx`, ...: `code` with its last two digits masked.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub struct StatusClass(pub &'static str);

impl prometheus_client::encoding::EncodeLabelValue for StatusClass {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }
}

const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

impl StatusClass {
    pub fn of(status: http::StatusCode) -> Self {
        Self(CLASSES[(usize::from(status.as_u16() / 100)).clamp(1, 5) - 1])
    }
}

impl RequestLabels {
    pub fn of(route: &str, status: http::StatusCode) -> Self {
        Self {
            route: route.to_owned(),
            code: status.as_u16(),
            class: StatusClass::of(status),
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub route: String,
    pub limit: String,
    pub outcome: OutcomeLabel,
}

#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum OutcomeLabel {
    admitted,
    /// This limit rejected the request (the first one of the route that did).
    limited,
    shadow_limited,
    exempt,
    /// Decided without the shared store (open, closed or local fallback).
    without_backend,
    /// Another limit of the route rejected the request: this one took no token, whatever its
    /// own verdict.
    rejected_by_other,
}

pub(super) const OUTCOMES: [OutcomeLabel; 6] = [
    OutcomeLabel::admitted,
    OutcomeLabel::limited,
    OutcomeLabel::shadow_limited,
    OutcomeLabel::exempt,
    OutcomeLabel::without_backend,
    OutcomeLabel::rejected_by_other,
];

impl OutcomeLabel {
    /// What `r` counts in a decision that `rejected` (a limit's index) rejected, if any.
    pub fn of(r: &LimitResult, rejected: Option<usize>) -> Self {
        if r.fallback {
            return Self::without_backend;
        }
        match r.outcome {
            Outcome::Exempt => Self::exempt,
            // A dry run reports its own verdict, whatever the enforced limits decided.
            Outcome::ShadowLimited => Self::shadow_limited,
            Outcome::Admitted if r.shadow => Self::admitted,
            _ if rejected.is_some_and(|i| i != r.index) => Self::rejected_by_other,
            Outcome::Admitted => Self::admitted,
            Outcome::Limited => Self::limited,
            Outcome::FailedOpen | Outcome::FailedClosed => Self::without_backend,
        }
    }
}

/// Status codes 100 to 599 have a slot each; others (600 to 999, which HTTP allows) go
/// through the family.
const FIRST_CODE: u16 = 100;
const CODES: usize = 500;

/// One route's metric handles.
#[derive(Debug)]
pub struct RouteCounters {
    route: String,
    /// By status code from 100, each made on its first request (an exact code is an open
    /// set: a series per code every route could answer would be mostly zeros).
    codes: Box<[OnceLock<sharded::Counter>]>,
    family: Family<RequestLabels, sharded::Counter>,
    /// Time to the response head.
    pub duration: sharded::Histogram,
    /// By limit (route order), then by outcome (`OutcomeLabel` order).
    pub decisions: Vec<[sharded::Counter; 6]>,
    /// By limit (route order): the identities it rejected most (written on 429s only).
    pub most_limited: Vec<Arc<MostLimited>>,
}

impl RouteCounters {
    pub(super) fn new(
        route: &str,
        family: &Family<RequestLabels, sharded::Counter>,
        duration: sharded::Histogram,
        decisions: Vec<[sharded::Counter; 6]>,
    ) -> Self {
        let counters = Self {
            route: route.to_owned(),
            codes: (0..CODES).map(|_| OnceLock::new()).collect(),
            family: family.clone(),
            duration,
            decisions,
            most_limited: Vec::new(),
        };
        // The answers tollgate makes itself exist from the start, at 0, so that `rate()` and
        // alerts see their first one: 429 where a limit can reject, 502, 503 and 504.
        let limited = (!counters.decisions.is_empty()).then_some(429);
        for code in limited.into_iter().chain([502, 503, 504]) {
            if let Ok(status) = http::StatusCode::from_u16(code) {
                let _ = counters.slot(status);
            }
        }
        counters
    }

    fn slot(&self, status: http::StatusCode) -> Option<&sharded::Counter> {
        let i = usize::from(status.as_u16().checked_sub(FIRST_CODE)?);
        let cell = self.codes.get(i)?;
        Some(cell.get_or_init(|| {
            self.family
                .get_or_create(&RequestLabels::of(&self.route, status))
                .clone()
        }))
    }

    /// Count a request answered `status`.
    pub fn request(&self, status: http::StatusCode) {
        match self.slot(status) {
            Some(c) => c.inc(),
            None => self
                .family
                .get_or_create(&RequestLabels::of(&self.route, status))
                .inc(),
        }
    }

    /// Count each limit's part in `decision`: only the limit that rejected the request counts
    /// `limited`; the other enforced limits of a rejected request count `rejected_by_other`.
    pub fn decided(&self, decision: &Decision) {
        let rejected = decision.rejected_by();
        if let Some(r) = rejected.filter(|r| r.outcome == Outcome::Limited) {
            if let (Some(s), Some(client)) = (self.most_limited.get(r.index), r.client) {
                s.record(client);
            }
        }
        let rejected = rejected.map(|r| r.index);
        for r in &decision.results {
            let outcome = OutcomeLabel::of(r, rejected);
            if let Some(c) = self.decisions.get(r.index) {
                c[outcome as usize].inc();
            }
        }
    }
}

impl super::Metrics {
    /// Count one finished request, its duration and its limit decisions: through its route's
    /// cached handles (`route`: the counters, name and limits), so no label is built on the
    /// request path; requests that matched no route are rare (404s).
    pub fn count_request(
        &self,
        route: Option<(&RouteCounters, &str, &[Arc<crate::limiter::Limit>])>,
        status: http::StatusCode,
        took: std::time::Duration,
        decision: Option<&Decision>,
    ) {
        let Some((counters, name, limits)) = route else {
            self.unrouted(status);
            return;
        };
        counters.request(status);
        counters.duration.observe(took.as_secs_f64());
        let Some(decision) = decision else {
            return;
        };
        if decision.without_backend() {
            self.without_backend.inc();
        }
        counters.decided(decision);
        for r in &decision.results {
            let family = match r.ban {
                crate::limiter::ban::BanEvent::None => continue,
                crate::limiter::ban::BanEvent::Refused => &self.banned_requests,
                crate::limiter::ban::BanEvent::Started(_) => &self.bans,
                crate::limiter::ban::BanEvent::Lifted => &self.ban_lifts,
            };
            let labels = super::RouteLimitLabels {
                route: name.to_owned(),
                limit: limits[r.index].name.to_string(),
            };
            family.get_or_create(&labels).inc();
        }
        for r in &decision.results {
            if r.outcome == Outcome::ShadowLimited {
                tracing::info!(
                    route = name,
                    limit = &*limits[r.index].name,
                    "shadow limit exceeded (dry run: not enforced)"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::OutcomeLabel;
    use crate::limiter::{LimitResult, Outcome};

    fn result(index: usize, outcome: Outcome, shadow: bool, fallback: bool) -> LimitResult {
        LimitResult {
            index,
            outcome,
            verdict: None,
            fallback,
            shadow,
            client: None,
            ban: crate::limiter::ban::BanEvent::None,
        }
    }

    #[test]
    fn only_the_rejecting_limit_counts_limited() {
        let of = |r: &LimitResult, rejected| OutcomeLabel::of(r, rejected);
        // Both over; limit 0 answered.
        assert_eq!(
            of(&result(0, Outcome::Limited, false, false), Some(0)),
            OutcomeLabel::limited
        );
        assert_eq!(
            of(&result(1, Outcome::Limited, false, false), Some(0)),
            OutcomeLabel::rejected_by_other
        );
        assert_eq!(
            of(&result(1, Outcome::Admitted, false, false), Some(0)),
            OutcomeLabel::rejected_by_other
        );
        // Dry runs and exemptions keep their own verdict; no rejection, no change.
        assert_eq!(
            of(&result(1, Outcome::ShadowLimited, true, false), Some(0)),
            OutcomeLabel::shadow_limited
        );
        assert_eq!(
            of(&result(1, Outcome::Admitted, true, false), Some(0)),
            OutcomeLabel::admitted
        );
        assert_eq!(
            of(&result(1, Outcome::Exempt, false, false), Some(0)),
            OutcomeLabel::exempt
        );
        assert_eq!(
            of(&result(0, Outcome::Admitted, false, false), None),
            OutcomeLabel::admitted
        );
        // Without Redis every checked limit says so, the local fallback's rejection included.
        assert_eq!(
            of(&result(0, Outcome::Limited, false, true), Some(0)),
            OutcomeLabel::without_backend
        );
        assert_eq!(
            of(&result(1, Outcome::FailedOpen, false, true), Some(0)),
            OutcomeLabel::without_backend
        );
    }
}
