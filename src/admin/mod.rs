//! The admin listener: `/healthz`, `/readyz`, `/metrics`, `/config`, the `/dashboard` page,
//! and the authenticated API under `/api/` (`api`). Never on the proxy ports.

mod api;
mod call;
mod dashboard;
mod entries;
mod sampler;

use std::convert::Infallible;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::limiter::FailurePolicy;
use crate::metrics::{CertSample, Format, Scrape, TargetSample};
use crate::response::{fixed, Body};
use crate::runtime::Runtime;
use crate::state::State;

/// Serve the admin endpoints on `listener` until `stop` (the end of the drain: `/readyz`
/// answers 503 throughout the shutdown rather than vanishing with the proxy listeners).
///
/// The listener has none of the proxy listeners' settings, so it keeps fixed bounds of its own:
/// at most `MAX_CONNECTIONS` open, a request head within `HEAD_TIMEOUT` (a keep-alive
/// connection waiting for its next request too), and a connection closed after `LIFETIME`
/// whatever it does, so no client can hold it open. A connection past the bound closes the
/// oldest one rather than being refused: a probe (`/healthz`, `/readyz`) is answered at once
/// even while stalled request heads fill the listener.
pub async fn serve(listener: TcpListener, state: Arc<State>, mut stop: watch::Receiver<bool>) {
    // The dashboard's history, sampled while the admin listener serves it, stopped with it.
    tokio::spawn(sampler::run(state.clone(), stop.clone()));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT);
    let open = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    // The connections open, oldest first: the one closed to make room for a newcomer.
    let live: Arc<Registry> = Arc::default();
    let mut next_id = 0u64;
    loop {
        let stream = tokio::select! {
            _ = stop.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(_) => continue,
            },
        };
        let (stream, peer) = stream;
        let slot = match open.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                let oldest = live.lock().pop_first();
                if let Some((_, task)) = oldest {
                    tracing::debug!(%peer, "admin listener: {MAX_CONNECTIONS} connections open, closing the oldest");
                    task.abort();
                }
                // The aborted task gives its slot back as it is dropped.
                match open.clone().acquire_owned().await {
                    Ok(slot) => slot,
                    Err(_) => return,
                }
            }
        };
        let state = state.clone();
        let service = service_fn(move |mut req: Request<Incoming>| {
            // Who called, for the admin API's log lines.
            req.extensions_mut().insert(peer);
            let state = state.clone();
            async move { Ok::<_, Infallible>(handle(&state, req).await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let (id, registry) = (next_id, Arc::clone(&live));
        next_id += 1;
        // Held by the task: dropped (the slot given back, the entry gone) when it ends or is
        // aborted.
        let guard = Registered {
            id,
            registry: Arc::clone(&live),
            _slot: slot,
        };
        // Registered before the task can end and take its entry out.
        let mut open_now = registry.lock();
        let task = tokio::spawn(async move {
            let _guard = guard;
            let _ = tokio::time::timeout(LIFETIME, conn).await;
        });
        open_now.insert(id, task.abort_handle());
    }
}

type Registry = parking_lot::Mutex<std::collections::BTreeMap<u64, tokio::task::AbortHandle>>;

/// An admin connection's place: its slot, and its entry among the open ones.
struct Registered {
    id: u64,
    registry: Arc<Registry>,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}

/// Admin connections open at once: scrapers, probes and a few dashboards need a handful.
const MAX_CONNECTIONS: usize = 64;
/// A request head (or, on a kept-alive connection, the next one) must arrive within this.
const HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The longest an admin connection stays open.
const LIFETIME: std::time::Duration = std::time::Duration::from_mins(5);

async fn handle(state: &State, req: Request<Incoming>) -> Response<Body> {
    const TEXT: &str = "text/plain; charset=utf-8";
    if req.uri().path().starts_with("/api/") {
        return api::handle(state, req).await;
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return fixed(StatusCode::METHOD_NOT_ALLOWED, TEXT, "GET only\n");
    }
    if let Some(res) = dashboard::asset(req.uri().path()) {
        return res;
    }
    match req.uri().path() {
        "/healthz" => fixed(StatusCode::OK, TEXT, "ok\n"),
        "/readyz" => {
            let runtime = state.runtime.load_full();
            match not_ready(state, &runtime).await {
                None => fixed(StatusCode::OK, TEXT, "ready\n"),
                Some(why) => fixed(
                    StatusCode::SERVICE_UNAVAILABLE,
                    TEXT,
                    format!("not ready: {why}\n"),
                ),
            }
        }
        "/metrics" => {
            let accept = req.headers().get(http::header::ACCEPT);
            let format = Format::negotiate(accept.and_then(|v| v.to_str().ok()));
            let runtime = state.runtime.load();
            let body = state.metrics.render(
                format,
                Scrape {
                    limits: runtime.limits(),
                    redis: runtime.redis.as_deref(),
                    targets: &target_samples(&runtime),
                    queues: &queue_samples(&runtime),
                    certs: &cert_samples(&runtime),
                },
            );
            fixed(StatusCode::OK, format.content_type(), body)
        }
        "/config" => {
            let runtime = state.runtime.load();
            fixed(
                StatusCode::OK,
                "application/yaml",
                redact(&runtime.settings.source),
            )
        }
        _ => fixed(
            StatusCode::NOT_FOUND,
            TEXT,
            "not found: try /healthz, /readyz, /metrics, /config, /dashboard or /api/v1/\n",
        ),
    }
}

/// Every live upstream target's health and load, for a scrape.
fn target_samples(runtime: &Runtime) -> Vec<TargetSample> {
    let now = tokio::time::Instant::now();
    let mut samples = Vec::new();
    for u in &runtime.upstreams {
        for (i, t) in u.targets.iter().enumerate() {
            samples.push(TargetSample {
                upstream: u.name.clone(),
                target: t.to_string(),
                healthy: u.is_healthy(i, now),
                in_flight: u.in_flight(i),
                cap: u.cap(i),
            });
        }
    }
    samples
}

/// Every capped upstream's queue depth, for a scrape.
fn queue_samples(runtime: &Runtime) -> Vec<(std::sync::Arc<str>, usize)> {
    (runtime.upstreams.iter())
        .filter_map(|u| Some((u.name.clone(), u.capacity()?.queued)))
        .collect()
}

/// Every live listener certificate's expiry, for a scrape.
fn cert_samples(runtime: &Runtime) -> Vec<CertSample> {
    let mut samples = Vec::new();
    for l in &runtime.settings.listeners {
        let Some(tls) = &l.tls else { continue };
        for (files, not_after) in tls.files.iter().zip(&tls.not_after) {
            samples.push(CertSample {
                listener: l.address.to_string(),
                cert: files.cert.display().to_string(),
                not_after: *not_after,
            });
        }
    }
    samples
}

/// Ready means: not shutting down (from the signal on, through `shutdown_delay` and the
/// drain, so a load balancer stops sending new requests while the admin listener still
/// answers), under the memory budget (past it new requests get 503 anyway), a config is live (always true once serving) and, with Redis, either Redis runs
/// the bucket script or no limit would reject for want of it (every limit fails open or local).
async fn not_ready(state: &State, runtime: &Runtime) -> Option<String> {
    if state.draining() {
        return Some("shutting down".into());
    }
    if state.memory_over.load(std::sync::atomic::Ordering::Relaxed) {
        return Some("resident memory is past max_rss: new requests get 503".into());
    }
    let redis = runtime.redis.as_ref()?;
    let Err(why) = redis.script_runs().await else {
        return None;
    };
    let any_closed = runtime
        .limits()
        .any(|l| l.on_failure == FailurePolicy::Closed && !l.shadow);
    any_closed.then(|| format!("Redis cannot decide limits ({why}) and some limits fail closed"))
}

/// The config text with secrets masked: passwords of URLs (`scheme://user:password@host`),
/// the values of `password:` keys, of identity exemptions (`header:X-API-Key=...`, often an
/// internal key) and of `match.headers` conditions (a shared secret header, often).
pub fn redact(text: &str) -> String {
    let text = redact_urls(text);
    let mut out = String::with_capacity(text.len());
    // The indentation of a block-style `headers:` mapping whose values are being masked.
    let mut headers_block: Option<usize> = None;
    for line in text.split_inclusive('\n') {
        let indent = line.len() - line.trim_start_matches([' ', '-']).len();
        let blank = line.trim().is_empty() || line.trim_start().starts_with('#');
        let line = match headers_block {
            Some(at) if blank || indent > at => mask_value(line),
            _ => {
                headers_block = None;
                let (masked, opens) = redact_headers(line);
                if opens {
                    headers_block = Some(indent);
                }
                masked
            }
        };
        out.push_str(&redact_passwords(&redact_exemptions(&line)));
    }
    out
}

/// `key: value` -> `key: ***` (a line with no value, such as a comment, unchanged).
fn mask_value(line: &str) -> String {
    match line.split_once(':') {
        Some((key, value)) if !value.trim().is_empty() && !key.trim_start().starts_with('#') => {
            let end = if line.ends_with('\n') { "\n" } else { "" };
            format!("{key}: ***{end}")
        }
        _ => line.to_owned(),
    }
}

/// The values of a `headers: { NAME: VALUE, ... }` flow mapping masked, and whether the line
/// opens a block-style `headers:` mapping instead.
fn redact_headers(line: &str) -> (String, bool) {
    const KEY: &str = "headers:";
    let Some(at) = line.find(KEY).filter(|&at| {
        let before = line[..at].trim_end_matches([' ', '\t']);
        before.is_empty() || before.ends_with(['{', ',', '-'])
    }) else {
        return (line.to_owned(), false);
    };
    let tail = line[at + KEY.len()..].trim_start();
    if tail.trim().is_empty() || tail.starts_with('#') {
        return (line.to_owned(), true);
    }
    let Some(open) = tail.strip_prefix('{') else {
        return (line.to_owned(), false);
    };
    let Some(close) = open.find('}') else {
        return (line.to_owned(), false);
    };
    let pairs: Vec<String> = open[..close]
        .split(',')
        .map(|pair| match pair.split_once(':') {
            Some((name, _)) => format!("{}: ***", name.trim()),
            None => pair.trim().to_owned(),
        })
        .collect();
    let head = &line[..at + KEY.len()];
    let rest = &open[close..];
    (format!("{head} {{ {} {rest}", pairs.join(", ")), false)
}

/// `password: anything` -> `password: ***`, in block and flow style.
fn redact_passwords(line: &str) -> String {
    const KEY: &str = "password:";
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find(KEY) {
        let (head, tail) = rest.split_at(at + KEY.len());
        // Only as a key: at the line's start or after indentation, `{`, `,` or `- `.
        let raw = head[..at].strip_suffix(['"', '\'']).unwrap_or(&head[..at]);
        let before = raw.trim_end();
        let separated = raw.is_empty() || raw.ends_with([' ', '\t', '{', ',']);
        out.push_str(head);
        if !separated || !(before.is_empty() || before.ends_with(['{', ',', '-'])) {
            rest = tail;
            continue;
        }
        let value = tail.trim_start_matches([' ', '\t']);
        let skipped = tail.len() - value.len();
        // A quoted value ends at its closing quote (it may hold `,` or `}`).
        let end = match value.chars().next() {
            Some(q @ ('"' | '\'')) => value[1..]
                .find(q)
                .map_or(value.len(), |i| i + 2)
                .min(value.find(['\n', '\r']).unwrap_or(value.len())),
            // In a flow mapping a plain value ends at `,` or `}` (past a `${VAR}`).
            _ if before.ends_with(['{', ',']) => {
                let from = if value.starts_with("${") {
                    value.find('}').map_or(0, |i| i + 1)
                } else {
                    0
                };
                value[from..]
                    .find([',', '}', '\n', '\r'])
                    .map_or(value.len(), |i| i + from)
            }
            _ => value.find(['\n', '\r']).unwrap_or(value.len()),
        } + skipped;
        if tail[..end].trim().is_empty() {
            rest = tail;
            continue;
        }
        out.push_str(" ***");
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

fn redact_exemptions(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = ["header:", "cookie:", "query:", "bearer="]
        .iter()
        .filter_map(|k| rest.find(k))
        .min()
    {
        let (head, tail) = rest.split_at(at);
        out.push_str(head);
        let end = tail
            .find(|c: char| {
                c == '"' || c == '\'' || c == ',' || c == ']' || c == '}' || c.is_whitespace()
            })
            .unwrap_or(tail.len());
        let item = &tail[..end];
        match item.split_once('=') {
            Some((source, _)) => {
                out.push_str(source);
                out.push_str("=***");
            }
            None => out.push_str(item),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

fn redact_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| {
                c == '/' || c == '"' || c == '\'' || c == ',' || c == ']' || c.is_whitespace()
            })
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..=colon]);
                        out.push_str("***");
                    }
                    None => out.push_str("***"),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_in_urls_are_masked() {
        assert_eq!(
            redact("url: rediss://app:s3cret@redis:6380/0\nx: http://h:1/"),
            "url: rediss://app:***@redis:6380/0\nx: http://h:1/"
        );
        assert_eq!(
            redact("[redis://:pw@a:1, redis://b:2]"),
            "[redis://:***@a:1, redis://b:2]"
        );
        assert_eq!(redact("redis://token@a:1"), "redis://***@a:1");
        assert_eq!(
            redact("exempt: [10.0.0.0/8, \"header:X-API-Key=internal-batch\"]\nkey: [header:X-API-Key, ip]\n"),
            "exempt: [10.0.0.0/8, \"header:X-API-Key=***\"]\nkey: [header:X-API-Key, ip]\n"
        );
    }

    #[test]
    fn password_keys_are_masked() {
        assert_eq!(
            redact("    password: s3cret\n    username: app\n"),
            "    password: ***\n    username: app\n"
        );
        assert_eq!(
            redact("sentinel: { master: m, password: \"a,b\" , nodes: [h:1] }\n"),
            "sentinel: { master: m, password: *** , nodes: [h:1] }\n"
        );
        assert_eq!(
            redact("  - password: ${REDIS_PASSWORD}\n"),
            "  - password: ***\n"
        );
        assert_eq!(
            redact("redis: { password: ${PW}, url: x }\n"),
            "redis: { password: ***, url: x }\n"
        );
        // Not a key: left alone.
        assert_eq!(redact("x: my-password: 1\n"), "x: my-password: 1\n");
    }

    #[test]
    fn match_header_values_are_masked() {
        assert_eq!(
            redact("    match: { path: /x, headers: { X-Tenant: acme, X-Key: \"s3\" } }\n"),
            "    match: { path: /x, headers: { X-Tenant: ***, X-Key: *** } }\n"
        );
        assert_eq!(
            redact("    match:\n      headers:\n        X-Internal: s3cret\n\n        X-B: b\n      path: /a\n    upstream: app\n"),
            "    match:\n      headers:\n        X-Internal: ***\n\n        X-B: ***\n      path: /a\n    upstream: app\n"
        );
        // Other keys ending in `headers` are not a header condition.
        assert_eq!(
            redact("rate_limit_headers:\n  ietf: true\nmax_headers: 100\n"),
            "rate_limit_headers:\n  ietf: true\nmax_headers: 100\n"
        );
    }
}
