//! One request through the stages: route, identity, limits, then forward or answer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use http::{Request, Response, Version};
use http_body::Body as _;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use tokio::time::Instant;

mod limits;
mod record;
mod upstream;

use crate::access_log::{self, Entry};
use crate::body::Sent;
use crate::config::settings::Respond;
use crate::error::ProxyError;
use crate::forward::Tunnel;
use crate::identity::{self, Arrival};
use crate::limiter;
use crate::request_id;
use crate::response::{self, Body};
use crate::runtime::{Action, Route, Runtime};
use crate::screen;
use crate::state::State;
use limits::{finish, operators, refusal};
use record::hand_over;
use upstream::{forward_to, queue_key};

/// The downstream connection a request arrived on.
#[derive(Debug)]
pub struct ClientConn {
    pub peer: SocketAddr,
    /// The peer's address as a header value (`X-Forwarded-For`, `X-Real-IP`), rendered once.
    pub peer_value: http::HeaderValue,
    pub tls: bool,
    /// The listener's `max_uri_bytes`.
    pub max_uri_bytes: usize,
    /// The worker serving the connection.
    pub worker: usize,
}

impl ClientConn {
    pub fn new(peer: SocketAddr, tls: bool, max_uri_bytes: usize, worker: usize) -> Self {
        let peer_value = crate::header_value::display(peer.ip().to_canonical())
            .unwrap_or(http::HeaderValue::from_static("unknown"));
        Self {
            peer,
            peer_value,
            tls,
            max_uri_bytes,
            worker,
        }
    }
}

/// A request's answer, the WebSocket tunnel it opened (for the connection to run once the
/// response is written), and its access-log entry (written once the response body is done).
#[derive(Debug)]
pub struct Handled {
    pub response: Response<Body>,
    /// Boxed, as WebSockets are rare: `Handled` moves whole between the stages.
    pub tunnel: Option<Box<Tunnel>>,
    /// Boxed: the entry is large, and moves with the response into its body (hyper's
    /// connection state) whether the access log is on or not.
    pub access: Option<Box<Entry>>,
    /// The concurrency slots the request holds until its response (or tunnel) is done.
    pub slots: limiter::concurrency::Guard,
    /// What the end of the response's body tells (a gRPC call's status, a cost in the
    /// trailers): where it is counted then.
    pub at_end: Option<access_log::EndTally>,
}

/// Why tollgate answered a request itself instead of its upstream, as far as the access log
/// and the answer's headers tell them apart.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Refused {
    #[default]
    No,
    /// A capped upstream had no slot for it (`503`).
    AtCapacity,
    /// An operator's ban (`control`), before any limit.
    OperatorBan,
    /// A rate limit: a 429, whose last header is a slot for the request ID.
    RateLimited,
}

/// What the stages learned about a request, for the access log and metrics.
#[derive(Debug, Default)]
struct Trace<'a> {
    route: Option<&'a Route>,
    decision: Option<limiter::Decision>,
    client_ip: Option<std::net::IpAddr>,
    /// The request body went upstream (so it was, or is being, read).
    body_taken: bool,
    /// The WebSocket tunnel the upstream accepted.
    tunnel: Option<Box<Tunnel>>,
    /// The target that answered, and the time to its response head.
    upstream: Option<(usize, std::time::Duration)>,
    /// When the upstream's response head came, if the answer was ready then (no body read
    /// whole first): the end of the request's duration, without a clock read of its own.
    head_ready: Option<Instant>,
    /// The time it waited for a slot of a capped upstream.
    queued: std::time::Duration,
    /// Why tollgate answered it itself, where the log or the answer's headers need to know.
    refused: Refused,
    /// Request body bytes received whole (buffered); a streamed body's are counted by `sent`.
    bytes_in: u64,
    sent: Sent,
    /// The concurrency slots taken for the request (the candidate config's too).
    slots: limiter::concurrency::Guard,
    /// `tollgate.keys` of a JSON access log (named when the line is written).
    keys: access_log::Digests,
    /// A gRPC call (`content-type: application/grpc`): its bodies are never buffered.
    grpc: bool,
    /// What the response said the request cost, for a limit that settles it.
    cost: Option<u64>,
    /// A response's settlement, when its head did not say what it cost: done with its
    /// trailers (or at its end without them).
    settle_later: Option<limiter::decide::settled::Deferred>,
    /// The request's trace, when tracing is on (moved into its log entry at the end).
    span: Option<Box<crate::telemetry::RequestSpan>>,
}

