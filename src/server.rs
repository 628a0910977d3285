//! The accept loop: one task per connection, HTTP/1.1 and HTTP/2 on every listener (h2c prior
//! knowledge in plain text, ALPN over TLS), connections watched so shutdown can drain them.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::CONNECTION;
use http::HeaderValue;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::proxy::{self, Conn, State};

type Builder = Arc<auto::Builder<TokioExecutor>>;

/// A listener's connection limits and timeouts (the `listeners[]` hardening keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerSettings {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub tls_handshake_timeout: Duration,
    pub max_connections: usize,
    pub max_requests_per_connection: u64,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_uri_bytes: usize,
    pub h2_max_concurrent_streams: u32,
    pub h2_stream_window: u32,
    pub h2_connection_window: u32,
    pub h2_max_header_list: u32,
    /// Expect a PROXY protocol header (v1 or v2) from a trusted peer before anything else.
    pub proxy_protocol: bool,
}

impl Default for ListenerSettings {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            tls_handshake_timeout: Duration::from_secs(10),
            max_connections: 10_000,
            max_requests_per_connection: 1000,
            max_header_bytes: 64 << 10,
            max_headers: 100,
            max_uri_bytes: 8 << 10,
            h2_max_concurrent_streams: 100,
            h2_stream_window: 64 << 10,
            h2_connection_window: 1 << 20,
            h2_max_header_list: 64 << 10,
            proxy_protocol: false,
        }
    }
}

/// The HTTP/1.1 and HTTP/2 settings of one listener. hyper's own defaults are set explicitly
/// where they differ from ours: its header read timeout needs a timer, and it has no idle,
/// body or connection-count limits (those live in this module and in `body`).
pub fn builder(s: &ListenerSettings) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    // hyper's header read timeout would also cut keep-alive idle time to the same value; the
    // connection watchdog below times heads and idleness separately instead.
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(s.max_header_bytes.max(8192))
        .max_headers(s.max_headers)
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(s.h2_max_concurrent_streams)
        .initial_stream_window_size(s.h2_stream_window)
        .initial_connection_window_size(s.h2_connection_window)
        .max_header_list_size(s.h2_max_header_list)
        // Rapid reset (CVE-2023-44487): streams a client opens and resets at once count here,
        // and past the cap the connection is closed with GOAWAY.
        .max_pending_accept_reset_streams(Some(20))
        .max_local_error_reset_streams(Some(256))
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20));
    b
}

/// One listening socket and how to serve it.
pub struct Listening {
    pub listener: TcpListener,
    /// The address as configured (the key to its live TLS settings across reloads).
    pub configured: SocketAddr,
    pub settings: ListenerSettings,
    /// The certificates it was bound with; `None`: a plain-text port for its whole life.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// The listener's `max_connections`, shared by the workers serving it.
    pub slots: Arc<Semaphore>,
    /// How the listener's connections are spread over the workers, and this worker's number.
    pub balance: Arc<Balance>,
    pub worker: usize,
    /// Connections other workers accepted and passed to this one.
    pub inbox: mpsc::UnboundedReceiver<Handoff>,
}

/// Spreads one listener's connections evenly over the workers, like Envoy's exact connection
/// balance. Each worker accepts on a `SO_REUSEPORT` socket of its own, and the kernel assigns
/// each new connection to one of those sockets by a hash of its addresses, like a coin toss
/// per connection: 64 connections split 36/28 or worse about 4 times in 10. A worker that
/// accepts a connection while another serves fewer passes it to the one serving fewest,
/// before anything is read from it.
///
/// Even matters because requests on keep-alive connections stay with the worker that took the
/// connection: an overloaded worker gets the same share of a core as an idle one, so its
/// clients wait while CPU goes elsewhere.
#[derive(Debug)]
pub struct Balance {
    /// By worker number.
    workers: Vec<Share>,
}

