//! One access-log line read back: the fields replay needs, from the JSON the access log
//! writes (`access_log::format`), or why the line is not one.

use std::net::IpAddr;

use serde::Deserialize;

use crate::identity::logged::Logged;

/// The fields of a JSON access-log line that replay reads.
#[derive(Debug, Deserialize)]
struct Raw {
    timestamp: Option<String>,
    target: Option<String>,
    #[serde(rename = "http.request.method")]
    method: Option<String>,
    #[serde(rename = "server.address")]
    address: Option<String>,
    #[serde(rename = "server.port")]
    port: Option<u16>,
    #[serde(rename = "url.path")]
    path: Option<String>,
    #[serde(rename = "client.address")]
    client: Option<String>,
    #[serde(rename = "tollgate.route")]
    route: Option<String>,
    #[serde(rename = "tollgate.limit")]
    limit: Option<String>,
    #[serde(rename = "tollgate.outcome")]
    outcome: Option<String>,
    #[serde(rename = "http.response.status_code")]
    status: Option<u16>,
    #[serde(rename = "tollgate.keys")]
    keys: Option<std::collections::HashMap<String, Option<String>>>,
    duration_ms: Option<f64>,
}

/// A logged request, as replay sees it.
#[derive(Debug, Clone)]
pub struct Record {
    /// When the request arrived, µs since the Unix epoch: the line's timestamp (written when
    /// the response ended) less its duration. The limiter decided at this instant.
    pub arrival_us: i64,
    /// When the line was written (the response ended), µs since the Unix epoch.
    pub end_us: i64,
    pub method: http::Method,
    /// `Host` as the client sent it (port included), when the line has one.
    pub host: Option<String>,
    pub path: String,
    pub client: Option<IpAddr>,
    /// `tollgate.keys`: source name and digest (`None`: the request did not carry it);
    /// `None` when the line has no such field.
    keys: Option<Vec<(String, Option<u64>)>>,
    /// The route, limit and outcome of the live decision.
    pub route: Option<String>,
    pub limit: Option<String>,
    pub outcome: Option<String>,
    /// The response's status, which `count_when` limits count by.
    pub status: Option<u16>,
}

impl Record {
    /// What the line says of source `name` (as `tollgate.keys` names it).
    pub fn key(&self, name: &str) -> Logged {
        let found = self
            .keys
            .as_ref()
            .and_then(|keys| keys.iter().find(|(k, _)| k == name));
        match found {
            Some((_, Some(digest))) => Logged::Digest(*digest),
            Some((_, None)) => Logged::Absent,
            None => Logged::Unknown,
        }
    }

    /// The live proxy refused the request with a limit (`limited`, `limited-without-store`).
    pub fn live_rejected(&self) -> bool {
        self.outcome
            .as_deref()
            .is_some_and(|o| o.starts_with("limited"))
    }
}

/// Why a line was not replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// Not a JSON object (a text line, a cut-off line, binary noise).
    NotJson,
    /// JSON, but not an access-log line (another log event).
    NotAccess,
    /// An access-log line without a field replay needs, or with one it cannot read.
    Malformed,
}

/// Read one line; `Ok(None)` for a blank one.
pub fn parse(line: &[u8]) -> Result<Option<Record>, Skip> {
    let trimmed = line.trim_ascii();
    if trimmed.is_empty() {
        return Ok(None);
    }
    // A text log's line starts with its timestamp, which JSON would read as a number.
    if !trimmed.starts_with(b"{") {
        return Err(Skip::NotJson);
    }
    let raw: Raw = serde_json::from_slice(line).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => Skip::Malformed,
        _ => Skip::NotJson,
    })?;
    if raw.target.as_deref() != Some("tollgate::access") {
        return Err(Skip::NotAccess);
    }
    record(raw).map(Some).ok_or(Skip::Malformed)
}

fn record(raw: Raw) -> Option<Record> {
    let end: jiff::Timestamp = raw.timestamp?.parse().ok()?;
    let end_us = end.as_microsecond();
    let took_us = raw.duration_ms.filter(|d| d.is_finite() && *d >= 0.0)? * 1000.0;
    let method = http::Method::from_bytes(raw.method?.as_bytes()).ok()?;
    let path = raw.path.filter(|p| p.starts_with('/'))?;
    let host = raw.address.map(|a| match raw.port {
        Some(port) => format!("{a}:{port}"),
        None => a,
    });
    let client = match raw.client {
        Some(c) => Some(c.parse().ok()?),
        None => None,
    };
    let keys = match raw.keys {
        Some(keys) => Some(
            keys.into_iter()
                .map(|(name, hex)| match hex {
                    Some(hex) if hex.len() == 16 => {
                        u64::from_str_radix(&hex, 16).ok().map(|d| (name, Some(d)))
                    }
                    Some(_) => None,
                    None => Some((name, None)),
                })
                .collect::<Option<Vec<_>>>()?,
        ),
        None => None,
    };
    Some(Record {
        arrival_us: end_us - took_us.round() as i64,
        end_us,
        method,
        host,
        path,
        client,
        keys,
        route: raw.route,
        limit: raw.limit,
        outcome: raw.outcome,
        status: raw.status,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_of_the_access_log_is_read_back() {
        let line = br#"{"timestamp":"2026-11-30T10:53:45.897813Z","level":"INFO","target":"tollgate::access","http.request.method":"GET","server.address":"api.example","server.port":8080,"url.path":"/v1/x","client.address":"192.0.2.7","tollgate.route":"api","tollgate.outcome":"limited","tollgate.limit":"per-key","tollgate.keys":{"header:x-api-key":"00000000000000ff","cookie:sid":null},"duration_ms":1.500}"#;
        let r = parse(line).unwrap().unwrap();
        assert_eq!(r.end_us - r.arrival_us, 1500);
        assert_eq!(r.host.as_deref(), Some("api.example:8080"));
        assert_eq!(r.key("header:x-api-key"), Logged::Digest(255));
        assert_eq!(r.key("cookie:sid"), Logged::Absent);
        assert_eq!(r.key("bearer"), Logged::Unknown);
        assert!(r.live_rejected());
    }

    #[test]
    fn what_is_not_an_access_line_is_said_so() {
        assert_eq!(parse(b"not json").unwrap_err(), Skip::NotJson);
        assert_eq!(parse(b"{\"timestamp\":").unwrap_err(), Skip::NotJson);
        assert_eq!(parse(b"\xff\xfe").unwrap_err(), Skip::NotJson);
        assert_eq!(
            parse(br#"{"target":"tollgate","message":"listening"}"#).unwrap_err(),
            Skip::NotAccess
        );
        let no_path = br#"{"timestamp":"2026-11-30T10:53:45Z","target":"tollgate::access","http.request.method":"GET","duration_ms":1}"#;
        assert_eq!(parse(no_path).unwrap_err(), Skip::Malformed);
        let bad_key = br#"{"timestamp":"2026-11-30T10:53:45Z","target":"tollgate::access","http.request.method":"GET","url.path":"/","duration_ms":1,"tollgate.keys":{"bearer":"xyz"}}"#;
        assert_eq!(parse(bad_key).unwrap_err(), Skip::Malformed);
        assert_eq!(parse(b"[1,2]").unwrap_err(), Skip::NotJson);
        // A text access line starts with its timestamp.
        let text = b"2026-12-07T11:08:52.090260Z  INFO tollgate::access: method=GET path=/";
        assert_eq!(parse(text).unwrap_err(), Skip::NotJson);
        assert!(parse(b"  \n").unwrap().is_none());
    }
}
