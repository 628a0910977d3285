//! An explanation as text for a terminal: the decision first, then each limit in a few lines.

use std::fmt::Write as _;

use super::{Explanation, Kind, LimitExplained, Outcome, Verdict};

/// `e` as `tollgate explain` prints it.
pub fn render(e: &Explanation) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{} (backend {})", e.source, e.backend);
    asked(&mut out, e);
    let _ = writeln!(out, "route:    {}", e.route.as_deref().unwrap_or("(none)"));
    let d = &e.decision;
    let word = match d.outcome {
        Verdict::Admitted => "ADMITTED",
        Verdict::Limited => "LIMITED",
        Verdict::Exempt => "EXEMPT",
        Verdict::NoRoute => "NO ROUTE",
        Verdict::Refused => "REFUSED",
        Verdict::OperatorBan => "BANNED",
    };
    let _ = match &d.limit {
        Some(limit) => write!(out, "decision: {word} by {limit}: {}", d.reason),
        None => write!(out, "decision: {word}: {}", d.reason),
    };
    if let Some(s) = d.retry_after_s {
        let _ = write!(out, " (retry after {})", seconds(s));
    }
    match (d.status, d.grpc_status) {
        (Some(status), Some(grpc)) => {
            let _ = write!(out, " [{status}; gRPC status {grpc}]");
        }
        (Some(status), None) => {
            let _ = write!(out, " [{status}]");
        }
        _ => {}
    }
    out.push('\n');
    if let Some(ban) = &e.operator_ban {
        let _ = writeln!(out, "operator ban: {}", entry(ban));
    }
    for l in &e.limits {
        limit(&mut out, l);
    }
    if let Some(c) = &e.capacity {
        let _ = writeln!(
            out,
            "upstream: {} would {} ({} of {} in flight, {} of {} queued, {} priority, wait up to {})",
            c.upstream,
            c.would,
            c.in_flight,
            c.cap,
            c.queued,
            c.queue_size,
            c.priority,
            seconds(c.queue_timeout_s)
        );
    }
    out
}

/// The request (or the rate limit service call, descriptor by descriptor) explained.
fn asked(out: &mut String, e: &Explanation) {
    let r = &e.request;
    let from = match r.client_ip.as_deref() {
        Some(ip) if ip != r.peer => format!("{} (client {ip})", r.peer),
        _ => r.peer.clone(),
    };
    if e.descriptors.is_empty() {
        let _ = writeln!(
            out,
            "request:  {} {}{} from {from}",
            r.method, r.host, r.path
        );
    } else {
        let _ = writeln!(out, "call:     ShouldRateLimit, domain {}", r.host);
        for d in &e.descriptors {
            let by = d
                .limit
                .as_deref()
                .map(|l| format!(" by {l}"))
                .unwrap_or_default();
            let _ = writeln!(out, "  descriptor {}: {}{by}", d.entries, d.applies);
        }
    }
}

/// One limit: its settings on one line, then what was read and its outcome.
fn limit(out: &mut String, l: &LimitExplained) {
    heading(out, l);
    if let Some(x) = &l.exempt {
        let _ = writeln!(out, "  exempt:   by entry {} ({})", x.index, x.entry);
    }
    if let Some(i) = &l.identity {
        let _ = writeln!(out, "  identity: {} -> {}", i.source, i.client);
    }
    if let Some(o) = &l.overridden {
        let _ = writeln!(out, "  override: {}", entry(o));
    }
    state(out, l);
    if let Some(err) = &l.error {
        let _ = writeln!(out, "  error:    {err} (on_failure {})", l.on_failure);
    }
    let outcome = match l.outcome {
        Outcome::Admitted => "admitted",
        Outcome::Limited => "limited",
        Outcome::ShadowLimited => "over the limit (shadow: not enforced)",
        Outcome::Banned => "banned",
        Outcome::Exempt => "exempt",
        Outcome::FailedOpen => "admitted without counting (fails open)",
        Outcome::FailedClosed => "refused (fails closed)",
    };
    let _ = write!(out, "  outcome:  {outcome}");
    if l.retry_after_s > 0.0 {
        let _ = write!(out, ", retry after {}", seconds(l.retry_after_s));
    }
    out.push('\n');
}