/// One worker's part of a listener's connections.
#[derive(Debug)]
struct Share {
    /// Connections it serves.
    open: AtomicUsize,
    /// The same, in `tollgate_worker_connections` (all listeners together).
    gauge: prometheus_client::metrics::gauge::Gauge,
    /// Where other workers pass it connections.
    inbox: mpsc::UnboundedSender<Handoff>,
}

/// A connection passed from the worker that accepted it to the one that serves it.
#[derive(Debug)]
pub struct Handoff {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    slot: OwnedSemaphorePermit,
}

impl Balance {
    /// The balance of a listener served by `workers` workers, and each worker's inbox.
    pub fn new(
        workers: usize,
        metrics: &crate::metrics::Metrics,
    ) -> (Arc<Self>, Vec<mpsc::UnboundedReceiver<Handoff>>) {
        let (workers, receivers) = (0..workers)
            .map(|w| {
                let (inbox, receiver) = mpsc::unbounded_channel();
                let labels = crate::metrics::WorkerLabels {
                    worker: w.to_string(),
                };
                let gauge = metrics.worker_connections.get_or_create(&labels).clone();
                let open = AtomicUsize::new(0);
                (Share { open, gauge, inbox }, receiver)
            })
            .unzip();
        (Arc::new(Self { workers }), receivers)
    }

    /// The worker a connection `me` accepted goes to, counted as open there: `me`, unless
    /// another serves fewer.
    fn assign(&self, me: usize) -> usize {
        let open = |w: &Share| w.open.load(Ordering::Relaxed);
        let mine = self.workers.get(me).map_or(0, open);
        let fewest = self
            .workers
            .iter()
            .enumerate()
            .map(|(w, share)| (open(share), w))
            .min()
            .filter(|&(n, _)| n < mine)
            .map_or(me, |(_, w)| w);
        self.seat(fewest);
        fewest
    }

    fn seat(&self, worker: usize) {
        if let Some(w) = self.workers.get(worker) {
            w.open.fetch_add(1, Ordering::Relaxed);
            w.gauge.inc();
        }
    }

    fn unseat(&self, worker: usize) {
        if let Some(w) = self.workers.get(worker) {
            w.open.fetch_sub(1, Ordering::Relaxed);
            w.gauge.dec();
        }
    }
}

/// A connection counted as open on its worker until it ends.
struct Seat {
    balance: Arc<Balance>,
    worker: usize,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.balance.unseat(self.worker);
    }
}

/// Accept connections until `stop` flips to true, then let the open connections finish their
/// in-flight requests for up to the live config's `shutdown_timeout` and return. Idle
/// keep-alive connections close at once (HTTP/2: GOAWAY).
pub async fn serve(l: Listening, state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let settings = Arc::new(l.settings);
    let builder = Arc::new(builder(&settings));
    let slots = l.slots.clone();
    let (balance, me, mut inbox) = (l.balance, l.worker, l.inbox);
    let mut connections = JoinSet::new();
    loop {
        let (stream, peer, slot) = tokio::select! {
            _ = stop.changed() => break,
            Some(passed) = inbox.recv() => match TcpStream::from_std(passed.stream) {
                Ok(stream) => (stream, passed.peer, passed.slot),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot take over a connection from another worker");
                    balance.unseat(me);
                    continue;
                }
            },
            accepted = l.listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        // At the cap: close at once rather than queue, so a flood costs a
                        // socket each.
                        state.metrics.connections_refused.inc();
                        drop(stream);
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    match pass(&balance, me, stream, peer, slot) {
                        Some(mine) => mine,
                        None => continue,
                    }
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        while connections.try_join_next().is_some() {}
        let task = Connection {
            state: state.clone(),
            builder: builder.clone(),
            settings: settings.clone(),
            stop: stop.clone(),
            peer,
            _slot: slot,
            _seat: Seat {
                balance: balance.clone(),
                worker: me,
            },
        };
        let tls = live_tls(&state, l.configured, l.tls.as_ref());
        connections.spawn(task.run(stream, tls));
    }
    drop(l.listener);
    // From now on, a connection another worker passes here is served by that worker.
    drop(inbox);
    let drain = state.config.load().shutdown_timeout;
    let drained = tokio::time::timeout(drain, async {
        while connections.join_next().await.is_some() {}
    });
    if drained.await.is_err() {
        tracing::warn!(
            left = connections.len(),
            "drain timed out; closing the remaining connections"
        );
        connections.shutdown().await;
    }
}

