//! An operator's ban: as the API takes it, as Redis keeps it, as listings show it.

use serde::{Deserialize, Serialize};

use super::{new_id, reason, MatchRecord, Matcher, Span, Times};
use crate::identity::RequestView;

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
