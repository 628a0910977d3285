//! The candidate config's series: what its limits would have decided on live traffic
//! (`tollgate_candidate_decisions_total`), and whether it loaded.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};

use super::route::{OutcomeLabel, OUTCOMES};
use super::{Metrics, ReloadLabels, ReloadResult};
use crate::limiter::Decision;
use crate::sharded;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CandidateLabels {
    /// The candidate's route (empty for `no_route`).
    pub route: String,
    /// The candidate's limit (empty for `no_route`).
    pub limit: String,
    pub outcome: CandidateOutcome,
}

/// The live decision's outcomes, and `no_route`: the request matched no candidate route.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum CandidateOutcome {
    admitted,
    limited,
    shadow_limited,
    exempt,
    without_backend,
    rejected_by_other,
    no_route,
}

impl From<OutcomeLabel> for CandidateOutcome {
    fn from(o: OutcomeLabel) -> Self {
        match o {
            OutcomeLabel::admitted => Self::admitted,
            OutcomeLabel::limited => Self::limited,
            OutcomeLabel::shadow_limited => Self::shadow_limited,
            OutcomeLabel::exempt => Self::exempt,
            OutcomeLabel::without_backend => Self::without_backend,
            OutcomeLabel::rejected_by_other => Self::rejected_by_other,
        }
    }
}

/// One candidate route's handles: by limit (route order), then by outcome (`OutcomeLabel`
/// order), fetched once per build so that counting builds no label.
#[derive(Debug)]
pub struct CandidateCounters(Vec<[sharded::Counter; 6]>);

impl CandidateCounters {
    /// Count each limit's part in `decision`, as the live `RouteCounters::decided` does.
    pub fn decided(&self, decision: &Decision) {
        let rejected = decision.rejected_by().map(|r| r.index);
        for r in &decision.results {
            if let Some(c) = self.0.get(r.index) {
                c[OutcomeLabel::of(r, rejected) as usize].inc();
            }
        }
    }
}

impl CandidateCounters {
    /// The counts so far of limit `index` (route order), by outcome.
    pub fn counts(&self, index: usize) -> impl Iterator<Item = (CandidateOutcome, u64)> + '_ {
        let counters = self.0.get(index).into_iter().flatten();
        OUTCOMES
            .iter()
            .zip(counters)
            .map(|(o, c)| ((*o).into(), c.get()))
    }
}

impl Metrics {
    pub(super) fn register_candidate(&mut self) {
        let r = self.registry.sub_registry_with_prefix("tollgate");
        r.register(
            "candidate_decisions",
            "What the candidate config's limits would have decided, by its route, limit and outcome (never enforced)",
            self.candidate_decisions.clone(),
        );
        r.register(
            "candidate_loads",
            "Loads of the candidate config (at start and on every reload), by result",
            self.candidate_loads.clone(),
        );
        r.register(
            "candidate_last_reload_successful",
            "1 if the last load of the candidate config succeeded, 0 if it failed or none is configured",
            self.candidate_ok.clone(),
        );
        for result in [ReloadResult::ok, ReloadResult::failed] {
            let _ = self.candidate_loads.get_or_create(&ReloadLabels { result });
        }
    }

    /// The handles of candidate route `route` with limits `limits` (their names, in order).
    pub fn candidate_counters<'a>(
        &self,
        route: &str,
        limits: impl Iterator<Item = &'a str>,
    ) -> CandidateCounters {
        let family = &self.candidate_decisions;
        CandidateCounters(
            limits
                .map(|limit| {
                    OUTCOMES.map(|outcome| {
                        let labels = CandidateLabels {
                            route: route.to_owned(),
                            limit: limit.to_owned(),
                            outcome: outcome.into(),
                        };
                        family.get_or_create(&labels).clone()
                    })
                })
                .collect(),
        )
    }

    /// The handle of requests that matched no candidate route.
    pub fn candidate_unrouted(&self) -> sharded::Counter {
        let labels = CandidateLabels {
            route: String::new(),
            limit: String::new(),
            outcome: CandidateOutcome::no_route,
        };
        self.candidate_decisions.get_or_create(&labels).clone()
    }

    /// Count a load of the candidate config; `ok`: it is the one evaluated now.
    pub fn candidate_loaded(&self, ok: bool) {
        let result = if ok {
            ReloadResult::ok
        } else {
            ReloadResult::failed
        };
        self.candidate_loads
            .get_or_create(&ReloadLabels { result })
            .inc();
        self.candidate_ok.set(i64::from(ok));
    }
}
