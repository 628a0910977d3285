//! An access-log line, text or JSON, appended to a byte buffer, and the timestamp it starts
//! with. Hand-written rather than through `serde_json` or `format!`: a line is a fixed list of
//! fields, and the generic machinery costs more than the escaping it would save writing.

use std::time::Duration;

use super::{Entry, Format};

/// The wall-clock time as `YYYY-MM-DDTHH:MM:SS.uuuuuuZ`, its date and time of day computed
/// once a second.
#[derive(Debug, Default)]
pub(super) struct Clock {
    second: u64,
    /// `YYYY-MM-DDTHH:MM:SS.` of `second`.
    prefix: [u8; 20],
}

impl Clock {
    /// Append the timestamp of `unix_us` (microseconds since the epoch).
    pub(super) fn push(&mut self, out: &mut Vec<u8>, unix_us: u64) {
        let second = unix_us / 1_000_000;
        if second != self.second || self.prefix[0] == 0 {
            self.second = second;
            self.prefix = civil(second);
        }
        out.extend_from_slice(&self.prefix);
        push_padded(out, unix_us % 1_000_000, 6);
        out.push(b'Z');
    }
}

/// `YYYY-MM-DDTHH:MM:SS.` of a Unix time in seconds (UTC), by jiff: once a second, so its
/// cost does not matter. Years past 9999 (and before 1970) are clamped.
fn civil(secs: u64) -> [u8; 20] {
    let secs = i64::try_from(secs).unwrap_or(i64::MAX);
    let at = jiff::Timestamp::from_second(secs).unwrap_or(jiff::Timestamp::MAX);
    let text = at.strftime("%Y-%m-%dT%H:%M:%S.").to_string();
    let mut fixed = *b"9999-12-31T23:59:59.";
    if text.len() == fixed.len() {
        fixed.copy_from_slice(text.as_bytes());
    }
    fixed
}

/// `n` in decimal, zero-padded to `width` digits.
fn push_padded(out: &mut Vec<u8>, n: u64, width: usize) {
    let mut b = itoa::Buffer::new();
    let digits = b.format(n).as_bytes();
    out.extend(std::iter::repeat_n(
        b'0',
        width.saturating_sub(digits.len()),
    ));
    out.extend_from_slice(digits);
}

