//! The floor of a hyper-based HTTP/1.1 proxy, for `docs/performance.md`: what forwarding costs
//! with hyper and tokio alone, without anything tollgate does (no routes, identities, limits,
//! metrics, header rewriting, timeouts or pool).
//!
//! ```sh
//! cargo run --release --example bare_hyper_proxy -- 127.0.0.1:8080 127.0.0.1:9000
//! ```
//!
//! Same shape as tollgate: one single-threaded runtime per core, each with its own
//! `SO_REUSEPORT` listener, mimalloc, and upstream connections driven by tasks of their own on
//! the same worker. Simpler than any real pool: each client connection opens one upstream
//! connection of its own. Errors become `502`; nothing else is handled.
#![allow(clippy::disallowed_types)] // std's Instant: tests and benchmarks time the real world

use std::net::SocketAddr;

use http_body_util::{combinators::BoxBody, BodyExt};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1 as client;
use hyper::server::conn::http1 as server;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

#[global_allocator]
static GLOBAL: tollgate_alloc::Allocator = tollgate_alloc::Allocator;

type Body = BoxBody<Bytes, hyper::Error>;

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: bare_hyper_proxy LISTEN_ADDR UPSTREAM_ADDR");
        std::process::exit(2);
    };
    let listen: SocketAddr = listen.parse().expect("LISTEN_ADDR");
    let upstream: SocketAddr = upstream.parse().expect("UPSTREAM_ADDR");
    let workers = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let threads: Vec<_> = (0..workers)
        .map(|_| {
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                runtime.block_on(serve(listen, upstream));
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
}

async fn serve(listen: SocketAddr, upstream: SocketAddr) {
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket.set_reuse_address(true).expect("SO_REUSEADDR");
    socket.set_reuse_port(true).expect("SO_REUSEPORT");
    socket.set_nonblocking(true).expect("nonblocking");
    socket.bind(&listen.into()).expect("bind");
    socket.listen(4096).expect("listen");
    let listener = TcpListener::from_std(socket.into()).expect("listener");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(connection(stream, upstream));
    }
}

/// Serve one client connection, forwarding over one upstream connection of its own.
async fn connection(stream: TcpStream, upstream: SocketAddr) {
    let Ok(up) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = up.set_nodelay(true);
    let Ok((sender, up_conn)) = client::handshake::<_, Incoming>(TokioIo::new(up)).await else {
        return;
    };
    let sender = std::sync::Arc::new(tokio::sync::Mutex::new(sender));
    let service = service_fn(move |req: Request<Incoming>| {
        let sender = sender.clone();
        async move {
            let mut sender = sender.lock().await;
            let sent = match sender.ready().await {
                Ok(()) => sender.send_request(req).await,
                Err(e) => Err(e),
            };
            let res: Response<Body> = match sent {
                Ok(res) => res.map(BodyExt::boxed),
                Err(_) => {
                    let mut res = Response::new(
                        http_body_util::Empty::new()
                            .map_err(|never| match never {})
                            .boxed(),
                    );
                    *res.status_mut() = StatusCode::BAD_GATEWAY;
                    res
                }
            };
            Ok::<_, hyper::Error>(res)
        }
    });
    let downstream = server::Builder::new().serve_connection(TokioIo::new(stream), service);
    // The upstream connection runs on a task of its own (on this worker), as tollgate's pool
    // does: measured faster than driving both connections from one task with `select!`
    // (88-90k against 81-82k req/s), which re-polls both on every wake.
    let upstream_task = tokio::spawn(up_conn);
    let _ = downstream.await;
    upstream_task.abort();
}