/// Pass a connection worker `me` accepted to the worker serving fewest, if that is another
/// one; `None`: it was passed. What comes back is this worker's to serve (already counted).
fn pass(
    balance: &Balance,
    me: usize,
    stream: TcpStream,
    peer: SocketAddr,
    slot: OwnedSemaphorePermit,
) -> Option<(TcpStream, SocketAddr, OwnedSemaphorePermit)> {
    let to = balance.assign(me);
    if to == me {
        return Some((stream, peer, slot));
    }
    // Another worker than `me` comes from `assign`'s own list: in range.
    let share = &balance.workers[to];
    let handoff = match stream.into_std() {
        Ok(stream) => Handoff { stream, peer, slot },
        Err(e) => {
            // Nothing to serve: the socket is gone.
            tracing::debug!(error = %e, "cannot pass a connection to another worker");
            balance.unseat(to);
            return None;
        }
    };
    match share.inbox.send(handoff) {
        Ok(()) => None,
        Err(mpsc::error::SendError(back)) => {
            // That worker has stopped: serve it here.
            balance.unseat(to);
            let stream = TcpStream::from_std(back.stream).ok()?;
            balance.seat(me);
            Some((stream, back.peer, back.slot))
        }
    }
}

/// The certificates for the next handshake on this listener. Whether a port speaks TLS is
/// fixed when it is bound (a reload never turns a TLS port into a plain one, or back); which
/// certificates it presents follow the live config while it still has a TLS listener at this
/// address, and stay as they were otherwise.
fn live_tls(
    state: &State,
    configured: SocketAddr,
    initial: Option<&Arc<rustls::ServerConfig>>,
) -> Option<Arc<rustls::ServerConfig>> {
    let initial = initial?;
    let live = state
        .config
        .load()
        .listeners
        .iter()
        .find(|l| l.address == configured)
        .and_then(|l| l.tls.as_ref().map(|t| t.config.clone()));
    Some(live.unwrap_or_else(|| initial.clone()))
}

/// One accepted connection and what serving it needs.
struct Connection {
    state: Arc<State>,
    builder: Builder,
    settings: Arc<ListenerSettings>,
    stop: watch::Receiver<bool>,
    peer: SocketAddr,
    _slot: OwnedSemaphorePermit,
    _seat: Seat,
}

impl Connection {
    async fn run(mut self, mut stream: TcpStream, tls: Option<Arc<rustls::ServerConfig>>) {
        if self.settings.proxy_protocol && !self.take_proxy_header(&mut stream).await {
            return;
        }
        match tls {
            None => self.serve(stream, false).await,
            // Boxed: a TLS session's state (the handshake's, then the stream's) is several KB,
            // and inline it would be part of every plain-text connection's task too.
            Some(tls) => Box::pin(self.serve_tls(stream, tls)).await,
        }
    }

    /// The TLS handshake (bounded by its timeout, abandoned at shutdown), then `serve`.
    async fn serve_tls(mut self, stream: TcpStream, tls: Arc<rustls::ServerConfig>) {
        let acceptor = crate::tls::acceptor(tls);
        let handshake =
            tokio::time::timeout(self.settings.tls_handshake_timeout, acceptor.accept(stream));
        // A handshake in progress holds no request: shutdown does not wait for it.
        let done = tokio::select! {
            done = handshake => done,
            _ = self.stop.changed() => return,
        };
        match done {
            Ok(Ok(stream)) => self.serve(stream, true).await,
            Ok(Err(e)) => tracing::debug!(peer = %self.peer, error = %e, "TLS handshake failed"),
            Err(_) => tracing::debug!(peer = %self.peer, "TLS handshake timed out"),
        }
    }

