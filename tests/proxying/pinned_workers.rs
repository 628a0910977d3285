//! A thread-per-connection backend behind a capped upstream (in-process proxy, real sockets):
//! the backend accepts every connection at once and queues it for one of its few workers,
//! and a worker serves one connection, kept alive, until it closes, as Apache prefork, a
//! servlet container with a fixed pool or Python's threaded servers do. `max_in_flight`
//! bounds the connections open to it, idle ones included, and a slot stays taken while the
//! backend works on a request whose client left.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{config, Http, TestProxy};

/// What the backend saw.
#[derive(Default)]
struct Seen {
    /// Connections accepted and not yet closed, and the most at once.
    open: AtomicUsize,
    max_open: AtomicUsize,
    /// Requests being worked on, and the most at once.
    busy: AtomicUsize,
    max_busy: AtomicUsize,
    answered: AtomicUsize,
}

struct PinnedBackend {
    addr: SocketAddr,
    seen: Arc<Seen>,
}

impl PinnedBackend {
    /// `workers` threads; each request takes `work`.
    fn start(workers: usize, work: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the backend");
        let addr = listener.local_addr().expect("backend address");
        let seen = Arc::new(Seen::default());
        let (tx, rx) = mpsc::channel::<TcpStream>();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..workers {
            let (rx, seen) = (rx.clone(), seen.clone());
            std::thread::spawn(move || loop {
                let Ok(stream) = rx.lock().unwrap().recv() else {
                    return;
                };
                let _ = serve(&stream, work, &seen);
                seen.open.fetch_sub(1, Ordering::SeqCst);
            });
        }
        let accepted = seen.clone();
        std::thread::spawn(move || {
            while let Ok((stream, _)) = listener.accept() {
                let now = accepted.open.fetch_add(1, Ordering::SeqCst) + 1;
                accepted.max_open.fetch_max(now, Ordering::SeqCst);
                if tx.send(stream).is_err() {
                    return;
                }
            }
        });
        Self { addr, seen }
    }
}

/// Serve requests on `stream` until the peer closes it.
fn serve(stream: &TcpStream, work: Duration, seen: &Seen) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut out = stream;
    loop {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 {
                return Ok(());
            }
            if line == "\r\n" {
                break;
            }
            head.push_str(&line);
        }
        let length = head
            .to_ascii_lowercase()
            .lines()
            .find_map(|l| {
                l.strip_prefix("content-length:")
                    .map(|v| v.trim().to_owned())
            })
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        let now = seen.busy.fetch_add(1, Ordering::SeqCst) + 1;
        seen.max_busy.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(work);
        seen.busy.fetch_sub(1, Ordering::SeqCst);
        out.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")?;
        out.flush()?;
        seen.answered.fetch_add(1, Ordering::SeqCst);
    }
}

fn capped(backend: SocketAddr, cap: usize) -> String {
    config(&format!(
        "upstreams:
  legacy:
    targets: [{backend}]
    timeout: 10s
    max_in_flight: {cap}
    queue: {{ size: 64, timeout: 10s }}
routes:
  - name: all
    upstream: legacy
    limits:
      - name: per-client
        rate: 100000/s
        burst: 100000
        key: [header:X-Client]
"
    ))
}

/// 32 clients of one heavy identity and one light client, for `run`: what the light one waited
/// (sorted), and the answers of both.
async fn heavy_and_light(proxy: &TestProxy, run: Duration) -> (Vec<Duration>, usize, usize) {
    let until = Instant::now() + run;
    let mut heavy = Vec::new();
    for _ in 0..32 {
        let url = proxy.url("/work");
        heavy.push(tokio::spawn(async move {
            let http = Http::new();
            let mut not_ok = 0;
            while Instant::now() < until {
                let r = http.get_with(&url, &[("x-client", "heavy")]).await;
                not_ok += usize::from(r.code() != 200);
            }
            not_ok
        }));
    }
    let http = Http::new();
    let mut waits = Vec::new();
    let mut light_not_ok = 0;
    while Instant::now() < until {
        let started = Instant::now();
        let r = http
            .get_with(&proxy.url("/light"), &[("x-client", "light")])
            .await;
        waits.push(started.elapsed());
        light_not_ok += usize::from(r.code() != 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut heavy_not_ok = 0;
    for h in heavy {
        heavy_not_ok += h.await.unwrap();
    }
    waits.sort();
    (waits, light_not_ok, heavy_not_ok)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_bounds_connections_to_a_thread_per_connection_backend() {
    let backend = PinnedBackend::start(4, Duration::from_millis(50));
    let proxy = TestProxy::start(&capped(backend.addr, 4));
    let run = Duration::from_secs(3);
    let (waits, light_not_ok, heavy_not_ok) = heavy_and_light(&proxy, run).await;
    let answered = backend.seen.answered.load(Ordering::SeqCst);
    let p90 = waits[waits.len() * 9 / 10];
    eprintln!(
        "cap 4, 4 workers of 50 ms: {} connections at most, goodput {:.0}/s of 80, light \
         client p90 {p90:?} over {} requests, {heavy_not_ok} heavy refusals",
        backend.seen.max_open.load(Ordering::SeqCst),
        answered as f64 / run.as_secs_f64(),
        waits.len(),
    );
    assert!(
        backend.seen.max_open.load(Ordering::SeqCst) <= 4,
        "{} connections open to a backend capped at 4",
        backend.seen.max_open.load(Ordering::SeqCst)
    );
    assert_eq!(light_not_ok, 0, "the light client was refused");
    // Each of the backend's workers answers on a connection of the proxy's, none sits pinned
    // by an idle one while requests wait: at least half of what 4 workers can do, on a
    // machine busy with the whole suite.
    assert!(
        answered as f64 >= 0.5 * 80.0 * run.as_secs_f64(),
        "goodput {answered} in {run:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_keeps_its_slot_until_the_backend_answers() {
    let backend = PinnedBackend::start(4, Duration::from_millis(600));
    let proxy = TestProxy::start(&capped(backend.addr, 2));
    // Clients that give up after 100 ms, over and over: each leaves a request the backend is
    // still working on.
    let mut leavers = Vec::new();
    for i in 0..6 {
        let url = proxy.url("/slow");
        leavers.push(tokio::spawn(async move {
            let http = Http::new();
            let client = format!("leaver-{i}");
            for _ in 0..4 {
                let headers = [("x-client", client.as_str())];
                let get = http.get_with(&url, &headers);
                let _ = tokio::time::timeout(Duration::from_millis(100), get).await;
            }
        }));
    }
    for l in leavers {
        l.await.unwrap();
    }
    // The last ones the backend took are done once its requests end.
    let idle = || async { backend.seen.busy.load(Ordering::SeqCst) == 0 };
    assert!(common::eventually(Duration::from_secs(10), idle).await);
    assert!(
        backend.seen.max_busy.load(Ordering::SeqCst) <= 2,
        "the backend worked on {} requests at once against a cap of 2",
        backend.seen.max_busy.load(Ordering::SeqCst)
    );
    assert!(backend.seen.max_open.load(Ordering::SeqCst) <= 2);
    // The slots and connections came back: a client that waits gets its answer.
    let r = Http::new()
        .get_with(&proxy.url("/after"), &[("x-client", "patient")])
        .await;
    assert_eq!(r.code(), 200);
}
