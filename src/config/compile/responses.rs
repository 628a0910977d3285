//! What a limit learns from the response, checked against its kind: `count_when` (the
//! statuses that count a request) and `cost: { reserve, from_response }` (the header whose
//! value settles what a request cost).

use super::Problems;
use crate::config::file::{self, StatusItem};
use crate::config::settings::StatusSet;

/// `l.count_when` as a set of statuses; `None` when unset or wrong (the problems are added).
pub(super) fn spec(l: &file::Limit, path: &str, p: &mut Problems) -> Option<StatusSet> {
    let c = l.count_when.as_ref()?;
    let path = format!("{path}.count_when");
    for (key, set) in [
        ("concurrency", l.concurrency.is_some()),
        ("leasing", l.leasing.is_some()),
    ] {
        if set {
            p.add(
                &path,
                format!("is for `rate`, `quota` and `window` limits, not with `{key}`: a request is counted when its response comes"),
            );
            return None;
        }
    }
    if c.status.is_empty() {
        p.add(
            format!("{path}.status"),
            "needs at least one status, as in `[401, 403]` or `[\"5xx\"]`",
        );
        return None;
    }
    let mut set = StatusSet::default();
    let mut ok = true;
    for (i, item) in c.status.iter().enumerate() {
        match item {
            StatusItem::Code(code) if (100..600).contains(code) => set = set.with(*code),
            StatusItem::Class(class) if is_class(class) => {
                let first = u16::from(class.as_bytes()[0] - b'0') * 100;
                set = (first..first + 100).fold(set, StatusSet::with);
            }
            other => {
                let shown = match other {
                    StatusItem::Code(c) => c.to_string(),
                    StatusItem::Class(s) => format!("`{s}`"),
                };
                p.add(
                    format!("{path}.status[{i}]"),
                    format!("{shown} is not an HTTP status: a code from 100 to 599, or a class from \"1xx\" to \"5xx\""),
                );
                ok = false;
            }
        }
    }
    ok.then_some(set)
}

fn is_class(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 3 && (b'1'..=b'5').contains(&b[0]) && &b[1..] == b"xx"
}

/// The header `cost.from_response` names; `None` for a fixed cost or when wrong.
pub(super) fn settle(l: &file::Limit, path: &str, p: &mut Problems) -> Option<http::HeaderName> {
    let Some(file::Cost::Settled(s)) = &l.cost else {
        return None;
    };
    let path = format!("{path}.cost");
    let header = p.take(
        format!("{path}.from_response"),
        http::HeaderName::from_bytes(s.from_response.trim().as_bytes())
            .map_err(|_| format!("`{}` is not a header name", s.from_response)),
    );
    let kind = if l.rate.is_none() {
        Some("a token bucket (`rate`): a window or quota counts requests, not units")
    } else if l.leasing.is_some() {
        Some("not with `leasing`: a leased token is spent here before the response comes")
    } else if l.count_when.is_some() {
        Some("not with `count_when`: write two limits")
    } else {
        None
    };
    if let Some(why) = kind {
        p.add(&path, format!("`from_response` is for {why}"));
        return None;
    }
    header
}