/// `limit NAME: shape, key [...], flags`.
fn heading(out: &mut String, l: &LimitExplained) {
    let shape = match &l.kind {
        Kind::TokenBucket { rate, burst, .. } => format!("token bucket {rate}, burst {burst}"),
        Kind::Quota {
            count,
            period,
            timezone,
        } => format!("quota {count}/{period} ({timezone})"),
        Kind::Window {
            count,
            window,
            algorithm,
        } => format!("window {count}/{window} ({algorithm})"),
        Kind::Concurrency { max, lease_s } => {
            format!("concurrency {max} in flight (lease {})", seconds(*lease_s))
        }
    };
    let mut flags = String::new();
    if l.cost != 1 {
        let _ = write!(flags, ", cost {}", l.cost);
    }
    if l.shadow {
        flags.push_str(", shadow");
    }
    if let Some(b) = &l.ban {
        let _ = write!(
            flags,
            ", ban after {} within {} for {} up to {}",
            b.after,
            seconds(b.within_s),
            seconds(b.for_s),
            seconds(b.max_s)
        );
    }
    let _ = writeln!(
        out,
        "limit {}: {shape}, key [{}]{flags}",
        l.name,
        l.key.join(", ")
    );
    if let Some(lease) = &l.leasing {
        let _ = writeln!(
            out,
            "  leasing:  {}leases of at most {} tokens, held {}: {}",
            if lease.auto { "auto, " } else { "" },
            lease.tokens,
            seconds(lease.hold_s),
            lease.bound
        );
    }
}

/// The state read: the bucket or slots, and the ban.
fn state(out: &mut String, l: &LimitExplained) {
    if let Some(n) = &l.now {
        let _ = write!(out, "  now:      {} of {} ", n.remaining, n.limit);
        let _ = match l.kind {
            Kind::TokenBucket { .. } => match n.owed {
                Some(owed) => write!(
                    out,
                    "tokens left, {owed} owed ({}, {} bucket)",
                    n.store, n.counted_in
                ),
                None => write!(out, "tokens left ({}, {} bucket)", n.store, n.counted_in),
            },
            Kind::Quota { .. } | Kind::Window { .. } => {
                write!(out, "requests left ({}, {} bucket)", n.store, n.counted_in)
            }
            Kind::Concurrency { .. } => write!(
                out,
                "slots free ({}, {} in flight)",
                n.store,
                n.in_flight.unwrap_or(0)
            ),
        };
        match (n.reset_s.filter(|r| *r > 0.0), &l.kind) {
            (Some(reset), Kind::Quota { .. }) => {
                let _ = write!(out, ", the window ends in {}", seconds(reset));
            }
            (Some(reset), Kind::Window { .. }) => {
                let _ = write!(out, ", nothing counted in {}", seconds(reset));
            }
            (Some(reset), _) => {
                let _ = write!(out, ", full in {}", seconds(reset));
            }
            (None, _) => {}
        }
        out.push('\n');
    }
    if let Some(b) = &l.ban_state {
        let _ = writeln!(
            out,
            "  ban:      {}, {} strikes, level {}",
            if b.banned_s > 0.0 {
                format!("banned for {} more", seconds(b.banned_s))
            } else {
                "not banned".to_owned()
            },
            b.strikes,
            b.level
        );
    }
}

/// `1.5 s`, `120 s`: three decimals at most.
fn seconds(s: f64) -> String {
    let text = format!("{s:.3}");
    format!("{} s", text.trim_end_matches('0').trim_end_matches('.'))
}

/// An operator's entry in one line: its id, identity, numbers, reason and time left.
fn entry(v: &serde_json::Value) -> String {
    let field = |k: &str| match v.get(k) {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    let mut line = format!(
        "{} for {}",
        field("id").unwrap_or_default(),
        field("identity").unwrap_or_default()
    );
    for (key, label) in [("rate", "rate"), ("burst", "burst"), ("quota", "quota")] {
        if let Some(x) = field(key) {
            let _ = write!(line, ", {label} {x}");
        }
    }
    if let Some(r) = field("reason").filter(|r| !r.is_empty()) {
        let _ = write!(line, " ({r})");
    }
    if let Some(t) = field("ttl_left_s") {
        let _ = write!(line, ", {t} s left");
    }
    line
}
