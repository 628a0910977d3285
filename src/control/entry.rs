//! One operator entry, a ban or an override: built from the API's JSON, kept as a record in
//! Redis, matched against requests, and shown with its secret redacted.
//!
//! An identity is in the `exempt` syntax. An address or network is kept as it is; the value of
//! `SOURCE=VALUE` (an API key, a cookie, a token's subject) only as its BLAKE3 digest
//! (`identity::value_digest`), and a request matches by the digest of its own value. So neither
//! Redis, nor the listings, nor the logs hold the secret: they show `header:x-api-key=blake3:`
//! and the digest's first 12 hex digits.

use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::config::settings::Period;
use crate::identity::{value_digest, Exemption, RequestView, Source};
use crate::limiter::{Limit, Rate, Tuning};

/// The longest `ttl` an entry may have: an operator's entry is for an incident, and the
/// config is where a lasting rule belongs.
pub const MAX_TTL: Duration = Duration::from_hours(30 * 24);

/// Who an entry applies to.
#[derive(Debug, Clone, PartialEq)]
pub enum Matcher {
    Net(IpNet),
    /// A source whose value has this digest.
    Value(Source, [u8; 32]),
}

/// A `Matcher` as Redis keeps it: `{"net": "10.0.0.0/8"}` or
/// `{"value": {"source": "header:x-api-key", "blake3": "<64 hex digits>"}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum MatchRecord {
    Net(String),
    Value { source: String, blake3: String },
}

impl Matcher {
    /// The matcher of `identity` (the `exempt` syntax), and the identity as it is shown.
    pub fn parse(identity: &str) -> Result<(Self, String), String> {
        match Exemption::parse(identity.trim())? {
            Exemption::Net(net) => Ok((Matcher::Net(net), net.to_string())),
            Exemption::Equals(source, value) => {
                if value.is_empty() {
                    return Err(format!(
                        "`{identity}` has an empty value, which no request carries"
                    ));
                }
                let digest = value_digest(value.as_bytes());
                let shown = shown(&source, &value, &digest);
                Ok((Matcher::Value(source, digest), shown))
            }
        }
    }

    pub fn matches(&self, view: &RequestView<'_>) -> bool {
        match self {
            Matcher::Net(net) => net.contains(&view.client_ip),
            Matcher::Value(source, digest) => view.has_value_digest(source, digest),
        }
    }

    fn record(&self) -> MatchRecord {
        match self {
            Matcher::Net(net) => MatchRecord::Net(net.to_string()),
            Matcher::Value(source, digest) => MatchRecord::Value {
                source: source.to_string(),
                blake3: blake3::Hash::from_bytes(*digest).to_hex().to_string(),
            },
        }
    }

    fn of_record(r: &MatchRecord) -> Result<Self, String> {
        match r {
            MatchRecord::Net(net) => net
                .parse()
                .map(Matcher::Net)
                .map_err(|_| format!("`{net}` is not a network")),
            MatchRecord::Value { source, blake3 } => {
                let digest = blake3::Hash::from_hex(blake3).map_err(|e| e.to_string())?;
                Ok(Matcher::Value(Source::parse(source)?, *digest.as_bytes()))
            }
        }
    }
}

/// How an identity is shown: the sources that carry secrets by their digest's first 12 hex
/// digits; a host, method or path as it is.
fn shown(source: &Source, value: &str, digest: &[u8; 32]) -> String {
    match source {
        Source::Host | Source::Method | Source::Path | Source::Global => {
            format!("{source}={value}")
        }
        _ => {
            let hex = blake3::Hash::from_bytes(*digest).to_hex();
            format!("{source}=blake3:{}", &hex[..12])
        }
    }
}

/// When an entry was made and until when it holds: milliseconds since the UNIX epoch, on the
/// wall clock of the replica that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub created_ms: i64,
    pub expires_ms: i64,
}

impl Span {
    /// From `now_ms`, for `ttl` (the config's duration syntax: `90s`, `1h`, `7d`), at most
    /// `MAX_TTL`.
    pub fn of(ttl: &str, now_ms: i64) -> Result<Self, String> {
        let ttl = crate::config::values::duration(ttl)?;
        if ttl.is_zero() {
            return Err("`ttl` must be longer than zero".into());
        }
        if ttl > MAX_TTL {
            return Err("`ttl` is at most 30d: a lasting rule belongs in the config".into());
        }
        Ok(Self {
            created_ms: now_ms,
            expires_ms: now_ms.saturating_add(ttl.as_millis() as i64),
        })
    }

    /// Whole seconds left at `now_ms`, rounded up (0 once expired).
    pub fn left_s(self, now_ms: i64) -> u64 {
        let left = self.expires_ms.saturating_sub(now_ms).max(0) as u64;
        left.div_ceil(1000)
    }

    pub fn expired(self, now_ms: i64) -> bool {
        self.expires_ms <= now_ms
    }

