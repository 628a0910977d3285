//! OpenTelemetry traces: a request's trace context continued from its caller (W3C
//! `traceparent`) or begun here, sampled, told to each upstream attempt, and its finished spans
//! handed to the exporter (`export`), off the request path.
//!
//! Spans are not built as the request goes: the stages record what they learn (the attempts
//! here, the rest in the request's access-log entry) and the spans are made once, at the end,
//! only for a request whose trace is exported.
//!
//! `traceparent` is read and written here, not by the SDK's propagator: its context and header
//! lookups cost every traced request about 600 instructions more (measured with callgrind).

pub mod export;
mod span;

use std::sync::{Arc, LazyLock};
use std::time::SystemTime;

use opentelemetry::trace::{SpanId, SpanKind, TraceId};
use opentelemetry::InstrumentationScope;
use opentelemetry_sdk::trace::{Sampler, SamplingDecision, ShouldSample as _, SpanData};

/// How spans go to the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/HTTP with protobuf bodies (`POST /v1/traces`).
    HttpProtobuf,
    /// OTLP/gRPC (`opentelemetry.proto.collector.trace.v1.TraceService/Export`).
    Grpc,
}

/// `telemetry.traces`, with the protocol the environment names resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct TracesSettings {
    /// The collector's URL as configured (`None`: the `OTEL_EXPORTER_OTLP_*ENDPOINT`
    /// variables, else the protocol's default). For `http/protobuf`, a URL with no path gets
    /// `/v1/traces`.
    pub endpoint: Option<String>,
    pub protocol: OtlpProtocol,
    /// Root spans sampled, 0 to 1.
    pub sample_ratio: f64,
    pub sample_refused: bool,
    pub headers: Vec<(String, String)>,
    /// The configured `service.name` (`None`: `OTEL_SERVICE_NAME`, else `tollgate`).
    pub service_name: Option<String>,
}

/// The live tracer of a config: its sampler and its exporter's queue. The exporter's thread
/// ends, its last spans sent, once the tracer is dropped (a reload that changed its settings,
/// once the last request of the old config is done).
#[derive(Debug)]
pub struct Tracer {
    pub settings: TracesSettings,
    sampler: Sampler,
    queue: export::Queue,
}

impl Tracer {
    /// The tracer of `settings`, its exporter started (an endpoint the exporter cannot use is
    /// the error).
    pub fn start(settings: &TracesSettings) -> Result<Self, String> {
        Ok(Self {
            settings: settings.clone(),
            sampler: Sampler::TraceIdRatioBased(settings.sample_ratio),
            queue: export::start(settings)?,
        })
    }

    /// Send every span queued so far, waiting at most `timeout`: at shutdown, once the last
    /// requests are done.
    pub fn flush(&self, timeout: std::time::Duration) {
        self.queue.flush(timeout);
    }

    /// The trace of a request arriving with `headers`: its caller's context continued (or a
    /// new trace), sampled as the caller was when it says (parent-based), else by
    /// `sample_ratio` of the trace ID (the SDK's ratio sampler, so replicas agree).
    pub fn begin(self: &Arc<Self>, headers: &http::HeaderMap) -> Box<RequestSpan> {
        let caller = headers
            .get("traceparent")
            .and_then(|v| Caller::parse(v.as_bytes()));
        let (trace_id, parent, sampled, trace_state) = match caller {
            Some(c) => (
                c.trace_id,
                Some(c.span_id),
                c.sampled,
                headers.get("tracestate").cloned(),
            ),
            None => {
                let trace_id = new_trace_id();
                let kind = SpanKind::Server;
                let decided = (self.sampler).should_sample(None, trace_id, "", &kind, &[], &[]);
                let sampled = decided.decision == SamplingDecision::RecordAndSample;
                (trace_id, None, sampled, None)
            }
        };
        Box::new(RequestSpan {
            tracer: self.clone(),
            trace_id,
            span_id: new_span_id(),
            parent,
            sampled,
            trace_state,
            start: SystemTime::now(),
            attempts: parking_lot::Mutex::new(Vec::new()),
            notes: Notes::default(),
        })
    }
}

