//! The counts of a replay, per route and limit, and the report printed from them (text for
//! people, JSON for scripts).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::identity::ClientId;

/// How many identities the report lists per limit.
pub const TOP: usize = 10;

/// Lines read, and why some were not replayed.
#[derive(Debug, Default)]
pub struct Totals {
    pub lines: u64,
    pub replayed: u64,
    pub not_json: u64,
    pub not_access: u64,
    pub malformed: u64,
    /// Access lines this config routes nowhere (the live answer was probably 404 too).
    pub unrouted: u64,
    /// Access lines whose method, host or path screening refuses (400 live as well).
    pub refused: u64,
    /// Routed lines not replayed: a source their route's limits read is not in the line.
    pub unreplayable: u64,
    /// Lines an operator's ban refused live, before any limit was asked: not replayed (the
    /// replay has no bans), not counted as unreplayable.
    pub operator_banned: u64,
    /// Lines that arrived more than the reorder window before a line already replayed:
    /// replayed late, out of order.
    pub late: u64,
}

/// One route's replay.
#[derive(Debug, Default)]
pub struct RouteStats {
    pub name: String,
    /// The route has `match.headers`: counted for the lines the live proxy gave this route.
    pub matches_headers: bool,
    pub requests: u64,
    pub admitted: u64,
    pub rejected: u64,
    /// Lines of this route not replayed: a source its limits read is not in the line.
    pub unreplayable: u64,
    /// What the live proxy did with lines it gave a route of this name.
    pub live_requests: u64,
    pub live_rejected: u64,
    pub limits: Vec<LimitStats>,
}

/// One limit's replay.
#[derive(Debug, Default)]
pub struct LimitStats {
    pub name: String,
    /// The key, as in the config.
    pub key: String,
    /// Counted and admitted (the request went through).
    pub admitted: u64,
    /// The first limit of the route to refuse the request.
    pub rejected: u64,
    /// Of `rejected`, refused by a ban without asking the bucket.
    pub banned: u64,
    pub exempt: u64,
    /// A `shadow: true` limit that would have refused.
    pub shadow_rejected: u64,
    /// Lines the live proxy refused with a limit of this name on this route.
    pub live_rejected: u64,
    /// Why the limit is not replayed at all.
    pub not_replayed: Option<&'static str>,
    /// Lines not replayed because they do not log a source of this limit, by source.
    pub unknown: BTreeMap<String, u64>,
    /// Rejections by identity, with how the identity reads.
    pub by_identity: HashMap<ClientId, (String, u64)>,
}

impl LimitStats {
    pub(super) fn top(&self) -> Vec<(&str, u64)> {
        let mut top: Vec<(&str, u64)> = self
            .by_identity
            .values()
            .map(|(label, n)| (label.as_str(), *n))
            .collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        top.truncate(TOP);
        top
    }
}

/// The report as text.
pub fn text(config: &str, log: &str, totals: &Totals, routes: &[RouteStats]) -> String {
    let mut out = String::new();
    let t = totals;
    let skipped = t.not_json + t.not_access + t.malformed;
    let _ = writeln!(out, "replay of {log} through {config}");
    let _ = writeln!(
        out,
        "lines: {} read, {} replayed, {} not replayable, {skipped} skipped ({} not JSON, {} not access lines, {} malformed)",
        t.lines, t.replayed, t.unreplayable, t.not_json, t.not_access, t.malformed
    );
    let _ = writeln!(
        out,
        "       {} matched no route, {} refused by screening, {} refused by an operator's ban, {} replayed out of order",
        t.unrouted, t.refused, t.operator_banned, t.late
    );
    let mut cannot = Vec::new();
    for r in routes
        .iter()
        .filter(|r| r.requests + r.unreplayable > 0 || r.live_requests > 0)
    {
        let _ = writeln!(
            out,
            "\nroute {}: {} requests, {} admitted, {} rejected (live: {} requests, {} rejected)",
            r.name, r.requests, r.admitted, r.rejected, r.live_requests, r.live_rejected
        );
        if r.unreplayable > 0 {
            let _ = writeln!(out, "  {} lines not replayed (see below)", r.unreplayable);
        }
        if r.matches_headers {
            cannot.push(format!(
                "route {}: matches on request headers, which the log does not hold: counted for the lines the live proxy routed to `{}` only",
                r.name, r.name
            ));
        }
        for l in &r.limits {
            limit_text(&mut out, r, l, &mut cannot);
        }
    }
    if !cannot.is_empty() {
        let _ = writeln!(out, "\ncannot replay:");
        for c in cannot {
            let _ = writeln!(out, "  {c}");
        }
    }
    out
}

