//! A route's `limits` entries as written: the limit, its ban and its leasing.

use schemars::JsonSchema;
use serde::Deserialize;

use crate::config::values::{DURATION, QUOTA, RATE};

/// A token bucket (`rate`), a calendar quota (`quota`), a window (`window`) or a cap on
/// requests in flight (`concurrency`): exactly one of the four.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("oneOf" = [{ "required": ["rate"] }, { "required": ["quota"] }, { "required": ["window"] }, { "required": ["concurrency"] }]))]
pub struct Limit {
    #[schemars(length(min = 1))]
    pub name: String,
    /// A token bucket: `N/s`, `N/min`, ... (a limit has one of `rate`, `quota`, `window` and
    /// `concurrency`).
    #[schemars(pattern(RATE))]
    pub rate: Option<String>,
    #[schemars(range(min = 1))]
    pub burst: Option<u32>,
    /// Calendar quota, as `1000/day` (`hour`, `day`, `week`, `month`): fixed windows aligned
    /// to the calendar of `timezone`.
    #[schemars(pattern(QUOTA))]
    pub quota: Option<String>,
    /// IANA time zone of a quota's calendar (default `UTC`).
    pub timezone: Option<String>,
    /// At most N requests per window of a duration, as `5/15m` (1s to 366d): windows aligned
    /// to the UNIX epoch.
    #[schemars(regex(pattern = r"^\s*0*[1-9][0-9]*\s*/\s*0*[1-9][0-9]*(ms|s|m|h|d)\s*$|\$\{"))]
    pub window: Option<String>,
    /// How a `window` counts: `sliding` (the default: this window's count and the last one's,
    /// weighted), `exact` (the time of every request, N up to 1000) or `fixed` (a counter per
    /// aligned window).
    #[schemars(extend("enum" = ["sliding", "exact", "fixed"]))]
    pub algorithm: Option<String>,
    /// At most this many requests of one identity in flight at once.
    #[schemars(range(min = 1))]
    pub concurrency: Option<u32>,
    /// How long a Redis slot lives unless renewed (concurrency limits; default 30s).
    #[schemars(pattern(DURATION))]
    pub lease: Option<String>,
    /// Refuse an identity outright once this limit has rejected it `after` times `within`.
    pub ban: Option<Ban>,
    /// Over Redis: a replica takes a busy identity's tokens several at a time and spends them
    /// without a call (`auto`, or `{ tokens, hold }`; `rate` limits only).
    pub leasing: Option<Leasing>,
    #[schemars(length(min = 1))]
    pub key: Vec<String>,
    /// Tokens a request takes: a number, or `{ reserve: R, from_response: HEADER }` (R taken
    /// at admission, settled to the response header's value).
    pub cost: Option<Cost>,
    #[serde(default)]
    pub shadow: bool,
    #[serde(default)]
    pub exempt: Vec<String>,
    #[schemars(extend("x-choices" = ["open", "closed", "local"]))]
    pub on_failure: Option<String>,
    /// Count a request only when its response's status is one of these (checked, not
    /// taken, at admission): failed logins, as `{ status: [401, 403] }`.
    pub count_when: Option<CountWhen>,
}

/// A limit's `cost`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Cost {
    #[schemars(extend("minimum" = 1))]
    Fixed(u32),
    Settled(SettledCost),
}

/// `cost: { reserve, from_response }`: a cost known once the response comes.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SettledCost {
    /// Tokens taken at admission.
    #[schemars(range(min = 1))]
    pub reserve: u32,
    /// The response header whose value (a whole number) is what the request cost.
    #[schemars(length(min = 1))]
    pub from_response: String,
}

/// `routes[].limits[].count_when`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CountWhen {
    /// Status codes (`401`) and classes (`"5xx"`).
    pub status: Vec<StatusItem>,
}

/// A status code, or a class of them.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum StatusItem {
    Code(u16),
    #[schemars(extend("pattern" = "^[1-5]xx$"))]
    Class(String),
}

/// `routes[].limits[].ban`: an escalating ban.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Ban {
    /// Rejections by the limit that ban the identity.
    pub after: u32,
    /// The window those rejections must fall in (from the first of them).
    #[schemars(pattern(DURATION))]
    pub within: String,
    /// The first ban's length; each ban while the previous one is remembered doubles it.
    #[schemars(pattern(DURATION))]
    #[serde(rename = "for")]
    pub first: String,
    /// The longest ban.
    #[schemars(pattern(DURATION))]
    pub max: String,
}

/// A limit's `leasing`: `auto`, or the size and hold of every lease.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum Leasing {
    #[schemars(extend("enum" = ["auto"]))]
    Word(String),
    Sized(LeaseSize),
}

/// `leasing: { tokens, hold }`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LeaseSize {
    /// Tokens one lease holds at most (default: leases sized as `auto`'s, with this `hold`).
    #[schemars(range(min = 1))]
    pub tokens: Option<u32>,
    /// Unused tokens go back to Redis once no new lease has topped them up for this long
    /// (default 1s).
    #[schemars(pattern(DURATION))]
    pub hold: Option<String>,
}