fn push_int(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// Milliseconds with three decimals (microsecond resolution): never float noise.
fn push_ms(out: &mut Vec<u8>, d: Duration) {
    let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    push_int(out, us / 1000);
    out.push(b'.');
    push_padded(out, us % 1000, 3);
}

/// The client address: the connection's peer as rendered once per connection, or another
/// address (from a trusted proxy's header) formatted now.
fn push_client(out: &mut Vec<u8>, e: &Entry) {
    match e.client_ip {
        Some(ip) if ip != e.peer => {
            use std::io::Write as _;
            let _ = write!(out, "{ip}");
        }
        _ => out.extend_from_slice(e.peer_text.as_bytes()),
    }
}

/// The trace and parent span IDs of a valid W3C `traceparent` (`VV-TRACE-SPAN-FF`).
fn trace_ids(v: &[u8]) -> Option<(&[u8], &[u8])> {
    let hex = |s: &[u8]| s.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
    if v.len() < 55 || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let (trace, span) = (&v[3..35], &v[36..52]);
    (hex(trace) && hex(span) && trace.iter().any(|&c| c != b'0')).then_some((trace, span))
}

/// The host of a `Host` value without its port, and the port.
pub(super) fn host_and_port(v: &[u8]) -> (&[u8], Option<&[u8]>) {
    if let Some(i) = v.iter().rposition(|&c| c == b':') {
        let (host, port) = (&v[..i], &v[i + 1..]);
        let digits = !port.is_empty() && port.iter().all(u8::is_ascii_digit);
        // A bare IPv6 address has colons of its own: only `[...]:port` has a port.
        let bracketed = host.starts_with(b"[") && host.ends_with(b"]");
        if digits && (bracketed || !host.contains(&b':')) {
            return (host, Some(port));
        }
    }
    (v, None)
}

pub(super) fn version(v: http::Version) -> (&'static str, &'static str) {
    match v {
        http::Version::HTTP_09 => ("HTTP/0.9", "0.9"),
        http::Version::HTTP_10 => ("HTTP/1.0", "1.0"),
        http::Version::HTTP_2 => ("HTTP/2.0", "2"),
        http::Version::HTTP_3 => ("HTTP/3.0", "3"),
        _ => ("HTTP/1.1", "1.1"),
    }
}

/// When a line is written: the wall-clock time, and how long its request took.
#[derive(Debug, Clone, Copy)]
pub(super) struct At {
    pub(super) unix_us: u64,
    pub(super) took: Duration,
}

/// Append `entry`'s line, `bytes_out` sent, ended by a newline.
pub(super) fn line(
    out: &mut Vec<u8>,
    clock: &mut Clock,
    format: Format,
    entry: &Entry,
    bytes_out: u64,
    at: At,
) {
    match format {
        Format::Text => text(out, clock, entry, bytes_out, at),
        Format::Json => json(out, clock, entry, bytes_out, at),
    }
    out.push(b'\n');
}

pub(super) fn bytes_in(e: &Entry) -> u64 {
    e.bytes_in.max(e.body_in.received())
}

// === text ===

// One field after another in the line's order: the format reads as it is written out.
#[allow(clippy::too_many_lines)]
fn text(out: &mut Vec<u8>, clock: &mut Clock, e: &Entry, bytes_out: u64, at: At) {
    clock.push(out, at.unix_us);
    out.extend_from_slice(b"  INFO tollgate::access: method=");
    text_value(out, e.method.as_str().as_bytes());
    out.extend_from_slice(b" path=");
    text_value(out, e.uri.path().as_bytes());
    out.extend_from_slice(b" host=");
    let authority = e.uri.authority().map(|a| a.as_str().as_bytes());
    text_value(
        out,
        e.host
            .as_ref()
            .map(HeaderValue::as_bytes)
            .or(authority)
            .unwrap_or_default(),
    );
    out.extend_from_slice(b" proto=");
    out.extend_from_slice(version(e.version).0.as_bytes());
    out.extend_from_slice(b" status=");
    push_int(out, u64::from(e.status));
    if let Some(g) = e.grpc_status {
        out.extend_from_slice(b" grpc_status=");
        push_int(out, u64::from(g));
    }
    if let Some(c) = e.cost {
        out.extend_from_slice(b" cost=");
        push_int(out, c);
    }
    out.extend_from_slice(b" bytes_in=");
    push_int(out, bytes_in(e));
    out.extend_from_slice(b" bytes_out=");
    push_int(out, bytes_out);
    // Route and limit names, and targets, were validated at load: nothing to quote.
    out.extend_from_slice(b" route=");
    plain_or_dash(out, &e.route);
    out.extend_from_slice(b" limit=");
    plain_or_dash(out, &e.limit);
    out.extend_from_slice(b" outcome=");
    out.extend_from_slice(e.outcome.as_bytes());
    out.extend_from_slice(b" client=");
    match e.client {
        Some(c) => push_hex64(out, c),
        None => out.push(b'-'),
    }
    out.extend_from_slice(b" client_ip=");
    push_client(out, e);
    out.extend_from_slice(b" upstream=");
    plain_or_dash(out, &e.upstream);
    out.extend_from_slice(b" upstream_ms=");
    match e.upstream_time {
        Some(d) => push_ms(out, d),
        None => out.push(b'-'),
    }
    out.extend_from_slice(b" queue_ms=");
    match e.queue_time {
        Some(d) => push_ms(out, d),
        None => out.push(b'-'),
    }
    out.extend_from_slice(b" ms=");
    push_ms(out, at.took);
    out.extend_from_slice(b" request_id=");
    text_value(out, e.request_id.as_bytes());
    if let Some((trace, span)) = e.traceparent.as_ref().and_then(|t| trace_ids(t.as_bytes())) {
        out.extend_from_slice(b" trace_id=");
        out.extend_from_slice(trace);
        out.extend_from_slice(b" span_id=");
        out.extend_from_slice(span);
    }
    out.extend_from_slice(b" user_agent=");
    text_value(
        out,
        e.user_agent
            .as_ref()
            .map(HeaderValue::as_bytes)
            .unwrap_or_default(),
    );
}

use http::HeaderValue;

/// Bytes a logfmt value may hold bare: visible ASCII but `"`, `\` and `=`.
const TEXT_PLAIN: [bool; 256] = plain_table(0x21, b"\"\\=");

/// Bytes a JSON string may hold unescaped (bytes past ASCII are checked apart).
const JSON_PLAIN: [bool; 256] = plain_table(0x20, b"\"\\");

const fn plain_table(from: u8, except: &[u8]) -> [bool; 256] {
    let mut t = [false; 256];
    let mut c = from as usize;
    while c < 0x7f {
        t[c] = true;
        c += 1;
    }
    let mut i = 0;
    while i < except.len() {
        t[except[i] as usize] = false;
        i += 1;
    }
    t
}

/// `v` as it is, or `-` when empty.
fn plain_or_dash(out: &mut Vec<u8>, v: &[u8]) {
    if v.is_empty() {
        out.push(b'-');
    } else {
        out.extend_from_slice(v);
    }
}

/// A logfmt value: `-` when empty, bare when it has nothing to quote, else in double quotes
/// with `"`, `\` and control characters escaped and bytes past ASCII as `\xHH`.
fn text_value(out: &mut Vec<u8>, v: &[u8]) {
    if v.is_empty() {
        out.push(b'-');
        return;
    }
    if v.iter().all(|&c| TEXT_PLAIN[usize::from(c)]) {
        out.extend_from_slice(v);
        return;
    }
    out.push(b'"');
    for &c in v {
        match c {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b' ' | b'=' => out.push(c),
            c if c.is_ascii_graphic() => out.push(c),
            c => push_escaped_byte(out, b"\\x", c),
        }
    }
    out.push(b'"');
}

fn push_escaped_byte(out: &mut Vec<u8>, prefix: &[u8], c: u8) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.extend_from_slice(prefix);
    out.push(DIGITS[usize::from(c >> 4)]);
    out.push(DIGITS[usize::from(c & 15)]);
}

