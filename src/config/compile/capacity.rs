//! An upstream's `max_in_flight`, `adaptive` and `queue`, and a route's `priority`.

use std::time::Duration;

use super::{duration_or, Problems};
use crate::capacity::{AdaptiveSpec, Cap, Priority, Spec};
use crate::config::file;
use crate::identity::{Alternative, KeySpec};

/// Requests that may wait when `queue.size` is not set.
pub const DEFAULT_QUEUE_SIZE: usize = 1024;
/// The longest wait when `queue.timeout` is not set.
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(5);

/// The upstream's caps and queue (none without `max_in_flight`), and the queue's own key.
pub(super) fn capacity(
    u: &file::Upstream,
    path: &str,
    p: &mut Problems,
) -> (Option<Spec>, Option<KeySpec>) {
    let cap = cap(u, path, p);
    if u.max_in_flight.is_none() {
        if u.queue.is_some() {
            p.add(
                format!("{path}.queue"),
                "needs `max_in_flight`: without a cap no request ever waits",
            );
        }
        if u.adaptive.is_some() {
            p.add(
                format!("{path}.adaptive"),
                "needs `max_in_flight: adaptive`",
            );
        }
    }
    let queue = u.queue.as_ref();
    let timeout = duration_or(
        p,
        format!("{path}.queue.timeout"),
        queue.and_then(|q| q.timeout.as_ref()),
        DEFAULT_QUEUE_TIMEOUT,
    );
    if timeout.is_zero() {
        p.add(
            format!("{path}.queue.timeout"),
            "must be longer than zero (`size: 0` refuses at once instead)",
        );
    }
    let queue_size = queue.and_then(|q| q.size).map_or(DEFAULT_QUEUE_SIZE, |n| {
        usize::try_from(n).unwrap_or(usize::MAX)
    });
    let key = queue.and_then(|q| q.key.as_ref()).map(|k| {
        if k.is_empty() {
            p.add(
                format!("{path}.queue.key"),
                "needs at least one source, as in `[ip]`",
            );
        }
        let at = |i| format!("{path}.queue.key[{i}]");
        KeySpec(
            (k.iter().enumerate())
                .filter_map(|(i, s)| p.take(at(i), Alternative::parse(s)))
                .collect(),
        )
    });
    let spec = cap.map(|cap| Spec {
        cap,
        queue_size,
        timeout,
    });
    (spec, key)
}

/// `max_in_flight` (and `adaptive`, which only goes with `max_in_flight: adaptive`).
fn cap(u: &file::Upstream, path: &str, p: &mut Problems) -> Option<Cap> {
    let adaptive = u.adaptive.as_ref();
    match u.max_in_flight.as_ref()? {
        file::MaxInFlight::Fixed(0) => {
            p.add(
                format!("{path}.max_in_flight"),
                "must be at least 1 (leave it out for no cap)",
            );
            None
        }
        file::MaxInFlight::Fixed(n) => {
            if adaptive.is_some() {
                p.add(
                    format!("{path}.adaptive"),
                    "is for `max_in_flight: adaptive`; this cap is a fixed number",
                );
            }
            Some(Cap::Fixed(usize::try_from(*n).unwrap_or(usize::MAX)))
        }
        file::MaxInFlight::Word(w) if w == "adaptive" => {
            adaptive_spec(adaptive, &format!("{path}.adaptive"), p).map(Cap::Adaptive)
        }
        file::MaxInFlight::Word(w) => {
            p.add(
                format!("{path}.max_in_flight"),
                format!("`{w}` is neither a number of requests nor `adaptive`"),
            );
            None
        }
    }
}

fn adaptive_spec(a: Option<&file::Adaptive>, path: &str, p: &mut Problems) -> Option<AdaptiveSpec> {
    let d = AdaptiveSpec::default();
    let Some(a) = a else {
        return Some(d);
    };
    let to_usize = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    let spec = AdaptiveSpec {
        min: a.min.map_or(d.min, to_usize),
        max: a.max.map_or(d.max, to_usize),
        window: duration_or(p, format!("{path}.window"), a.window.as_ref(), d.window),
        tolerance: a.tolerance.unwrap_or(d.tolerance),
        probe_every: duration_or(
            p,
            format!("{path}.probe_every"),
            a.probe_every.as_ref(),
            d.probe_every,
        ),
    };
    let before = p.0.len();
    if spec.min == 0 {
        p.add(format!("{path}.min"), "must be at least 1");
    }
    if spec.min > spec.max {
        p.add(
            format!("{path}.min"),
            format!(
                "is {} but max is {}: min must not exceed max",
                spec.min, spec.max
            ),
        );
    }
    if !(1.0..=2.0).contains(&spec.tolerance) {
        p.add(
            format!("{path}.tolerance"),
            "must be between 1.0 (no latency over the no-load one) and 2.0",
        );
    }
    for (field, d) in [("window", spec.window), ("probe_every", spec.probe_every)] {
        if d.is_zero() {
            p.add(format!("{path}.{field}"), "must be longer than zero");
        }
    }
    (p.0.len() == before).then_some(spec)
}

/// `routes[].priority`.
pub(super) fn priority(r: &file::Route, path: &str, p: &mut Problems) -> Priority {
    match r.priority.as_deref() {
        None => Priority::Normal,
        Some(s) => Priority::parse(s).unwrap_or_else(|| {
            p.add(
                format!("{path}.priority"),
                format!("`{s}` is not a priority: high, normal or low"),
            );
            Priority::Normal
        }),
    }
}
