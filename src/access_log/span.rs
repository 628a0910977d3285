//! A proxied request's completed entry as its spans' names and attributes: the HTTP (and RPC)
//! semantic conventions' and tollgate's own `tollgate.*`, for its SERVER span and the CLIENT
//! span of each upstream attempt (assembled by `telemetry`).

use std::borrow::Cow;
use std::time::SystemTime;

use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::trace::SpanData;

use super::format::{bytes_in, host_and_port, version};
use super::Entry;
use crate::telemetry::{Attempt, RequestSpan};

/// Hand `span`'s spans to the exporter if its trace is exported: sampled, or a request
/// tollgate refused with `sample_refused`.
pub(super) fn export(entry: &Entry, span: &RequestSpan, bytes_out: u64) {
    if !span.exported() {
        return;
    }
    let end = SystemTime::now();
    let attempts = span.attempts();
    let mut spans = Vec::with_capacity(1 + attempts.len());
    spans.push(server(entry, span, bytes_out, end));
    spans.extend(attempts.iter().map(|a| client(entry, span, a, end)));
    span.export(spans);
}

/// `server.address` and `server.port` of a `host[:port]`.
fn server_address(host: &[u8], a: &mut Vec<KeyValue>) {
    let (address, port) = host_and_port(host);
    a.push(KeyValue::new("server.address", text(address)));
    if let Some(port) = port.and_then(|p| std::str::from_utf8(p).ok()?.parse::<i64>().ok()) {
        a.push(KeyValue::new("server.port", port));
    }
}

fn text(v: &[u8]) -> Value {
    Value::from(String::from_utf8_lossy(v).into_owned())
}

fn int(n: impl TryInto<i64>) -> Value {
    Value::I64(n.try_into().unwrap_or(i64::MAX))
}

fn ms(d: std::time::Duration) -> Value {
    Value::F64(d.as_secs_f64() * 1000.0)
}

/// The request's SERVER span.
fn server(e: &Entry, span: &RequestSpan, bytes_out: u64, end: SystemTime) -> SpanData {
    let notes = &span.notes;
    let mut a = http_attributes(e, bytes_out);
    if let Some(route) = &notes.http_route {
        a.push(KeyValue::new("http.route", route.to_string()));
    }
    if notes.grpc {
        rpc(e, &mut a);
    }
    let error = (e.status >= 500).then(|| {
        let kind: Cow<'static, str> = match notes.error {
            Some(kind) => kind.into(),
            None => e.status.to_string().into(),
        };
        a.push(KeyValue::new("error.type", kind.clone()));
        kind
    });
    tollgate(e, span, &mut a);
    let name = match &notes.http_route {
        Some(route) => format!("{} {route}", e.method),
        None => e.method.to_string(),
    };
    span.server_span(name, a, error, end)
}

/// The HTTP semantic conventions' attributes of the request as it came and went.
fn http_attributes(e: &Entry, bytes_out: u64) -> Vec<KeyValue> {
    let mut a = vec![
        KeyValue::new("http.request.method", e.method.as_str().to_owned()),
        KeyValue::new("url.path", e.uri.path().to_owned()),
        KeyValue::new("url.scheme", if e.tls { "https" } else { "http" }),
        KeyValue::new("http.response.status_code", i64::from(e.status)),
        KeyValue::new("network.protocol.version", version(e.version).1),
        KeyValue::new("client.address", client_address(e)),
        // Rendered once per connection: formatting an address costs more than the rest.
        KeyValue::new("network.peer.address", text(e.peer_text.as_bytes())),
        KeyValue::new("http.request.body.size", int(bytes_in(e))),
        KeyValue::new("http.response.body.size", int(bytes_out)),
        KeyValue::new("tollgate.outcome", e.outcome),
        KeyValue::new("tollgate.request_id", text(e.request_id.as_bytes())),
    ];
    let authority = e.uri.authority().map(|h| h.as_str().as_bytes());
    if let Some(host) = e
        .host
        .as_ref()
        .map(http::HeaderValue::as_bytes)
        .or(authority)
    {
        server_address(host, &mut a);
    }
    if let Some(ua) = &e.user_agent {
        a.push(KeyValue::new("user_agent.original", text(ua.as_bytes())));
    }
    a
}

