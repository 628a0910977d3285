//! Forwarding upstream: target choice, the request rewrite, a pooled keep-alive client, streaming.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::header::{CONNECTION, HOST, UPGRADE};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, Version};
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;

use crate::body::Guarded;
use crate::error::ProxyError;
use crate::limiter::Small;
use crate::pool::{Connector, Pool, Pooled, SendError};
use crate::server::ReadNoted;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// A named group of targets with its own connection pool.
#[derive(Debug)]
pub struct Upstream {
    pub name: Arc<str>,
    pub scheme: Scheme,
    pub targets: Vec<Authority>,
    pub connect_timeout: Duration,
    pub timeout: Duration,
    /// Identifies the settings it was built from: a reload keeps an upstream (and its warm
    /// connections) whose fingerprint did not change.
    pub fingerprint: [u8; 32],
    next: AtomicUsize,
    /// The upstream's response-time histogram, looked up once.
    pub seconds: std::sync::OnceLock<crate::sharded::Histogram>,
    /// `scheme://target/` of each target, for the connector.
    target_uris: Vec<Uri>,
    /// One pool per worker thread: a worker reuses connections whose tasks run on its own
    /// thread, so a request never wakes another core.
    pools: Vec<Arc<Pool>>,
}

/// Idle connections each worker keeps per target when `keepalive.max_idle` is not set. A cap
/// below the requests in flight to a target at the peaks of normal load makes its connections
/// close and reopen all the time (a returned connection finds the pool full): 256 for the whole
/// proxy halved the rate of 640 concurrent HTTP/2 streams (82.8k to 43.8k req/s, benches'
/// scenario 5), with 14,000 connections closed in 3 s. So the default only bounds what a burst
/// leaves behind.
pub const DEFAULT_MAX_IDLE_PER_WORKER: usize = 1024;

/// Worker threads serving requests (each gets its own upstream pools).
static WORKERS: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    /// This thread's worker number; `usize::MAX` on threads that are not workers.
    static WORKER_ID: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// How many worker threads serve requests.
pub fn workers() -> usize {
    WORKERS.load(Ordering::Relaxed)
}

/// The worker this thread is, if it is one.
pub fn worker_id() -> Option<usize> {
    let id = WORKER_ID.with(std::cell::Cell::get);
    (id != usize::MAX).then_some(id)
}

/// Set before configs are compiled: how many pools each upstream keeps.
pub fn set_workers(n: usize) {
    WORKERS.store(n.max(1), Ordering::Relaxed);
}

/// The runtimes of the worker threads started so far.
static WORKER_RUNTIMES: parking_lot::Mutex<Vec<tokio::runtime::Handle>> =
    parking_lot::Mutex::new(Vec::new());

/// Called once on each worker thread, with the worker's runtime.
pub fn register_worker(id: usize, runtime: tokio::runtime::Handle) {
    WORKER_ID.with(|w| w.set(id));
    WORKER_RUNTIMES.lock().push(runtime);
}

/// Run `task()` on every worker thread started so far, each in a task of its own.
pub fn on_every_worker<F, Fut>(task: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    for runtime in WORKER_RUNTIMES.lock().iter() {
        runtime.spawn(task());
    }
}

/// How an upstream is reached: its targets, scheme, timeouts and (for https) trust.
#[derive(Debug, Clone)]
pub struct UpstreamSpec {
    pub scheme: Scheme,
    pub targets: Vec<Authority>,
    pub connect_timeout: Duration,
    pub timeout: Duration,
    /// Idle connections kept per target, all workers together; `None`:
    /// `DEFAULT_MAX_IDLE_PER_WORKER` per worker.
    pub max_idle: Option<usize>,
    /// Idle connections are closed after this.
    pub idle_timeout: Duration,
    /// Trust anchors for https targets (the system's, or a configured CA).
    pub tls: Arc<rustls::ClientConfig>,
}