impl Trace<'_> {
    /// Keep the route's decision, with the identities' digests for replay (`tollgate
    /// simulate`, only with a JSON access log).
    fn decided(&mut self, route: &Route, view: &identity::RequestView<'_>, d: limiter::Decision) {
        if !route.logged_keys.is_empty() && access_log::json() {
            self.keys = route.logged_keys.digests(view);
        }
        self.decision = Some(d);
    }
}

/// One request's context through the stages (as pingora's `CTX`): what every stage reads, fixed
/// when the request arrives, and what the stages learned (`trace`).
/// `'a`: the request's config, connection and state; `'c`: the request's own locals, borrowed
/// by the stages (the trace is the request's, read after the stages to log and count it).
struct Ctx<'a, 'c> {
    state: &'a State,
    rt: &'a Runtime,
    conn: &'a ClientConn,
    started: Instant,
    request_id: &'c http::HeaderValue,
    /// The peer is one of `trusted_proxies`: asked once per request.
    peer_trusted: bool,
    trace: &'c mut Trace<'a>,
}

/// Serve one request. Loads the config snapshot exactly once; every error becomes its response
/// here and nowhere else.
pub async fn handle(state: &State, conn: &ClientConn, req: Box<Request<Incoming>>) -> Handled {
    let started = Instant::now();
    let runtime = state.current();
    let peer_trusted = identity::is_trusted(conn.peer.ip(), &runtime.settings.trusted_proxies);
    let id_header = &runtime.settings.request_id_header;
    let request_id = request_id::resolve(req.headers(), id_header, || peer_trusted);
    let span = (runtime.tracer.as_ref()).map(|t| t.begin(req.headers()));
    let traced = span.as_ref().is_some_and(|s| s.may_export());
    let entry = (access_log::enabled() || traced).then(|| {
        Box::new(Entry::begin(
            &req,
            (conn.peer.ip(), &conn.peer_value),
            conn.tls,
            request_id.clone(),
            started,
        ))
    });
    let version = req.version();
    let has_body = !req.body().is_end_stream();
    let grpc_call = response::grpc::is_call(&req);
    let mut trace = Trace {
        grpc: grpc_call,
        span,
        ..Trace::default()
    };
    let mut cx = Ctx {
        state,
        rt: &runtime,
        conn,
        started,
        request_id: &request_id,
        peer_trusted,
        trace: &mut trace,
    };
    let admitted = Admission::enter(state, runtime.settings.max_inflight);
    let outcome = if admitted.is_none() {
        Err(ProxyError::Overloaded)
    } else if grpc_call && version < Version::HTTP_2 {
        Err(ProxyError::GrpcOverHttp1)
    } else {
        pipeline(&mut cx, req).await
    };
    if let (Err(e), Some(span)) = (&outcome, trace.span.as_mut()) {
        span.notes.error = Some(e.kind());
    }
    // A gRPC call over HTTP/2 gets tollgate's own answers in gRPC's form.
    let grpc_answer = grpc_call && version >= Version::HTTP_2;
    let grpc = grpc_answer.then_some(runtime.settings.grpc_limited_status);
    let (mut res, close) = answer(outcome, grpc, trace.refused);
    // An unread request body must never be parsed as the next request: close instead.
    if version <= Version::HTTP_11 && (close || (has_body && !trace.body_taken)) {
        res.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
    }
    // Every answer carries the ID, tollgate's own included.
    let slotted = trace.refused == Refused::RateLimited;
    response::add_request_id(res.headers_mut(), id_header, request_id, slotted);
    hand_over(state, &mut trace, res, started, entry)
}

/// The response for a request's outcome, and whether its connection must close: an error
/// becomes its response here; tollgate's own answers to a gRPC call (`grpc`: the status a
/// rate limit's refusal gets) take gRPC's form.
fn answer(
    outcome: Result<Response<Body>, ProxyError>,
    grpc: Option<u8>,
    refused: Refused,
) -> (Response<Body>, bool) {
    let (res, close, ours) = match outcome {
        Ok(res) => (res, false, refused != Refused::No),
        Err(err) => {
            tracing::debug!(error = %err, "request failed");
            (response::from_error(&err), err.closes_connection(), true)
        }
    };
    if let Some(limited) = grpc.filter(|_| ours) {
        return (response::grpc::answer(res, limited), close);
    }
    (res, close)
}

/// A request counted against `max_inflight` while it lives.
struct Admission<'a>(&'a AtomicUsize);

