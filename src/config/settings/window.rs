//! The settings of calendar quotas and window limits: the count, the period, how it counts.

/// A calendar quota (`count` per calendar `period` in `tz`) or a window limit (`count` per
/// `Period::Every`, counted as `counting` says).
#[derive(Debug, Clone, PartialEq)]
pub struct QuotaSpec {
    pub count: u32,
    pub period: Period,
    /// The IANA zone whose calendar the windows follow.
    pub tz: jiff::tz::TimeZone,
    /// The stricter per-replica count the `local` failure policy enforces without Redis.
    pub fallback_count: u32,
    pub counting: Counting,
}

impl QuotaSpec {
    /// A window limit (`window: N/DURATION`), not a calendar quota.
    pub fn is_window(&self) -> bool {
        matches!(self.period, Period::Every(_))
    }
}

/// How a window limit counts (`algorithm:`); a calendar quota counts as `Fixed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counting {
    /// A counter per aligned window: at most N per window, up to 2N across a boundary.
    Fixed,
    /// The sliding window counter: this window's count plus the last one's, weighted by how
    /// much of it the sliding window still covers.
    Sliding,
    /// The sliding window log: the time of each request of the last window, exactly N.
    Exact,
}

impl Counting {
    /// The word of the YAML's `algorithm:`.
    pub fn as_str(self) -> &'static str {
        match self {
            Counting::Fixed => "fixed",
            Counting::Sliding => "sliding",
            Counting::Exact => "exact",
        }
    }
}

/// The largest N of an `exact` window: its log holds up to N times per identity.
pub const EXACT_MAX: u32 = 1000;

/// The calendar period of a quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Period {
    Hour,
    Day,
    /// Monday to Monday.
    Week,
    /// A calendar month.
    Month,
    /// `window: N/DURATION`: windows of this many seconds, aligned to the UNIX epoch.
    Every(u32),
}

impl Period {
    /// The period's nominal length in seconds: the `w` of `RateLimit-Policy` (a month is 30
    /// days there; the window itself is the calendar month).
    pub fn nominal_secs(self) -> u32 {
        match self {
            Period::Hour => 3600,
            Period::Day => 86_400,
            Period::Week => 604_800,
            Period::Month => 2_592_000,
            Period::Every(secs) => secs,
        }
    }

    /// How the period is written: `hour` ... `month`, or a fixed window's duration (`15m`).
    pub fn describe(self) -> String {
        match self {
            Period::Hour => "hour".into(),
            Period::Day => "day".into(),
            Period::Week => "week".into(),
            Period::Month => "month".into(),
            Period::Every(secs) => {
                let units = [(86_400, "d"), (3600, "h"), (60, "m"), (1, "s")];
                let (n, unit) = units
                    .into_iter()
                    .find(|(u, _)| secs % u == 0)
                    .map_or((secs, "s"), |(u, name)| (secs / u, name));
                format!("{n}{unit}")
            }
        }
    }
}