/// A caller's span, from a valid W3C `traceparent` (`VV-TRACE-SPAN-FF`, lower-case hex; a
/// later version may add fields after a `-`; `ff` is no version, zero IDs are invalid).
struct Caller {
    trace_id: TraceId,
    span_id: SpanId,
    sampled: bool,
}

impl Caller {
    fn parse(v: &[u8]) -> Option<Self> {
        let hex = |s: &[u8]| -> Option<u128> {
            s.iter().try_fold(0u128, |n, &c| {
                let d = match c {
                    b'0'..=b'9' => c - b'0',
                    b'a'..=b'f' => c - b'a' + 10,
                    _ => return None,
                };
                Some(n << 4 | u128::from(d))
            })
        };
        let (Some(head), rest) = (v.get(..55), v.get(55..).unwrap_or_default()) else {
            return None;
        };
        let version = hex(&head[..2])?;
        let dashes = head[2] == b'-' && head[35] == b'-' && head[52] == b'-';
        let fits = if version == 0 {
            rest.is_empty()
        } else {
            rest.first().is_none_or(|&c| c == b'-')
        };
        if version == 0xff || !dashes || !fits {
            return None;
        }
        let (trace, span) = (hex(&head[3..35])?, hex(&head[36..52])?);
        let flags = hex(&head[53..55])?;
        (trace != 0 && span != 0).then(|| Self {
            trace_id: TraceId::from(trace),
            span_id: SpanId::from(u64::try_from(span).unwrap_or(0)),
            sampled: flags & 1 == 1,
        })
    }
}

/// One request's trace: the caller's context, its own server span's identity, and its
/// upstream attempts as they go.
#[derive(Debug)]
pub struct RequestSpan {
    tracer: Arc<Tracer>,
    pub trace_id: TraceId,
    /// The server span's.
    pub span_id: SpanId,
    /// The caller's span (`traceparent`), if it sent one.
    pub parent: Option<SpanId>,
    pub sampled: bool,
    /// The caller's `tracestate`, passed on as it came (read when the spans are made).
    pub trace_state: Option<http::HeaderValue>,
    pub start: SystemTime,
    attempts: parking_lot::Mutex<Vec<Attempt>>,
    /// What the stages learned that only tollgate can say (see `Notes`).
    pub notes: Notes,
}

/// What the stages learned, for the server span's `tollgate.*` attributes and events.
#[derive(Debug, Default)]
pub struct Notes {
    /// Each limit of the route and how it came out for the request.
    pub limits: Vec<LimitNote>,
    /// Why tollgate answered the request itself (`error.type`), when it did.
    pub error: Option<&'static str>,
    /// How long the limiter's Redis call took, when one was made.
    pub redis: Option<std::time::Duration>,
    /// The candidate config's verdict (`admitted`, `limited`, `unrouted`), when one is loaded.
    pub candidate: Option<&'static str>,
    /// The route's path template (`http.route`).
    pub http_route: Option<Arc<str>>,
    /// A gRPC call (`rpc.*`).
    pub grpc: bool,
    /// tollgate refused the request (a limit, a ban, an upstream's capacity, a `closed` store)
    /// or the call (over the limit).
    pub refused: bool,
}

/// One limit's outcome for the request.
#[derive(Debug, Clone)]
pub struct LimitNote {
    pub name: Arc<str>,
    /// `admitted`, `limited`, `shadow_limited`, `exempt`, `failed_open`, `failed_closed`.
    pub outcome: &'static str,
    /// Decided by the failure policy, without the shared store.
    pub without_store: bool,
    /// Whole tokens (or requests) left, when a bucket was consulted.
    pub remaining: Option<u64>,
    /// What its ban did: `refused`, `started`, `lifted`.
    pub ban: Option<&'static str>,
}

/// One upstream attempt (a retry is another), a CLIENT span.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub span_id: SpanId,
    pub start: SystemTime,
    pub end: Option<SystemTime>,
    /// The target's `host:port`.
    pub target: String,
    /// The attempts before this one (`http.request.resend_count`).
    pub resend: u32,
    pub status: Option<u16>,
    /// Why it failed without a response (`error.type`).
    pub error: Option<&'static str>,
}

impl RequestSpan {
    /// Its spans go to the collector: sampled, or refused by tollgate (`notes.refused`) with
    /// `sample_refused`.
    pub fn exported(&self) -> bool {
        self.sampled || (self.notes.refused && self.tracer.settings.sample_refused)
    }