    /// The times as listings show them.
    fn times(self, now_ms: i64) -> Times {
        Times {
            created: rfc3339(self.created_ms),
            created_unix: self.created_ms.div_euclid(1000),
            expires: rfc3339(self.expires_ms),
            expires_unix: self.expires_ms.div_euclid(1000),
            ttl_left_s: self.left_s(now_ms),
        }
    }
}

/// An entry's times in a listing: RFC 3339 in UTC to the second, and UNIX seconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Times {
    pub created: String,
    pub created_unix: i64,
    pub expires: String,
    pub expires_unix: i64,
    pub ttl_left_s: u64,
}

fn rfc3339(ms: i64) -> String {
    jiff::Timestamp::from_second(ms.div_euclid(1000))
        .unwrap_or(jiff::Timestamp::UNIX_EPOCH)
        .to_string()
}

/// The wall clock, in milliseconds since the UNIX epoch.
pub fn now_ms() -> i64 {
    jiff::Timestamp::now().as_millisecond()
}

/// A fresh entry ID: 16 hex digits, random (IDs are made by any replica, unsynchronised).
fn new_id() -> String {
    format!("{:016x}", fastrand::u64(..))
}

/// A reason is one line of text: it goes into log lines.
fn reason(r: &str) -> Result<String, String> {
    if r.chars().count() > 500 {
        return Err("`reason` is at most 500 characters".into());
    }
    if r.chars().any(char::is_control) {
        return Err("`reason` is one line, without control characters".into());
    }
    Ok(r.to_owned())
}

// === Bans ===

/// `POST /api/v1/bans`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewBan {
    pub identity: String,
    pub ttl: String,
    #[serde(default)]
    pub reason: String,
    /// Route names; none: every route.
    #[serde(default)]
    pub routes: Vec<String>,
}

/// A ban: requests of the identity on its routes (or all) are refused.
#[derive(Debug, Clone, PartialEq)]
pub struct Ban {
    pub id: String,
    pub matcher: Matcher,
    /// The identity as shown (redacted).
    pub identity: String,
    pub reason: String,
    pub routes: Vec<String>,
    pub span: Span,
}

/// A ban as Redis keeps it (one JSON value per ID).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct BanRecord {
    id: String,
    identity: String,
    #[serde(rename = "match")]
    matcher: MatchRecord,
    reason: String,
    routes: Vec<String>,
    #[serde(flatten)]
    span: Span,
}

/// A ban as listings show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BanView {
    pub id: String,
    pub identity: String,
    pub reason: String,
    pub routes: Vec<String>,
    #[serde(flatten)]
    pub times: Times,
}

impl Ban {
    /// The ban `req` asks for, at `now_ms`; `routes` are the live config's route names.
    pub fn new(req: NewBan, now_ms: i64, routes: &[&str]) -> Result<Self, String> {
        let (matcher, identity) = Matcher::parse(&req.identity)?;
        let span = Span::of(&req.ttl, now_ms)?;
        if let Some(unknown) = req.routes.iter().find(|r| !routes.contains(&r.as_str())) {
            return Err(format!(
                "no route is named `{unknown}`; the routes are: {}",
                routes.join(", ")
            ));
        }
        Ok(Self {
            id: new_id(),
            matcher,
            identity,
            reason: reason(&req.reason)?,
            routes: req.routes,
            span,
        })
    }

    /// Whether the ban holds `view`'s requests on `route` (expiry aside).
    pub fn holds(&self, view: &RequestView<'_>, route: &str) -> bool {
        (self.routes.is_empty() || self.routes.iter().any(|r| r == route))
            && self.matcher.matches(view)
    }

    pub fn view(&self, now_ms: i64) -> BanView {
        BanView {
            id: self.id.clone(),
            identity: self.identity.clone(),
            reason: self.reason.clone(),
            routes: self.routes.clone(),
            times: self.span.times(now_ms),
        }
    }

    pub fn to_record(&self) -> String {
        let r = BanRecord {
            id: self.id.clone(),
            identity: self.identity.clone(),
            matcher: self.matcher.record(),
            reason: self.reason.clone(),
            routes: self.routes.clone(),
            span: self.span,
        };
        serde_json::to_string(&r).unwrap_or_default()
    }

    pub fn of_record(json: &str) -> Result<Self, String> {
        let r: BanRecord = serde_json::from_str(json).map_err(|e| e.to_string())?;
        Ok(Self {
            matcher: Matcher::of_record(&r.matcher)?,
            id: r.id,
            identity: r.identity,
            reason: r.reason,
            routes: r.routes,
            span: r.span,
        })
    }
}

// === Overrides ===

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
fn numbers(
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
fn fresh(mut tuning: Tuning, id: &str) -> Tuning {
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
        (Some(q), Some(p)) if q.period == p => Ok(()),
        (Some(q), Some(_)) => Err(format!(
            "limit `{name}` counts per {}: give the quota per {0} too",
            period_name(q.period)
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

fn period_name(p: Period) -> &'static str {
    match p {
        Period::Hour => "hour",
        Period::Day => "day",
        Period::Week => "week",
        Period::Month => "month",
    }
}

#[cfg(test)]
mod tests;