/// The TLS client settings for https upstreams: the system's roots, or only the CA in `ca`.
pub fn client_tls(ca: Option<&std::path::Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| format!("cannot read CA file {}: {e}", path.display()))?;
            for cert in certs {
                let cert =
                    cert.map_err(|e| format!("cannot parse CA file {}: {e}", path.display()))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("unusable CA certificate in {}: {e}", path.display()))?;
            }
            if roots.is_empty() {
                return Err(format!("no certificate in CA file {}", path.display()));
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                tracing::warn!("no system CA certificates found: https upstreams need `tls.ca`");
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

impl Upstream {
    pub fn new(name: &str, spec: UpstreamSpec, fingerprint: [u8; 32]) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(spec.connect_timeout));
        tcp.set_nodelay(true);
        tcp.enforce_http(false);
        // A plain-text upstream gets plain sockets: no TLS-or-not wrapper on every read.
        let connector = if spec.scheme == Scheme::HTTPS {
            Connector::Tls(
                HttpsConnectorBuilder::new()
                    .with_tls_config((*spec.tls).clone())
                    .https_only()
                    .enable_http1()
                    .wrap_connector(tcp),
            )
        } else {
            Connector::Plain(tcp)
        };
        let workers = WORKERS.load(Ordering::Relaxed).max(1);
        // Each worker keeps its share of the idle connections, rounded up.
        let max_idle = spec
            .max_idle
            .map_or(DEFAULT_MAX_IDLE_PER_WORKER, |n| n.div_ceil(workers));
        let pools = (0..workers)
            .map(|_| {
                Arc::new(Pool::new(
                    connector.clone(),
                    spec.targets.len(),
                    max_idle,
                    spec.idle_timeout,
                ))
            })
            .collect();
        let target_uris = spec
            .targets
            .iter()
            .map(|t| {
                Uri::builder()
                    .scheme(spec.scheme.clone())
                    .authority(t.clone())
                    .path_and_query("/")
                    .build()
                    .unwrap_or_default()
            })
            .collect();
        Self {
            name: name.into(),
            scheme: spec.scheme,
            targets: spec.targets,
            connect_timeout: spec.connect_timeout,
            timeout: spec.timeout,
            fingerprint,
            next: AtomicUsize::new(0),
            seconds: std::sync::OnceLock::new(),
            target_uris,
            pools,
        }
    }

    /// Close idle connections past their timeout, in every worker's pool.
    pub fn expire_idle(&self) {
        for pool in &self.pools {
            pool.expire();
        }
    }

    fn pool(&self) -> &Arc<Pool> {
        let id = worker_id().unwrap_or(0);
        &self.pools[id % self.pools.len()]
    }

    /// The next target, round robin: its index.
    fn pick(&self) -> usize {
        // One target (the common case): no write to a counter every worker shares.
        if self.targets.len() == 1 {
            return 0;
        }
        self.next.fetch_add(1, Ordering::Relaxed) % self.targets.len()
    }
}

/// What the rewrite needs to know about the downstream connection.
// Four independent facts about one request, not a state machine in disguise.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug, Clone, Copy)]
pub struct Downstream<'a> {
    pub peer: IpAddr,
    /// `peer`, rendered once per connection.
    pub peer_value: &'a HeaderValue,
    pub peer_trusted: bool,
    pub tls: bool,
    /// The client address tollgate decided on (sent as `X-Real-IP`).
    pub client_ip: IpAddr,
    /// The route proxies WebSocket upgrades.
    pub websocket_allowed: bool,
    /// The route's idle timeout for an open tunnel.
    pub websocket_idle: Duration,
    /// Headers with `_` in their names go upstream (else they are dropped).
    pub underscores: bool,
    /// The connection's place for a WebSocket tunnel.
    pub tunnel: &'a TunnelSlot,
}