    /// Its spans may go to the collector, depending on how the request ends.
    pub fn may_export(&self) -> bool {
        self.sampled || self.tracer.settings.sample_refused
    }

    /// The server span's own `traceparent` (for the access log's `trace_id` and `span_id`).
    pub fn traceparent(&self) -> http::HeaderValue {
        traceparent(self.trace_id, self.span_id, self.sampled)
    }

    /// A new attempt at `target`: its span's ID, told the upstream as its parent in
    /// `traceparent` (sampled or not, as this trace is). Recorded only when sampled.
    pub fn attempt(&self, headers: &mut http::HeaderMap, target: &str) -> Option<usize> {
        let span_id = new_span_id();
        headers.insert(
            http::HeaderName::from_static("traceparent"),
            traceparent(self.trace_id, span_id, self.sampled),
        );
        if !self.sampled {
            return None;
        }
        let mut attempts = self.attempts.lock();
        let resend = u32::try_from(attempts.len()).unwrap_or(u32::MAX);
        attempts.push(Attempt {
            span_id,
            start: SystemTime::now(),
            end: None,
            target: target.to_owned(),
            resend,
            status: None,
            error: None,
        });
        Some(attempts.len() - 1)
    }

    /// Attempt `i` ended with a response head of `status`, or failed with `error`.
    pub fn attempt_ended(&self, i: usize, status: Option<u16>, error: Option<&'static str>) {
        if let Some(a) = self.attempts.lock().get_mut(i) {
            (a.end, a.status, a.error) = (Some(SystemTime::now()), status, error);
        }
    }

    /// The attempts made, in order.
    pub fn attempts(&self) -> Vec<Attempt> {
        self.attempts.lock().clone()
    }

    /// Hand finished spans to the exporter (dropped and counted if its queue is full).
    pub fn export(&self, spans: impl IntoIterator<Item = SpanData>) {
        for span in spans {
            self.tracer.queue.push(span);
        }
    }
}

/// `traceparent` for a span of `trace_id`, written out digit by digit: through `format!` it
/// cost every traced request about 2,000 instructions (measured with callgrind).
fn traceparent(trace_id: TraceId, span_id: SpanId, sampled: bool) -> http::HeaderValue {
    let mut text = [0u8; 55];
    text[..3].copy_from_slice(b"00-");
    hex(&mut text[3..35], &trace_id.to_bytes());
    text[35] = b'-';
    hex(&mut text[36..52], &span_id.to_bytes());
    text[52..].copy_from_slice(if sampled { b"-01" } else { b"-00" });
    crate::header_value::joined(&[&text]).unwrap_or(http::HeaderValue::from_static(""))
}

/// `bytes` as lower-case hex digits into `out` (twice as long).
fn hex(out: &mut [u8], bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
}

/// The instrumentation scope tollgate's spans are reported under.
pub fn scope() -> InstrumentationScope {
    static SCOPE: LazyLock<InstrumentationScope> = LazyLock::new(|| {
        InstrumentationScope::builder("tollgate")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build()
    });
    SCOPE.clone()
}

fn new_trace_id() -> TraceId {
    TraceId::from(fastrand::u128(1..))
}

fn new_span_id() -> SpanId {
    SpanId::from(fastrand::u64(1..))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callers_traceparent_is_read_as_w3c_says() {
        let ok = Caller::parse(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(
            ok.trace_id,
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(ok.span_id, SpanId::from_hex("00f067aa0ba902b7").unwrap());
        assert!(ok.sampled);
        assert!(
            !Caller::parse(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
                .unwrap()
                .sampled
        );
        // A later version may carry more fields; version 00 may not.
        assert!(
            Caller::parse(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-extra")
                .is_some_and(|c| c.sampled)
        );
        for bad in [
            &b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"[..],
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"",
        ] {
            assert!(
                Caller::parse(bad).is_none(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn traceparent_is_the_w3c_form() {
        let trace = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        let span = SpanId::from_hex("00f067aa0ba902b7").unwrap();
        assert_eq!(
            traceparent(trace, span, true),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        assert_eq!(
            traceparent(trace, span, false),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        );
    }
}
