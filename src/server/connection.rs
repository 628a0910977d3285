//! One accepted connection: PROXY header, TLS handshake, then hyper serving its requests.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::header::CONNECTION;
use http::HeaderValue;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit};

use super::balance::Seat;
use super::request_line::LineGuard;
use super::watchdog::{watchdog, AbortOnDrop, Activity, Command};
use super::Builder;
use crate::access_log::LoggedBody;
use crate::config::settings::ListenerSettings;
use crate::forward::Tunnel;
use crate::io::ReadNoted;
use crate::proxy::{self, ClientConn};
use crate::state::State;

/// One accepted connection and what serving it needs.
pub(super) struct Connection {
    pub(super) state: Arc<State>,
    pub(super) builder: Builder,
    pub(super) settings: Arc<ListenerSettings>,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) peer: SocketAddr,
    /// The worker serving it.
    pub(super) worker: usize,
    pub(super) _slot: OwnedSemaphorePermit,
    pub(super) _seat: Seat,
}

impl Connection {
    pub(super) async fn run(
        mut self,
        mut stream: TcpStream,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) {
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
        let trusted = &self.state.runtime.load().settings.trusted_proxies;
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

    /// `io` watched for the connection of `shared`: bytes arriving mark a request head in
    /// progress for the watchdog, writes are watched for a client that takes none, and the
    /// request lines of heads for their length (414).
    fn watched<I>(
        &self,
        io: I,
        shared: &Arc<Shared>,
    ) -> impl AsyncRead + AsyncWrite + Unpin + Send + 'static
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let watched = WriteWatched {
            inner: io,
            shared: shared.clone(),
            shut: false,
            linger: None,
        };
        let noting = shared.clone();
        let noted = ReadNoted::new(watched, move || noting.activity.bytes_read());
        let between = shared.clone();
        let max_line = self.settings.max_header_bytes.max(super::MIN_READ_BUFFER);
        LineGuard::new(noted, self.settings.max_uri_bytes, max_line, move || {
            between.activity.between_requests()
        })
    }

    // The connection's whole life in one future: split, its state would move between futures.
    #[allow(clippy::too_many_lines)]
    async fn serve<I>(self, io: I, tls: bool)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let shared = Arc::new(Shared {
            state: self.state.clone(),
            conn: ClientConn::new(self.peer, tls, self.settings.max_uri_bytes, self.worker),
            activity: Activity::new(),
            tunnel: parking_lot::Mutex::new(None),
        });
        let service = {
            let shared = shared.clone();
            let max_requests = self.settings.max_requests_per_connection;
            service_fn(move |req| answer(&shared, max_requests, req))
        };
        let io = self.watched(io, &shared);
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
        let tunnel = shared.tunnel.lock().take();
        if let Some(tunnel) = tunnel {
            crate::forward::tunnel::run(*tunnel).await;
        }
        open.dec();
    }
}

/// A request's answer as hyper takes it.
type Answered = Result<http::Response<Scoped<LoggedBody<crate::response::Body>>>, Infallible>;