/// Send `req` to one of the upstream's targets and return its response head, the body still
/// streaming. Connection refused is `UpstreamUnreachable` (502); no response head within the
/// upstream's `timeout`, or no connection within `connect_timeout`, is `UpstreamTimeout` (504).
/// `now`: about now (a request without a body is sent from then on).
pub async fn send(
    upstream: &Upstream,
    mut req: Box<Request<Guarded>>,
    down: Downstream<'_>,
    now: tokio::time::Instant,
) -> Result<Response<Pooled>, ProxyError> {
    // Taken before the rewrite strips the headers that ask for it.
    let websocket = down.websocket_allowed && is_websocket_upgrade(req.headers());
    let client_side = websocket.then(|| hyper::upgrade::on(&mut *req));
    let target = upstream.pick();
    rewrite(&mut req, &upstream.targets[target], down)?;
    if websocket {
        let headers = req.headers_mut();
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(UPGRADE, HeaderValue::from_static("websocket"));
    }
    let sent = req.body().sent();
    let pool = upstream.pool();
    let uri = &upstream.target_uris[target];
    // `timeout` runs from the moment the request is fully sent: until then the route's body
    // limits judge the client, and the connect timeout the connection. A request without a
    // body is sent now, and its connection's task keeps the deadline; one whose body is still
    // streaming gets a timer that starts when the body is done.
    let head_by = sent.is_done().then(|| now + upstream.timeout);
    // Pinned in place: awaited in one of two ways below, it has one slot in this future.
    let mut exchange = std::pin::pin!(pool.send(target, uri, req, now, head_by));
    let exchanged = if head_by.is_some() {
        exchange.await
    } else {
        let head_deadline = async {
            sent.wait().await;
            tokio::time::sleep(upstream.timeout).await;
        };
        tokio::select! {
            // The response first: no random draw per poll.
            biased;
            exchanged = &mut exchange => exchanged,
            () = head_deadline => return Err(ProxyError::UpstreamTimeout),
        }
    };
    let (mut res, mut lease) = exchanged.map_err(|e| classify(&e))?;
    // Only a switch of protocols needs the upstream's `Upgrade` after the strip.
    let upgrade = (res.status() == StatusCode::SWITCHING_PROTOCOLS)
        .then(|| res.headers().get(UPGRADE).cloned())
        .flatten();
    strip_hop_by_hop(res.headers_mut());
    if let (Some(client_side), StatusCode::SWITCHING_PROTOCOLS) = (client_side, res.status()) {
        let headers = res.headers_mut();
        headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(
            UPGRADE,
            upgrade.unwrap_or(HeaderValue::from_static("websocket")),
        );
        tunnel(
            client_side,
            hyper::upgrade::on(&mut res),
            down.websocket_idle,
            down.tunnel,
        );
    }
    if res.status() == StatusCode::SWITCHING_PROTOCOLS {
        // The connection now belongs to the tunnel (or is useless): never back in the pool.
        lease = None;
    }
    Ok(res.map(|body| Pooled::new(body, lease)))
}

/// `Connection: upgrade` with `Upgrade: websocket` (HTTP/1.1 only; the limit was already
/// checked on this handshake request).
fn is_websocket_upgrade(headers: &HeaderMap) -> bool {
    let connection_upgrade = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    connection_upgrade
        && headers
            .get(UPGRADE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("websocket"))
}

/// The two sides of a WebSocket tunnel, once both have switched protocols.
#[derive(Debug)]
pub struct Tunnel {
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    /// Closed after this long without a byte either way.
    idle: Duration,
}

/// Where a request leaves its tunnel for the connection it arrived on: the connection's task
/// runs it once hyper hands the socket over, so the tunnel keeps the connection's slot under
/// `max_connections`, counts as an open connection, and is part of the shutdown drain.
pub type TunnelSlot = parking_lot::Mutex<Option<Tunnel>>;

/// Leave the tunnel for the connection's task (HTTP/1.1: one request at a time, so one tunnel).
fn tunnel(
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    idle: Duration,
    slot: &TunnelSlot,
) {
    *slot.lock() = Some(Tunnel {
        client,
        upstream,
        idle,
    });
}