    /// Read the PROXY header and adopt the client address it names. Only trusted proxies may
    /// speak it: anyone else could claim any address. `false`: drop the connection.
    async fn take_proxy_header(&mut self, stream: &mut TcpStream) -> bool {
        let trusted = &self.state.config.load().trusted_proxies;
        if !crate::identity::is_trusted(self.peer.ip(), trusted) {
            tracing::debug!(peer = %self.peer, "PROXY protocol from an untrusted peer: closed");
            return false;
        }
        let header = crate::proxy_protocol::read(stream);
        match tokio::time::timeout(self.settings.header_read_timeout, header).await {
            Ok(Ok(Some(client))) => {
                self.peer = client;
                true
            }
            Ok(Ok(None)) => true,
            Ok(Err(e)) => {
                tracing::debug!(peer = %self.peer, error = %e, "bad PROXY protocol header: closed");
                false
            }
            Err(_) => false,
        }
    }

    async fn serve<I>(self, io: I, tls: bool)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let shared = Arc::new(Shared {
            state: self.state.clone(),
            conn: Conn::new(self.peer, tls, self.settings.max_uri_bytes),
            activity: Activity::new(),
        });
        let service = {
            let shared = shared.clone();
            let max_requests = self.settings.max_requests_per_connection;
            service_fn(move |req: http::Request<hyper::body::Incoming>| {
                // One reference count per request, on this connection's own allocation.
                let mut request = InFlight::begin(shared.clone());
                // Boxed: hyper keeps a slot for the service's future in every connection's
                // state, in use or not, so an idle keep-alive connection held this request's
                // future inline (3.1 KB of its 38.8). One allocation per request instead.
                crate::boxed(|| async move {
                    let s = &*request.shared;
                    if req.version() == http::Version::HTTP_2 {
                        s.activity.http2.store(true, Ordering::Release);
                    }
                    let mut res = proxy::handle(&s.state, &s.conn, req).await;
                    if request.served >= max_requests {
                        // HTTP/1.1 closes after this response; HTTP/2 gets a GOAWAY below.
                        res.headers_mut()
                            .insert(CONNECTION, HeaderValue::from_static("close"));
                        s.activity.retire.notify_one();
                    }
                    request.answered = true;
                    // In flight until the response body is sent: a long download is not idle.
                    Ok::<_, Infallible>(res.map(|body| Scoped {
                        body,
                        _request: request,
                    }))
                })
            })
        };
        // Bytes arriving mark a request head in progress for the watchdog.
        let io = {
            let shared = shared.clone();
            ReadNoted::new(io, move || shared.activity.bytes_read())
        };
        let connection = self
            .builder
            .serve_connection_with_upgrades(TokioIo::new(io), service);
        tokio::pin!(connection);
        let open = self.state.metrics.open_connections.clone();
        open.inc();
        // The timeouts, the shutdown signal and the request cap are watched by a task of their
        // own, which sends its verdict once. This loop polls only the connection and that
        // channel: nothing shared between connections is touched per request.
        let (verdict_tx, mut verdict) = oneshot::channel();
        let watchdog = AbortOnDrop(tokio::spawn(watchdog(
            shared.clone(),
            self.settings.clone(),
            self.stop.clone(),
            verdict_tx,
        )));
        let mut closing = false;
        loop {
            tokio::select! {
                biased;
                result = connection.as_mut() => {
                    if let Err(e) = result {
                        tracing::debug!(peer = %self.peer, error = %e, "connection ended with an error");
                    }
                    break;
                }
                command = &mut verdict, if !closing => match command {
                    // Finishes what is in flight, closes when idle; HTTP/2 sends GOAWAY.
                    Ok(Command::Close) => {
                        closing = true;
                        connection.as_mut().graceful_shutdown();
                    }
                    Ok(Command::Drop) => {
                        // A head that never completes (slowloris): drop the connection.
                        tracing::debug!(peer = %self.peer, "request head not complete in time");
                        break;
                    }
                    // The watchdog is gone without a verdict (it only ends with one): there is
                    // nothing more to wait for.
                    Err(_) => closing = true,
                },
            }
        }
        drop(watchdog);
        // A WebSocket handshake hands the socket over: the tunnel runs here, so it keeps this
        // connection's slot, stays in the open-connections gauge and in the shutdown drain.
        let tunnel = shared.conn.tunnel.lock().take();
        if let Some(tunnel) = tunnel {
            crate::forward::run_tunnel(tunnel).await;
        }
        open.dec();
    }
}