impl<'a> Admission<'a> {
    /// Count a request in `state.inflight`; `None` (still counted until dropped, and the
    /// refusal counted) past `max`, or while memory is past `max_rss`.
    fn enter(state: &'a State, max: usize) -> Option<Self> {
        let before = state.inflight.fetch_add(1, Ordering::AcqRel);
        let admitted = Self(&state.inflight);
        if state.memory_over.load(Ordering::Relaxed) {
            state.metrics.memory_refused_requests.inc();
            return None;
        }
        if before >= max {
            state.metrics.overloaded.inc();
            return None;
        }
        Some(admitted)
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The stages in order: screen, route, client, operators' entries, limits (and the candidate
/// config's beside them), then forward or answer. Each stage returns a value or an error; none
/// writes to the socket.
async fn pipeline(
    cx: &mut Ctx<'_, '_>,
    mut req: Box<Request<Incoming>>,
) -> Result<Response<Body>, ProxyError> {
    let body = !req.body().is_end_stream();
    screen::screen(&mut req, cx.conn.max_uri_bytes, body)?;
    let route = route(cx, &req)?;
    let client_ip = client(cx, &req);
    // The request's view and its limits in a block of their own: what is alive when the
    // upstream is awaited is kept in this future, and they are not needed then.
    let queue = {
        let arrival = Arrival::of(&req, client_ip);
        let jwt = cx.rt.settings.jwt.as_deref().map(|v| arrival.jwt(v)); // checked on first use
        let view = arrival.view(route.fold_path, jwt.as_ref());
        let control = cx.state.control.active();
        let tuned = match operators(cx, control.as_deref(), &view, route) {
            Ok(tuned) => tuned,
            Err(refused) => return Ok(*refused),
        };
        let asked = (&view, &tuned[..], &arrival);
        let decision = match limits::in_process(cx, route, asked) {
            Some(decision) => decision,
            None => crate::boxed(|| limits::shared(cx, route, asked)).await,
        };
        cx.trace.decided(route, &view, decision);
        if let Some(refused) = refusal(cx, route) {
            return refused;
        }
        queue_key(&route.action, &view, cx.trace.decision.as_ref(), client_ip)
    };
    let mut res = match &route.action {
        Action::Forward(upstream) => {
            forward_to(cx, route, upstream, req, (client_ip, queue)).await?
        }
        Action::Respond(r) => respond(r),
    };
    finish(cx, route, &mut res).await;
    Ok(res)
}

/// The live route of the request, or `NoRoute` (the candidate config decides it anyway); a
/// declared body over the route's `max_body` is refused here, before anything is read.
fn route<'a, B: http_body::Body>(
    cx: &mut Ctx<'a, '_>,
    req: &Request<B>,
) -> Result<&'a Route, ProxyError> {
    let rt = cx.rt;
    let Some(route) = rt.find(req) else {
        if let Some(c) = &rt.candidate {
            let client_ip = client_ip(cx, req);
            let arrival = Arrival::of(req, client_ip);
            let verdict = c.evaluate(&arrival, cx.state.clock.at(cx.started), &mut cx.trace.slots);
            if let Some(span) = cx.trace.span.as_mut() {
                span.notes.candidate = Some(verdict);
            }
        }
        return Err(ProxyError::NoRoute);
    };
    cx.trace.route = Some(route);
    // A request without a body (every GET) declares nothing worth a header lookup.
    if !req.body().is_end_stream() && declared_length(req).is_some_and(|n| n > route.body.max_bytes)
    {
        return Err(ProxyError::PayloadTooLarge);
    }
    Ok(route)
}

/// The client address, through the trusted proxies.
fn client<B>(cx: &mut Ctx<'_, '_>, req: &Request<B>) -> std::net::IpAddr {
    let ip = client_ip(cx, req);
    cx.trace.client_ip = Some(ip);
    ip
}

fn client_ip<B>(cx: &Ctx<'_, '_>, req: &Request<B>) -> std::net::IpAddr {
    let settings = &cx.rt.settings;
    identity::client_ip_behind(
        (cx.conn.peer.ip(), cx.peer_trusted),
        req.headers(),
        &settings.trusted_proxies,
        settings.client_ip_header,
    )
}

/// The Content-Length the client declared, if any.
fn declared_length<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

fn respond(r: &Respond) -> Response<Body> {
    let mut res: Response<Body> = Response::new(Either::Right(Full::new(r.body.clone())));
    *res.status_mut() = r.status;
    *res.headers_mut() = r.headers.clone();
    if !res.headers().contains_key(http::header::CONTENT_TYPE) {
        res.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain; charset=utf-8"),
        );
    }
    res
}