fn push_hex64(out: &mut Vec<u8>, n: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for i in (0..16).rev() {
        out.push(DIGITS[(n >> (4 * i)) as usize & 15]);
    }
}

// === JSON ===

// One field after another in the line's order: the format reads as it is written out.
#[allow(clippy::too_many_lines)]
fn json(out: &mut Vec<u8>, clock: &mut Clock, e: &Entry, bytes_out: u64, at: At) {
    out.extend_from_slice(b"{\"timestamp\":\"");
    clock.push(out, at.unix_us);
    out.extend_from_slice(b"\",\"level\":\"INFO\",\"target\":\"tollgate::access\"");
    json_str(out, b"http.request.id", e.request_id.as_bytes());
    if let Some((trace, span)) = e.traceparent.as_ref().and_then(|t| trace_ids(t.as_bytes())) {
        json_str(out, b"trace_id", trace);
        json_str(out, b"span_id", span);
    }
    json_str(out, b"http.request.method", e.method.as_str().as_bytes());
    json_str(out, b"url.scheme", if e.tls { b"https" } else { b"http" });
    let authority = e.uri.authority().map(|a| a.as_str().as_bytes());
    if let Some(host) = e.host.as_ref().map(HeaderValue::as_bytes).or(authority) {
        let (address, port) = host_and_port(host);
        json_str(out, b"server.address", address);
        if let Some(port) = port {
            json_key(out, b"server.port");
            out.extend_from_slice(port);
        }
    }
    json_str(out, b"url.path", e.uri.path().as_bytes());
    json_str(
        out,
        b"network.protocol.version",
        version(e.version).1.as_bytes(),
    );
    json_key(out, b"http.response.status_code");
    push_int(out, u64::from(e.status));
    if let Some(g) = e.grpc_status {
        json_key(out, b"rpc.grpc.status_code");
        push_int(out, u64::from(g));
    }
    if let Some(c) = e.cost {
        json_key(out, b"tollgate.cost");
        push_int(out, c);
    }
    json_key(out, b"http.request.body.size");
    push_int(out, bytes_in(e));
    json_key(out, b"http.response.body.size");
    push_int(out, bytes_out);
    json_key(out, b"client.address");
    out.push(b'"');
    push_client(out, e);
    out.push(b'"');
    json_str(out, b"network.peer.address", e.peer_text.as_bytes());
    if let Some(ua) = &e.user_agent {
        json_str(out, b"user_agent.original", ua.as_bytes());
    }
    if !e.route.is_empty() {
        json_str(out, b"tollgate.route", &e.route);
    }
    json_str(out, b"tollgate.outcome", e.outcome.as_bytes());
    if !e.limit.is_empty() {
        json_str(out, b"tollgate.limit", &e.limit);
    }
    if let Some(c) = e.client {
        json_key(out, b"tollgate.client");
        out.push(b'"');
        push_hex64(out, c);
        out.push(b'"');
    }
    if !e.keys.members().is_empty() {
        json_key(out, b"tollgate.keys");
        out.push(b'{');
        out.extend_from_slice(e.keys.members());
        out.push(b'}');
    }
    if !e.upstream.is_empty() {
        json_str(out, b"upstream.address", &e.upstream);
    }
    if let Some(d) = e.upstream_time {
        json_key(out, b"upstream.duration_ms");
        push_ms(out, d);
    }
    if let Some(d) = e.queue_time {
        json_key(out, b"tollgate.queue_ms");
        push_ms(out, d);
    }
    json_key(out, b"duration_ms");
    push_ms(out, at.took);
    out.push(b'}');
}