fn limit_text(out: &mut String, r: &RouteStats, l: &LimitStats, cannot: &mut Vec<String>) {
    if let Some(why) = l.not_replayed {
        let _ = writeln!(out, "  limit {} (key {}): not replayed", l.name, l.key);
        cannot.push(format!("route {}, limit {}: {why}", r.name, l.name));
        return;
    }
    let shadow = if l.shadow_rejected > 0 {
        format!(", {} would reject (shadow)", l.shadow_rejected)
    } else {
        String::new()
    };
    let banned = if l.banned > 0 {
        format!(" ({} while banned)", l.banned)
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "  limit {} (key {}): {} admitted, {} rejected{banned}, {} exempt{shadow} (live: {} rejected)",
        l.name, l.key, l.admitted, l.rejected, l.exempt, l.live_rejected
    );
    let top = l.top();
    if !top.is_empty() {
        let width = top.iter().map(|(label, _)| label.len()).max().unwrap_or(0);
        let _ = writeln!(out, "    most rejected:");
        for (label, n) in top {
            let _ = writeln!(out, "      {label:<width$}  {n}");
        }
    }
    for (source, n) in &l.unknown {
        cannot.push(format!(
            "route {}, limit {}: `{source}` is not in the logged sources of {n} lines (`tollgate.keys` holds the sources the live route's limits read)",
            r.name, l.name
        ));
    }
}

/// The report as one JSON object.
pub fn json(config: &str, log: &str, totals: &Totals, routes: &[RouteStats]) -> Value {
    let t = totals;
    let routes: Vec<Value> = routes
        .iter()
        .map(|r| {
            let limits: Vec<Value> = r
                .limits
                .iter()
                .map(|l| {
                    let top: Vec<Value> = l
                        .top()
                        .into_iter()
                        .map(|(identity, n)| json!({"identity": identity, "rejected": n}))
                        .collect();
                    json!({
                        "name": l.name, "key": l.key, "replayed": l.not_replayed.is_none(),
                        "not_replayed_because": l.not_replayed,
                        "admitted": l.admitted, "rejected": l.rejected, "banned": l.banned,
                        "exempt": l.exempt, "shadow_rejected": l.shadow_rejected,
                        "live_rejected": l.live_rejected, "unlogged_sources": l.unknown,
                        "most_rejected": top,
                    })
                })
                .collect();
            json!({
                "name": r.name, "matches_headers": r.matches_headers,
                "requests": r.requests, "admitted": r.admitted, "rejected": r.rejected,
                "not_replayed": r.unreplayable,
                "live": {"requests": r.live_requests, "rejected": r.live_rejected},
                "limits": limits,
            })
        })
        .collect();
    json!({
        "config": config, "log": log,
        "lines": {
            "read": t.lines, "replayed": t.replayed, "not_replayable": t.unreplayable,
            "skipped": {"not_json": t.not_json, "not_access": t.not_access, "malformed": t.malformed},
            "unrouted": t.unrouted, "refused": t.refused, "operator_banned": t.operator_banned,
            "out_of_order": t.late,
        },
        "routes": routes,
    })
}
