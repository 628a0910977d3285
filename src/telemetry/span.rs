//! A request's spans assembled from what its caller (the proxy's access-log entry, the rate
//! limit service's call) made of it: the SERVER span with one `tollgate.limit` event per limit,
//! and a CLIENT span per upstream attempt, both of the request's trace.

use std::borrow::Cow;
use std::time::SystemTime;

use opentelemetry::trace::{Event, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceState};
use opentelemetry::KeyValue;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};

use super::{Attempt, RequestSpan};

impl RequestSpan {
    /// The request's SERVER span, a child of its caller's: `attributes`, the limits' events,
    /// and an error status naming `error` (`None`: unset, as for a refusal).
    pub fn server_span(
        &self,
        name: String,
        attributes: Vec<KeyValue>,
        error: Option<Cow<'static, str>>,
        end: SystemTime,
    ) -> SpanData {
        self.span(
            SpanKind::Server,
            (self.span_id, self.parent),
            (self.start, end),
        )
        .with(name, attributes, self.limit_events(end), error)
    }

    /// Attempt `attempt`'s CLIENT span, a child of the request's.
    pub fn client_span(
        &self,
        attempt: &Attempt,
        name: String,
        attributes: Vec<KeyValue>,
        error: Option<Cow<'static, str>>,
        end: SystemTime,
    ) -> SpanData {
        let at = (attempt.start, attempt.end.unwrap_or(end));
        self.span(SpanKind::Client, (attempt.span_id, Some(self.span_id)), at)
            .with(name, attributes, SpanEvents::default(), error)
    }

    /// A span of this trace, exported (so sampled), with the caller's `tracestate`.
    fn span(
        &self,
        kind: SpanKind,
        (id, parent): (SpanId, Option<SpanId>),
        (start, end): (SystemTime, SystemTime),
    ) -> Blank {
        let state = (self.trace_state.as_ref())
            .and_then(|v| v.to_str().ok()?.parse::<TraceState>().ok())
            .unwrap_or_default();
        let context = SpanContext::new(self.trace_id, id, TraceFlags::SAMPLED, false, state);
        Blank(SpanData {
            span_context: context,
            parent_span_id: parent.unwrap_or(SpanId::INVALID),
            // Only the SERVER span's parent is the caller's, from another process.
            parent_span_is_remote: kind == SpanKind::Server && parent.is_some(),
            span_kind: kind,
            name: Cow::Borrowed(""),
            start_time: start,
            end_time: end,
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: super::scope(),
        })
    }

    /// One `tollgate.limit` event per limit in the notes, at the span's start (when decided).
    fn limit_events(&self, end: SystemTime) -> SpanEvents {
        let at = self.start.min(end);
        let mut all = SpanEvents::default();
        all.events = (self.notes.limits.iter())
            .map(|l| {
                let mut a = vec![
                    KeyValue::new("tollgate.limit.name", l.name.to_string()),
                    KeyValue::new("tollgate.limit.outcome", l.outcome),
                ];
                if let Some(left) = l.remaining {
                    a.push(KeyValue::new(
                        "tollgate.limit.remaining",
                        i64::try_from(left).unwrap_or(i64::MAX),
                    ));
                }
                if l.without_store {
                    a.push(KeyValue::new("tollgate.limit.without_store", true));
                }
                if let Some(ban) = l.ban {
                    a.push(KeyValue::new("tollgate.ban", ban));
                }
                Event::new("tollgate.limit", at, a, 0)
            })
            .collect();
        all
    }
}

/// A span with its identity and times, not yet its content.
struct Blank(SpanData);

impl Blank {
    fn with(
        mut self,
        name: String,
        attributes: Vec<KeyValue>,
        events: SpanEvents,
        error: Option<Cow<'static, str>>,
    ) -> SpanData {
        self.0.name = name.into();
        self.0.attributes = attributes;
        self.0.events = events;
        self.0.status = error.map_or(Status::Unset, Status::error);
        self.0
    }
}