/// `,"KEY":` (keys are ASCII without anything to escape).
fn json_key(out: &mut Vec<u8>, key: &[u8]) {
    out.extend_from_slice(b",\"");
    out.extend_from_slice(key);
    out.extend_from_slice(b"\":");
}

/// `,"KEY":"VALUE"` with the value escaped: `"`, `\` and control characters; bytes past ASCII
/// kept when the value is UTF-8, else each written as the code point of the same number.
fn json_str(out: &mut Vec<u8>, key: &[u8], v: &[u8]) {
    json_key(out, key);
    out.push(b'"');
    if v.iter().all(|&c| JSON_PLAIN[usize::from(c)]) {
        out.extend_from_slice(v);
        out.push(b'"');
        return;
    }
    let utf8 = v.is_ascii() || std::str::from_utf8(v).is_ok();
    for &c in v {
        match c {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0..0x20 | 0x7f => push_escaped_byte(out, b"\\u00", c),
            0x80.. if !utf8 => push_escaped_byte(out, b"\\u00", c),
            c => out.push(c),
        }
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc_with_microseconds() {
        let mut clock = Clock::default();
        let mut out = Vec::new();
        // 2026-11-30T10:53:45.897813Z
        clock.push(&mut out, 1_796_036_025_897_813);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "2026-11-30T10:53:45.897813Z"
        );
        let mut out = Vec::new();
        clock.push(&mut out, 951_782_400_000_001); // a leap day
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "2000-02-29T00:00:00.000001Z"
        );
        let mut out = Vec::new();
        clock.push(&mut out, 0);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "1970-01-01T00:00:00.000000Z"
        );
    }

    #[test]
    fn durations_have_three_decimals_at_most() {
        let mut out = Vec::new();
        push_ms(&mut out, Duration::from_nanos(3_787_951));
        assert_eq!(out, b"3.787");
        out.clear();
        push_ms(&mut out, Duration::from_micros(42));
        assert_eq!(out, b"0.042");
    }

    #[test]
    fn values_are_escaped() {
        let mut out = Vec::new();
        text_value(&mut out, b"curl/8.5 \"x\"\n\xff");
        assert_eq!(out, b"\"curl/8.5 \\\"x\\\"\\x0a\\xff\"");
        out.clear();
        json_str(&mut out, b"k", "é\"\u{1}".as_bytes());
        assert_eq!(
            String::from_utf8(out.clone()).unwrap(),
            ",\"k\":\"é\\\"\\u0001\""
        );
        out.clear();
        json_str(&mut out, b"k", b"\xff");
        assert_eq!(out, b",\"k\":\"\\u00ff\"");
    }

    #[test]
    fn host_ports_and_trace_ids_are_split_out() {
        assert_eq!(
            host_and_port(b"a.example:8080"),
            (&b"a.example"[..], Some(&b"8080"[..]))
        );
        assert_eq!(host_and_port(b"a.example"), (&b"a.example"[..], None));
        assert_eq!(
            host_and_port(b"[::1]:443"),
            (&b"[::1]"[..], Some(&b"443"[..]))
        );
        assert_eq!(host_and_port(b"[::1]"), (&b"[::1]"[..], None));
        let tp = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            trace_ids(tp),
            Some((
                &b"4bf92f3577b34da6a3ce929d0e0e4736"[..],
                &b"00f067aa0ba902b7"[..]
            ))
        );
        assert_eq!(trace_ids(b"00-0000-bad"), None);
    }
}