/// Copy bytes both ways until either side closes, or nothing moved for the route's
/// `timeouts.websocket_idle`.
pub async fn run_tunnel(t: Tunnel) {
    let (client, upstream) = match tokio::join!(t.client, t.upstream) {
        (Ok(c), Ok(u)) => (c, u),
        (c, u) => {
            tracing::debug!(
                client = c.is_ok(),
                upstream = u.is_ok(),
                "websocket upgrade failed"
            );
            return;
        }
    };
    // When bytes last moved either way, in milliseconds since the tunnel opened.
    let started = tokio::time::Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let touch = || {
        let last = last.clone();
        move || {
            let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            last.store(ms, Ordering::Relaxed);
        }
    };
    let mut client = ReadNoted::new(TokioIo::new(client), touch());
    let mut upstream = ReadNoted::new(TokioIo::new(upstream), touch());
    let idle = async {
        loop {
            let since = Duration::from_millis(last.load(Ordering::Relaxed));
            let deadline = started + since + t.idle;
            if tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    };
    tokio::select! {
        copied = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {
            if let Err(e) = copied {
                tracing::debug!(error = %e, "websocket tunnel ended with an error");
            }
        }
        () = idle => tracing::debug!(idle = ?t.idle, "websocket tunnel idle: closed"),
    }
}

fn classify(e: &SendError) -> ProxyError {
    if let SendError::HeadTimeout = e {
        return ProxyError::UpstreamTimeout;
    }
    let e = e.as_error();
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return ProxyError::UpstreamTimeout;
            }
        }
        source = s.source();
    }
    let mut chain = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        chain.push_str(": ");
        chain.push_str(&s.to_string());
        source = s.source();
    }
    tracing::debug!(error = %chain, "upstream request failed");
    ProxyError::UpstreamUnreachable
}

fn rewrite(
    req: &mut Request<Guarded>,
    target: &Authority,
    down: Downstream<'_>,
) -> Result<(), ProxyError> {
    // Upstream requests are origin-form: the path and query only.
    let authority = if req.uri().scheme().is_some() || req.uri().authority().is_some() {
        let authority = req.uri().authority().cloned();
        let path = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        *req.uri_mut() = Uri::from(path);
        authority
    } else {
        None
    };
    *req.version_mut() = Version::HTTP_11;
    let headers = req.headers_mut();
    // HTTP/2 carries the host in `:authority`; HTTP/1.1 upstreams need it as `Host`; an
    // HTTP/1.0 request without either still needs one (the target's).
    let original_host = match headers.get(HOST) {
        Some(host) => Some(host.clone()),
        None => {
            let from_authority = authority
                .map(|a| HeaderValue::from_str(a.as_str()))
                .transpose()
                .map_err(|_| ProxyError::BadRequest)?;
            let host = match &from_authority {
                Some(host) => host.clone(),
                None => {
                    HeaderValue::from_str(target.as_str()).map_err(|_| ProxyError::BadRequest)?
                }
            };
            headers.insert(HOST, host);
            from_authority
        }
    };
    // One pass over the names finds everything to drop; most requests have nothing.
    strip_hop_by_hop_and(headers, |k| {
        // Backends that fold `_` into `-` (CGI, PHP-FPM, many frameworks: both become
        // `HTTP_X_FORWARDED_FOR`) would read `X_Forwarded_For` or `X_Real_IP` as the
        // forwarding headers tollgate controls. nginx drops them by default too.
        (!down.underscores && k.as_str().contains('_'))
            // Whatever an untrusted client says about forwarding is dropped, not passed on to
            // a backend that may believe it (X-Forwarded-For is replaced below).
            || (!down.peer_trusted
                && (*k == http::header::FORWARDED
                    || (k.as_str().starts_with("x-forwarded-") && *k != X_FORWARDED_FOR)))
    });
    if down.client_ip == down.peer {
        headers.insert(X_REAL_IP, down.peer_value.clone());
    } else if let Ok(v) = HeaderValue::try_from(down.client_ip.to_string()) {
        headers.insert(X_REAL_IP, v);
    }
    forwarded_for(headers, down);
    // From an untrusted peer these were just removed: no need to look.
    if !(down.peer_trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        let proto = if down.tls { "https" } else { "http" };
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    }
    if !(down.peer_trusted && headers.contains_key(&X_FORWARDED_HOST)) {
        match original_host {
            Some(host) => headers.insert(X_FORWARDED_HOST, host),
            None => headers.remove(&X_FORWARDED_HOST),
        };
    }
    Ok(())
}

