//! Parsers for the scalar values of the config (durations, rates) and their schema patterns.

use std::time::Duration;

// The syntax of each value as a JSON Schema pattern (`schema`), beside the parser it mirrors.

/// A duration (`250ms`, `1.5s`, `1m30s`; units ms, s, m, h, d), or a string with `${VAR}`.
pub const DURATION: &str = r"^(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:ms|s|m|h|d))+$|\$\{";
/// A duration longer than zero: at least one part has a non-zero digit.
pub const POSITIVE_DURATION: &str =
    r"^(?:[0-9.]+(?:ms|s|m|h|d))*[0-9.]*[1-9][0-9.]*(?:ms|s|m|h|d)(?:[0-9.]+(?:ms|s|m|h|d))*$|\$\{";
/// A byte size (`512`, `64KiB`, `10MiB`, `1GB`), or a string with `${VAR}`.
pub const SIZE: &str = r"^[0-9]+ *(?:B|KiB|MiB|GiB|KB|kB|MB|GB)?$|\$\{";
/// A rate (`10/s`, `5/min`, `100/h`, `1000/day`, `100/10s`; N may be fractional), or a
/// string with `${VAR}`.
/// The count must not be zero (`0/s`, `0.0/s` admit nothing).
pub const RATE: &str = r"^ *(?:[0-9]*[1-9][0-9]*\.?[0-9]*|[0-9]*\.[0-9]*[1-9][0-9]*) */ *(?:s|sec|second|m|min|minute|h|hour|d|day|(?:[0-9.]+(?:ms|s|m|h|d))*[0-9.]*[1-9][0-9.]*(?:ms|s|m|h|d)(?:[0-9.]+(?:ms|s|m|h|d))*) *$|\$\{";
/// A calendar quota: `N/hour`, `N/day`, `N/week` or `N/month` (or a `${VAR}`).
pub const QUOTA: &str = r"^ *0*[1-9][0-9]* */ *(?:hour|day|week|month) *$|\$\{";

/// Parse `250ms`, `2s`, `1.5s`, `5m`, `1h`, `1d`, or several of them in a row, as in `1m30s`
/// or `1h30m` (Go's and systemd's compound form).
pub fn duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let mut rest = s;
    let mut seconds = 0.0;
    if rest.is_empty() {
        return Err(format!(
            "duration `{s}` needs a unit: ms, s, m, h or d (as in `2s`)"
        ));
    }
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("duration `{s}` needs a unit: ms, s, m, h or d (as in `2s`)"))?;
        let (number, tail) = rest.split_at(split);
        let n: f64 = number
            .parse()
            .map_err(|_| format!("duration `{s}` does not start with a number"))?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let factor = match unit {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "d" => 86400.0,
            _ => {
                return Err(format!(
                    "duration `{s}` has unknown unit `{unit}` (ms, s, m, h or d)"
                ))
            }
        };
        seconds += n * factor;
        rest = tail;
    }
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("duration `{s}` is out of range"))
}

/// Parse a size: `512`, `64KiB`, `10MiB`, `1GiB` (also `KB`/`MB`/`GB` as powers of 1000).
pub fn size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("size `{s}` does not start with a whole number"))?;
    let factor: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "size `{s}` has unknown unit `{other}` (B, KiB, MiB, GiB, KB, MB or GB; whole numbers only)"
            ))
        }
    };
    n.checked_mul(factor)
        .ok_or_else(|| format!("size `{s}` is too large"))
}

/// A parsed `rate`: `count` tokens per `per`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateValue {
    pub count: f64,
    pub per: Duration,
}

impl RateValue {
    pub fn per_sec(self) -> f64 {
        self.count / self.per.as_secs_f64()
    }
}

/// Parse `N/s`, `N/min`, `N/h`, `N/day` or `N/<duration>` such as `100/10s`; N may be
/// fractional.
pub fn rate(s: &str) -> Result<RateValue, String> {
    let (count, per) = s.trim().split_once('/').ok_or_else(|| {
        format!("rate `{s}` must look like `10/s`, `5/min`, `100/h`, `1000/day` or `100/10s`")
    })?;
    let count: f64 = count
        .trim()
        .parse()
        .ok()
        .filter(|n: &f64| n.is_finite() && *n > 0.0)
        .ok_or_else(|| format!("rate `{s}`: `{count}` is not a positive number"))?;
    let per = match per.trim() {
        "s" | "sec" | "second" => Duration::from_secs(1),
        "m" | "min" | "minute" => Duration::from_mins(1),
        "h" | "hour" => Duration::from_hours(1),
        "d" | "day" => Duration::from_hours(24),
        other if other.starts_with(|c: char| c.is_ascii_digit() || c == '.') => {
            duration(other).map_err(|e| format!("rate `{s}`: {e}"))?
        }
        other => {
            return Err(format!(
                "rate `{s}`: unknown unit `{other}` (s, min, h, day, or a duration such as 10s)"
            ))
        }
    };
    if per.is_zero() {
        return Err(format!("rate `{s}`: the period must be longer than zero"));
    }
    let value = RateValue { count, per };
    // Below about one token per 30000 years the arithmetic stops being meaningful (at the extreme
    // the time per token is infinite and nothing would be limited).
    if value.per_sec() < 1e-12 {
        return Err(format!(
            "rate `{s}` is below one per 30000 years: too small to count"
        ));
    }
    if value.per_sec() > 1e6 {
        return Err(format!(
            "rate `{s}` is above 1000000/s, the finest a bucket can count"
        ));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(duration("5m").unwrap(), Duration::from_mins(5));
        assert_eq!(duration("1h").unwrap(), Duration::from_hours(1));
        assert_eq!(duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(duration("5").unwrap_err().contains("needs a unit"));
        assert!(duration("5y").unwrap_err().contains("unknown unit"));
        assert_eq!(duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(duration("1h30m").unwrap(), Duration::from_mins(90));
        assert_eq!(duration("2d12h").unwrap(), Duration::from_hours(60));
        assert_eq!(duration("1s500ms").unwrap(), Duration::from_millis(1500));
        assert!(duration("1m30").unwrap_err().contains("needs a unit"));
        assert!(duration("1m 30s")
            .unwrap_err()
            .contains("unknown unit `m `"));
        assert!(duration("").unwrap_err().contains("needs a unit"));
    }

    #[test]
    fn sizes() {
        assert_eq!(size("512").unwrap(), 512);
        assert_eq!(size("64KiB").unwrap(), 65536);
        assert_eq!(size("10MiB").unwrap(), 10 << 20);
        assert_eq!(size("2MB").unwrap(), 2_000_000);
        assert!(size("ten").is_err());
        assert!(size("5XB").is_err());
    }

    #[test]
    fn rates() {
        assert!((rate("10/s").unwrap().per_sec() - 10.0).abs() < 1e-9);
        assert!((rate("5/min").unwrap().per_sec() - 5.0 / 60.0).abs() < 1e-12);
        assert!((rate("100/10s").unwrap().per_sec() - 10.0).abs() < 1e-9);
        assert!((rate("0.5/s").unwrap().per_sec() - 0.5).abs() < 1e-12);
        assert!((rate("24/day").unwrap().per_sec() - 24.0 / 86400.0).abs() < 1e-12);
        assert!((rate("100/10s").unwrap().count - 100.0).abs() < 1e-12);
        assert!(rate("10").is_err());
        assert!(rate("-1/s").is_err());
        assert!(rate("10/fortnight").is_err());
        assert!(rate("10/0s").is_err());
        assert!(rate("1e-320/s").is_err());
    }
}