/// The client's address: the connection's peer, rendered once per connection, unless a
/// trusted proxy named another.
fn client_address(e: &Entry) -> Value {
    match e.client_ip {
        Some(ip) if ip != e.peer => Value::from(ip.to_string()),
        _ => text(e.peer_text.as_bytes()),
    }
}

/// `rpc.*` of a gRPC call (`/package.Service/Method`).
fn rpc(e: &Entry, a: &mut Vec<KeyValue>) {
    a.push(KeyValue::new("rpc.system", "grpc"));
    if let Some((service, method)) = e.uri.path().trim_start_matches('/').split_once('/') {
        a.push(KeyValue::new("rpc.service", service.to_owned()));
        a.push(KeyValue::new("rpc.method", method.to_owned()));
    }
    if let Some(code) = e.grpc_status {
        a.push(KeyValue::new("rpc.grpc.status_code", i64::from(code)));
    }
}

/// What only tollgate can say: the route, the deciding limit, the identity's digest, the
/// queue, the store's time, the candidate's verdict.
fn tollgate(e: &Entry, span: &RequestSpan, a: &mut Vec<KeyValue>) {
    let notes = &span.notes;
    if !e.route.is_empty() {
        a.push(KeyValue::new("tollgate.route", text(&e.route)));
    }
    // The limit that decided: the first not plainly admitted, else the first.
    let deciding = (notes.limits.iter())
        .find(|l| l.outcome != "admitted" && l.outcome != "exempt")
        .or_else(|| notes.limits.first());
    if let Some(l) = deciding {
        a.push(KeyValue::new("tollgate.limit.name", l.name.to_string()));
        a.push(KeyValue::new("tollgate.limit.outcome", l.outcome));
    }
    if let Some(ban) = notes.limits.iter().find_map(|l| l.ban) {
        a.push(KeyValue::new("tollgate.ban", ban));
    } else if e.outcome == "operator-ban" {
        a.push(KeyValue::new("tollgate.ban", "operator"));
    }
    if let Some(c) = e.client {
        a.push(KeyValue::new("tollgate.identity", format!("{c:016x}")));
    }
    if let Some(wait) = e.queue_time {
        a.push(KeyValue::new("tollgate.queue.wait_ms", ms(wait)));
        let capacity = if e.outcome == "at-capacity" {
            "refused"
        } else {
            "admitted"
        };
        a.push(KeyValue::new("tollgate.capacity.outcome", capacity));
    }
    if let Some(took) = notes.redis {
        a.push(KeyValue::new("tollgate.redis.duration_ms", ms(took)));
    }
    if let Some(verdict) = notes.candidate {
        a.push(KeyValue::new("tollgate.candidate.verdict", verdict));
    }
    if let Some(cost) = e.cost {
        a.push(KeyValue::new("tollgate.cost", int(cost)));
    }
}

/// An upstream attempt's CLIENT span, a child of the request's.
fn client(e: &Entry, span: &RequestSpan, attempt: &Attempt, end: SystemTime) -> SpanData {
    let mut a = vec![
        KeyValue::new("http.request.method", e.method.as_str().to_owned()),
        KeyValue::new("url.path", e.uri.path().to_owned()),
    ];
    server_address(attempt.target.as_bytes(), &mut a);
    if attempt.resend > 0 {
        a.push(KeyValue::new(
            "http.request.resend_count",
            i64::from(attempt.resend),
        ));
    }
    if let Some(status) = attempt.status {
        a.push(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
    }
    // A client's 4xx and 5xx are errors, as a failure without a response is.
    let error: Option<Cow<'static, str>> = match (attempt.error, attempt.status) {
        (Some(kind), _) => Some(kind.into()),
        (None, Some(s)) if s >= 400 => Some(s.to_string().into()),
        _ => None,
    };
    if let Some(kind) = &error {
        a.push(KeyValue::new("error.type", kind.clone()));
    }
    span.client_span(attempt, e.method.to_string(), a, error, end)
}