/// Append the peer to X-Forwarded-For when the peer is a trusted proxy (the chain it sent is
/// believed as far as `identity::client_ip` believes it); from anyone else, replace the header
/// so a client cannot plant addresses the backend might trust.
fn forwarded_for(headers: &mut HeaderMap, down: Downstream<'_>) {
    let chain: Vec<&str> = if down.peer_trusted {
        headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect()
    } else {
        Vec::new()
    };
    if chain.is_empty() {
        headers.insert(X_FORWARDED_FOR, down.peer_value.clone());
        return;
    }
    let value = format!("{}, {}", chain.join(", "), down.peer);
    if let Ok(v) = HeaderValue::try_from(value) {
        headers.insert(X_FORWARDED_FOR, v);
    }
}

/// Whether `name` (lower case) describes one hop, never the message (RFC 9110 7.6.1), or is a
/// framing header hyper sets itself on the next hop.
fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// The names to remove from `headers` before the message goes on: the hop-by-hop headers, every
/// header a `Connection` line names, and whatever `also` picks. One pass over the names (a
/// `match` on each), so a message that has none of them costs no lookup and no allocation.
fn doomed_names(headers: &HeaderMap, also: impl Fn(&HeaderName) -> bool) -> Small<HeaderName> {
    let mut doomed = Small::new();
    let mut connection = false;
    for k in headers.keys() {
        if is_hop_by_hop(k.as_str()) {
            connection |= *k == CONNECTION;
            doomed.push(k.clone());
        } else if also(k) {
            doomed.push(k.clone());
        }
    }
    if connection {
        // Options such as `close` or `keep-alive` name no header, or one already doomed: only
        // names the message actually has are added.
        let options = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|o| !o.is_empty());
        for option in options {
            // The usual options, `keep-alive` and `close`: the first names a hop-by-hop header
            // (doomed above if present), the second none. No scan of the names for them.
            if option.eq_ignore_ascii_case("keep-alive") || option.eq_ignore_ascii_case("close") {
                continue;
            }
            if let Some(k) = headers
                .keys()
                .find(|k| k.as_str().eq_ignore_ascii_case(option) && !doomed.contains(k))
            {
                doomed.push(k.clone());
            }
        }
    }
    doomed
}

/// Remove hop-by-hop headers, including every header a `Connection` line names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip_hop_by_hop_and(headers, |_| false);
}

/// `strip_hop_by_hop`, and remove the headers `also` picks in the same pass.
fn strip_hop_by_hop_and(headers: &mut HeaderMap, also: impl Fn(&HeaderName) -> bool) {
    for name in doomed_names(headers, also) {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert("connection", "close, X-Secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("proxy-authorization", "Basic x".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn forwarded_for_appends_only_for_trusted_peers() {
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_FOR, "6.6.6.6".parse().unwrap());
        let peer = "10.0.0.1".parse().unwrap();
        forwarded_for(
            &mut h,
            Downstream {
                peer,
                peer_value: &HeaderValue::from_static("10.0.0.1"),
                peer_trusted: true,
                tls: false,
                client_ip: peer,
                websocket_allowed: false,
                websocket_idle: Duration::from_secs(3600),
                underscores: false,
                tunnel: &TunnelSlot::new(None),
            },
        );
        assert_eq!(h[&X_FORWARDED_FOR], "6.6.6.6, 10.0.0.1");
        forwarded_for(
            &mut h,
            Downstream {
                peer,
                peer_value: &HeaderValue::from_static("10.0.0.1"),
                peer_trusted: false,
                tls: false,
                client_ip: peer,
                websocket_allowed: false,
                websocket_idle: Duration::from_secs(3600),
                underscores: false,
                tunnel: &TunnelSlot::new(None),
            },
        );
        assert_eq!(h[&X_FORWARDED_FOR], "10.0.0.1");
    }
}