/// One request on the connection of `shared` answered: the proxy's answer, the connection told
/// to close after it when it has served `max_requests` or is stopping, and the response body
/// counted in flight until it is sent.
fn answer(
    shared: &Arc<Shared>,
    max_requests: u64,
    req: http::Request<hyper::body::Incoming>,
) -> std::pin::Pin<Box<impl std::future::Future<Output = Answered>>> {
    // One reference count per request, on this connection's own allocation.
    let mut request = ActiveRequest::begin(Arc::clone(shared));
    // Boxed once here: each stage takes the request by value, and an async
    // function keeps its argument twice (captured, then as a local), so a request
    // moved whole would be copied into every stage's future twice.
    let req = Box::new(req);
    // Boxed: hyper keeps a slot for the service's future in every connection's
    // state, in use or not, so an idle keep-alive connection would hold a whole
    // request's future inline. One allocation per request instead.
    crate::boxed(|| async move {
        if req.version() == http::Version::HTTP_2 {
            request.shared.activity.http2.store(true, Ordering::Release);
            request.http2 = true;
        }
        let s = &*request.shared;
        let handled = proxy::handle(&s.state, &s.conn, req).await;
        if let Some(tunnel) = handled.tunnel {
            // HTTP/1.1 only, one request at a time: at most one per connection.
            *s.tunnel.lock() = Some(tunnel);
        }
        let mut res = handled.response;
        let retiring = request.served >= max_requests;
        if retiring || s.activity.stopping() {
            // HTTP/1.1 closes after this response; HTTP/2 gets a GOAWAY (the
            // watchdog's close; hyper drops this header from HTTP/2 responses).
            res.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        if retiring {
            s.activity.retire.notify_one();
        }
        request.answered = true;
        // In flight until the response body is sent: a long download is not idle.
        Ok::<_, Infallible>(res.map(|body| Scoped {
            body: LoggedBody::new(body, handled.access, handled.at_end),
            _slots: handled.slots,
            request,
            waiting: false,
        }))
    })
}

/// One request on a connection (its `Activity`), from its head until its response body is sent. Dropped
/// before it was answered, it was cancelled by the client (an HTTP/2 RST_STREAM, or a closed
/// HTTP/1.1 connection).
struct ActiveRequest {
    shared: Arc<Shared>,
    served: u64,
    answered: bool,
    http2: bool,
}

impl ActiveRequest {
    fn begin(shared: Arc<Shared>) -> Self {
        let served = shared.activity.begin();
        Self {
            shared,
            served,
            answered: false,
            http2: false,
        }
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        if self.http2 {
            self.shared.activity.unsent(self.served, false);
        }
        self.shared.activity.end(self.answered);
    }
}

/// How long a connection closed by the shutdown keeps reading (and discarding) after its FIN,
/// waiting for the client to close its side.
const LINGER: Duration = Duration::from_secs(1);

/// The client's socket, telling the connection's `Activity` when a write has to wait for it
/// and when it goes through (the send timeout).
///
/// On shutdown its close lingers: after sending FIN it reads and discards what the client
/// still sends until the client closes too, or `LINGER`. A socket closed with unread bytes, or
/// that receives bytes once closed, answers with a reset, and a reset destroys what the client
/// has not read yet: the last response, or the FIN that tells it the connection was closed
/// before its next request was read (a clean close it can retry on, RFC 9112 section 9.6).
struct WriteWatched<I> {
    inner: I,
    shared: Arc<Shared>,
    /// FIN sent.
    shut: bool,
    /// The end of the lingering close, once it started.
    linger: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<I: AsyncRead + Unpin> AsyncRead for WriteWatched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> WriteWatched<I> {
    fn noted<T>(&self, polled: Poll<T>) -> Poll<T> {
        match &polled {
            Poll::Pending => self.shared.activity.write_pending(),
            Poll::Ready(_) => self.shared.activity.write_done(),
        }
        polled
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin> AsyncWrite for WriteWatched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        self.noted(polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.noted(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.noted(polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if !this.shut {
            ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            this.shut = true;
        }
        if !this.shared.activity.stopping() {
            return Poll::Ready(Ok(()));
        }
        let linger = this
            .linger
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(LINGER)));
        let mut scratch = [0u8; 2048];
        loop {
            if linger.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(()));
            }
            let mut buf = tokio::io::ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut buf) {
                // More from the client: discarded, it comes after the close.
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {}
                // The client closed too (or its socket failed): done.
                Poll::Ready(_) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// What a connection's requests, its watchdog and its socket share.
pub(super) struct Shared {
    state: Arc<State>,
    conn: ClientConn,
    pub(super) activity: Activity,
    /// The WebSocket tunnel a request opened, for the connection to run once hyper hands the
    /// socket over: it then keeps the connection's slot under `max_connections`, counts as an
    /// open connection, and is part of the shutdown drain.
    tunnel: parking_lot::Mutex<Option<Box<Tunnel>>>,
}

impl AsRef<Activity> for Shared {
    fn as_ref(&self) -> &Activity {
        &self.activity
    }
}

/// A response body that keeps its request in flight until hyper is done with it.
struct Scoped<B> {
    body: B,
    /// The request's concurrency slots, given back when hyper drops the body.
    _slots: crate::limiter::concurrency::Guard,
    request: ActiveRequest,
    /// HTTP/2: data was handed to hyper and not asked past yet (see `Activity::unsent`).
    waiting: bool,
}

impl<B: http_body::Body + Unpin> http_body::Body for Scoped<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        // hyper asks an HTTP/2 body for more only once the stream's window has room: data
        // handed over and never asked past means the client's window stays shut.
        if self.request.http2 {
            let waiting = matches!(&polled, Poll::Ready(Some(Ok(f))) if f.is_data());
            if waiting || self.waiting {
                let id = self.request.served;
                self.request.shared.activity.unsent(id, waiting);
                self.waiting = waiting;
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