/// Watches one connection: asks it to close gracefully on shutdown, when it has served its
/// quota of requests or was caught in a rapid reset, or when it sat idle too long; asks it to
/// drop when a request head did not complete in time. Sleeps until the next deadline and
/// re-reads the connection's marks only then: requests themselves never wake it.
async fn watchdog(
    shared: Arc<Shared>,
    settings: Arc<ListenerSettings>,
    mut stop: watch::Receiver<bool>,
    verdict: oneshot::Sender<Command>,
) {
    let activity = &shared.activity;
    let sleep = tokio::time::sleep_until(activity.next_check(&settings));
    tokio::pin!(sleep);
    let command = loop {
        tokio::select! {
            _ = stop.changed() => break Command::Close,
            () = activity.retire.notified() => break Command::Close,
            () = sleep.as_mut() => match activity.overdue(&settings) {
                Overdue::No => sleep.as_mut().reset(activity.next_check(&settings)),
                Overdue::Idle => break Command::Close,
                Overdue::Head => break Command::Drop,
            },
        }
    };
    let _ = verdict.send(command);
}

/// Aborts the watchdog when its connection ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the watchdog asks of its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    Close,
    Drop,
}

/// One request on a connection, from its head until its response body is sent. Dropped
/// before it was answered, it was cancelled by the client (an HTTP/2 RST_STREAM, or a closed
/// HTTP/1.1 connection).
struct InFlight {
    shared: Arc<Shared>,
    served: u64,
    answered: bool,
}

impl InFlight {
    fn begin(shared: Arc<Shared>) -> Self {
        let served = shared.activity.begin();
        Self {
            shared,
            served,
            answered: false,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shared.activity.end(self.answered);
    }
}

/// What a connection's requests, its watchdog and its socket share.
struct Shared {
    state: Arc<State>,
    conn: Conn,
    activity: Activity,
}

/// A response body that keeps its request in flight until hyper is done with it.
struct Scoped<B> {
    body: B,
    _request: InFlight,
}

impl<B: http_body::Body + Unpin> http_body::Body for Scoped<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Requests per window of the rapid-reset guard, and how many of them may be cancelled.
const RESET_WINDOW: u32 = 100;
const RESETS_ALLOWED: u32 = 50;

/// What a connection is doing, for its timeouts and its request cap.
struct Activity {
    inflight: AtomicUsize,
    served: AtomicU64,
    /// The client speaks HTTP/2: its frames (pings, window updates, settings acks) arrive at
    /// any time, so bytes read do not mean a request head is in progress.
    http2: AtomicBool,
    /// Requests and client cancellations in the current window of `RESET_WINDOW` requests.
    window: parking_lot::Mutex<(u32, u32)>,
    /// When the connection last went idle (accepted, or its last response head sent), and
    /// when the first byte after that arrived (a request head in progress).
    marks: parking_lot::Mutex<Marks>,
    retire: Notify,
}

#[derive(Clone, Copy)]
struct Marks {
    idle_since: Instant,
    head_started: Option<Instant>,
}

/// What the watchdog should do about a connection with nothing in flight.
enum Overdue {
    No,
    /// Idle too long between requests: close it gracefully.
    Idle,
    /// A request head started but did not complete in time: drop it.
    Head,
}

impl Activity {
    fn new() -> Self {
        Self {
            inflight: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            http2: AtomicBool::new(false),
            window: parking_lot::Mutex::new((0, 0)),
            marks: parking_lot::Mutex::new(Marks {
                idle_since: Instant::now(),
                head_started: None,
            }),
            retire: Notify::new(),
        }
    }

