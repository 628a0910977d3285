//! An operator's override of a limit's numbers: as the API takes it, checked against the
//! limit it tunes, kept in Redis and shown.

use serde::{Deserialize, Serialize};

use super::{new_id, reason, MatchRecord, Matcher, Span, Times};
use crate::config::settings::{Counting, Period, EXACT_MAX};
use crate::limiter::{Limit, Rate, Tuning};

/// `POST /api/v1/overrides`'s body: `rate` (and `burst`) for a token bucket, `quota` for a
/// calendar quota.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewOverride {
    pub limit: String,
    pub identity: String,
    pub rate: Option<String>,
    pub burst: Option<u32>,
    pub quota: Option<String>,
    pub ttl: String,
    #[serde(default)]
    pub reason: String,
}

/// An override: the limit counts the identity at other numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub id: String,
    pub limit: String,
    pub matcher: Matcher,
    pub identity: String,
    /// As given (`500/s`), with the burst it has (given, or as the config defaults it).
    pub rate: Option<String>,
    pub burst: Option<u32>,
    pub quota: Option<String>,
    pub tuning: Tuning,
    pub reason: String,
    pub span: Span,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct OverrideRecord {
    id: String,
    limit: String,
    identity: String,
    #[serde(rename = "match")]
    matcher: MatchRecord,
    rate: Option<String>,
    burst: Option<u32>,
    quota: Option<String>,
    reason: String,
    #[serde(flatten)]
    span: Span,
}

/// An override as listings show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OverrideView {
    pub id: String,
    pub limit: String,
    pub identity: String,
    pub rate: Option<String>,
    pub burst: Option<u32>,
    pub quota: Option<String>,
    pub reason: String,
    #[serde(flatten)]
    pub times: Times,
}

/// The numbers of an override: its rate and burst, or its quota (and the quota's period).
pub(super) fn numbers(
    rate: Option<&str>,
    burst: Option<u32>,
    quota: Option<&str>,
) -> Result<(Tuning, Option<u32>, Option<Period>), String> {
    match (rate, quota) {
        (Some(r), None) => {
            let value = crate::config::values::rate(r)?;
            let burst = match burst {
                Some(0) => return Err("`burst` must be at least 1".into()),
                Some(b) => b,
                None => value.count.ceil().clamp(1.0, f64::from(u32::MAX)) as u32,
            };
            let rate = Rate {
                per_sec: value.per_sec(),
                burst,
            };
            let tuning = Tuning {
                rate,
                quota: None,
                fresh: None,
                cost: None,
            };
            Ok((tuning, Some(burst), None))
        }
        (None, Some(q)) => {
            if burst.is_some() {
                return Err("`burst` is for token buckets: a quota's burst is its count".into());
            }
            let (count, period) = crate::config::compile::quota_value(q)?;
            let rate = Rate {
                per_sec: f64::from(count) / f64::from(period.nominal_secs()),
                burst: count,
            };
            let tuning = Tuning {
                rate,
                quota: Some(count),
                fresh: None,
                cost: None,
            };
            Ok((tuning, None, Some(period)))
        }
        (Some(_), Some(_)) => Err("give `rate` or `quota`, not both".into()),
        (None, None) => {
            Err("give `rate` (and `burst`) for a token-bucket limit, or `quota` for a quota".into())
        }
    }
}

/// A quota override's own bucket (see `Tuning`): the same on every replica, since it comes
/// from the override's ID.
pub(super) fn fresh(mut tuning: Tuning, id: &str) -> Tuning {
    if tuning.quota.is_some() {
        let digest = blake3::Hasher::new_derive_key("tollgate 2026 quota override bucket")
            .update(id.as_bytes())
            .finalize();
        let mut first = [0u8; 16];
        first.copy_from_slice(&digest.as_bytes()[..16]);
        tuning.fresh = Some(u128::from_be_bytes(first));
    }
    tuning
}

/// Whether `tuning` fits `limit`'s kind (a reload may have changed it since).
pub fn fits(tuning: &Tuning, limit: &Limit) -> bool {
    limit.concurrency.is_none() && tuning.quota.is_some() == limit.quota.is_some()
}