    /// A request starts; returns how many this connection has now served, this one included.
    fn begin(&self) -> u64 {
        self.inflight.fetch_add(1, Ordering::AcqRel);
        self.served.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// A request is done: answered, or cancelled by the client before its response head.
    /// A connection whose client cancels most of its recent requests is retired (HTTP/2
    /// GOAWAY): that is the rapid-reset attack on streams already being proxied, which the
    /// HTTP/2 layer's own reset cap (streams reset before they are accepted) cannot see.
    fn end(&self, answered: bool) {
        *self.marks.lock() = Marks {
            idle_since: Instant::now(),
            head_started: None,
        };
        self.inflight.fetch_sub(1, Ordering::AcqRel);
        let mut window = self.window.lock();
        window.0 += 1;
        window.1 += u32::from(!answered);
        if window.1 > RESETS_ALLOWED {
            tracing::warn!(
                "client cancels most of its requests (rapid reset): closing its connection"
            );
            *window = (0, 0);
            self.retire.notify_one();
        } else if window.0 >= RESET_WINDOW {
            *window = (0, 0);
        }
    }

    fn bytes_read(&self) {
        if self.inflight.load(Ordering::Acquire) == 0 && !self.http2.load(Ordering::Acquire) {
            let mut marks = self.marks.lock();
            marks.head_started.get_or_insert_with(Instant::now);
        }
    }

    fn deadline(&self, s: &ListenerSettings) -> (Instant, Overdue) {
        let marks = *self.marks.lock();
        match marks.head_started {
            Some(started) => (started + s.header_read_timeout, Overdue::Head),
            // A fresh connection must send its first head within the header timeout.
            None if self.served.load(Ordering::Acquire) == 0 => {
                (marks.idle_since + s.header_read_timeout, Overdue::Idle)
            }
            None => (marks.idle_since + s.idle_timeout, Overdue::Idle),
        }
    }

    /// When the watchdog should look next. While a request is in flight nothing can be
    /// overdue: look again after the shorter timeout (never a deadline in the past, which
    /// would spin for as long as a slow request takes). A request that ends before that look
    /// leaves a deadline later than it, so the look then finds the exact deadline.
    fn next_check(&self, s: &ListenerSettings) -> Instant {
        if self.inflight.load(Ordering::Acquire) > 0 {
            return Instant::now() + s.idle_timeout.min(s.header_read_timeout);
        }
        self.deadline(s).0
    }

    fn overdue(&self, s: &ListenerSettings) -> Overdue {
        if self.inflight.load(Ordering::Acquire) > 0 {
            return Overdue::No;
        }
        let (deadline, kind) = self.deadline(s);
        if Instant::now() >= deadline {
            kind
        } else {
            Overdue::No
        }
    }
}

/// A socket that calls `noted` whenever a read brings bytes: the connection watchdog's view of
/// a request head in progress, and a WebSocket tunnel's idle clock.
pub(crate) struct ReadNoted<I, F> {
    inner: I,
    noted: F,
}

impl<I, F: Fn()> ReadNoted<I, F> {
    pub(crate) fn new(inner: I, noted: F) -> Self {
        Self { inner, noted }
    }
}

impl<I: AsyncRead + Unpin, F: Fn() + Unpin> AsyncRead for ReadNoted<I, F> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            (self.noted)();
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin, F: Unpin> AsyncWrite for ReadNoted<I, F> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