impl Override {
    /// The override `req` asks for, at `now_ms`; `limits` are the live config's limits.
    pub fn new(req: NewOverride, now_ms: i64, limits: &[&Limit]) -> Result<Self, String> {
        let Some(limit) = limits.iter().find(|l| *l.name == *req.limit) else {
            let mut names: Vec<&str> = Vec::new();
            for l in limits {
                if !names.contains(&&*l.name) {
                    names.push(&l.name);
                }
            }
            return Err(format!(
                "no limit is named `{}`; the limits are: {}",
                req.limit,
                names.join(", ")
            ));
        };
        let (matcher, identity) = Matcher::parse(&req.identity)?;
        let span = Span::of(&req.ttl, now_ms)?;
        let (tuning, burst, period) =
            numbers(req.rate.as_deref(), req.burst, req.quota.as_deref())?;
        check_kind(limit, &tuning, period)?;
        let id = new_id();
        Ok(Self {
            tuning: fresh(tuning, &id),
            id,
            limit: req.limit,
            matcher,
            identity,
            rate: req.rate.map(|r| r.trim().to_owned()),
            burst,
            quota: req.quota.map(|q| q.trim().to_owned()),
            reason: reason(&req.reason)?,
            span,
        })
    }

    pub fn view(&self, now_ms: i64) -> OverrideView {
        OverrideView {
            id: self.id.clone(),
            limit: self.limit.clone(),
            identity: self.identity.clone(),
            rate: self.rate.clone(),
            burst: self.burst,
            quota: self.quota.clone(),
            reason: self.reason.clone(),
            times: self.span.times(now_ms),
        }
    }

    pub fn to_record(&self) -> String {
        let r = OverrideRecord {
            id: self.id.clone(),
            limit: self.limit.clone(),
            identity: self.identity.clone(),
            matcher: self.matcher.record(),
            rate: self.rate.clone(),
            burst: self.burst,
            quota: self.quota.clone(),
            reason: self.reason.clone(),
            span: self.span,
        };
        serde_json::to_string(&r).unwrap_or_default()
    }

    pub fn of_record(json: &str) -> Result<Self, String> {
        let r: OverrideRecord = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let (tuning, burst, _) = numbers(r.rate.as_deref(), r.burst, r.quota.as_deref())?;
        let tuning = fresh(tuning, &r.id);
        Ok(Self {
            matcher: Matcher::of_record(&r.matcher)?,
            id: r.id,
            limit: r.limit,
            identity: r.identity,
            rate: r.rate,
            burst,
            quota: r.quota,
            tuning,
            reason: r.reason,
            span: r.span,
        })
    }
}

/// An override's numbers must be of its limit's kind, and a quota of the same period.
fn check_kind(limit: &Limit, tuning: &Tuning, period: Option<Period>) -> Result<(), String> {
    let name = &limit.name;
    if limit.concurrency.is_some() {
        return Err(format!(
            "limit `{name}` is a concurrency limit: overrides change rates and quotas only"
        ));
    }
    match (&limit.quota, period) {
        (None, None) => Ok(()),
        (Some(q), Some(_))
            if q.counting == Counting::Exact && tuning.quota.is_some_and(|n| n > EXACT_MAX) =>
        {
            let n = tuning.quota.unwrap_or_default();
            Err(format!(
                "limit `{name}` is an `exact` window, which keeps the time of every request in \
                 the window, at most {EXACT_MAX} per identity; {n} is more (as `tollgate check` \
                 refuses in the config)"
            ))
        }
        (Some(q), Some(p)) if q.period == p => Ok(()),
        (Some(q), Some(_)) => Err(format!(
            "limit `{name}` counts per {}: give the quota per {0} too",
            q.period.describe()
        )),
        (Some(_), None) => Err(format!(
            "limit `{name}` is a calendar quota: give `quota` (as `100000/day`), not `rate`"
        )),
        (None, Some(_)) => Err(format!(
            "limit `{name}` is a token bucket: give `rate` (and `burst`), not `quota`"
        )),
    }
    .and_then(|()| {
        if fits(tuning, limit) {
            Ok(())
        } else {
            Err(format!("limit `{name}` cannot take these numbers"))
        }
    })
}
