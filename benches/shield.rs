//! The shield scenario: a backend with 8 workers and a 20 ms service time, behind tollgate
//! (`max_in_flight: 8`, fixed and adaptive) and behind HAProxy (`maxconn 8` + `timeout queue`),
//! offered more than it serves by 200 clients of 10 identities, one identity sending 10x what
//! each other sends. Reports what docs/performance.md tabulates: the most requests the backend
//! had at once, goodput, the light and heavy identities' latency and 503s, and Jain's fairness
//! index of the light identities' throughput.
//!
//! `cargo bench --bench shield` (benches/load.sh shield builds the release binary first).
//! Settings: TOLLGATE_BIN [target/release/tollgate], SHIELD_SECONDS [10], PEERS [haproxy].
//! Everything runs on 127.0.0.1 and stops when the run ends.
#![allow(clippy::disallowed_types)]
// std's Instant: tests and benchmarks time the real world

// A load run is one scenario read top to bottom: its length is the scenario's.
#![allow(clippy::too_many_lines)]

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::Semaphore;

const WORKERS: usize = 8;
const SERVICE: Duration = Duration::from_millis(20);
const CLIENTS: usize = 200;
const IDENTITIES: usize = 10;
/// Requests per second of each client of a light identity; the heavy one's send 10x.
const LIGHT_RATE: f64 = 1.25;
const QUEUE_SIZE: usize = 200;
const QUEUE_TIMEOUT: &str = "2s";
const WARMUP: Duration = Duration::from_secs(3);

/// The backend: requests beyond its 8 workers wait inside it (as in a listen backlog) for one.
struct Backend {
    addr: SocketAddr,
    inside: Arc<AtomicUsize>,
    max_inside: Arc<AtomicUsize>,
    /// Requests answered.
    served: Arc<AtomicUsize>,
}

fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn start_backend() -> Backend {
    let listener = StdListener::bind("127.0.0.1:0").expect("bind the backend");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("backend address");
    let inside = Arc::new(AtomicUsize::new(0));
    let max_inside = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(AtomicUsize::new(0));
    let (i, m, done) = (inside.clone(), max_inside.clone(), served.clone());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("backend runtime");
        rt.block_on(async move {
            let workers = Arc::new(Semaphore::new(WORKERS));
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (workers, i, m, done) = (workers.clone(), i.clone(), m.clone(), done.clone());
                let service = service_fn(move |_req| {
                    let (workers, i, m, done) =
                        (workers.clone(), i.clone(), m.clone(), done.clone());
                    async move {
                        let now = i.fetch_add(1, Ordering::SeqCst) + 1;
                        m.fetch_max(now, Ordering::SeqCst);
                        let worker = workers.acquire().await.expect("workers");
                        tokio::time::sleep(SERVICE).await;
                        drop(worker);
                        i.fetch_sub(1, Ordering::SeqCst);
                        done.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(
                            b"ok\n",
                        ))))
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
    });
    Backend {
        addr,
        inside,
        max_inside,
        served,
    }
}

/// A proxy under test, stopped when dropped.
struct Proxy {
    name: String,
    port: u16,
    admin: Option<u16>,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tollgate(name: &str, backend: SocketAddr, cap: &str) -> Proxy {
    let bin = std::env::var("TOLLGATE_BIN").unwrap_or_else(|_| "target/release/tollgate".into());
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (port, admin) = (free_port(), free_port());
    let yaml = format!(
        "listeners:\n  - address: 127.0.0.1:{port}\nadmin: {{ address: 127.0.0.1:{admin} }}
upstreams:
  legacy:
    targets: [{backend}]
    timeout: 30s
{cap}
    queue: {{ size: {QUEUE_SIZE}, timeout: {QUEUE_TIMEOUT}, key: [header:X-Tenant] }}
routes:
  - name: all
    upstream: legacy
"
    );
    let path = dir.path().join("tollgate.yaml");
    std::fs::write(&path, yaml).expect("write the config");
    let child = Command::new(&bin)
        .args(["run", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        // The access log (one line a request) would cost the run more than it tells.
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{bin}: {e} (build it: cargo build --release)"));
    wait_port(port);
    Proxy {
        name: name.into(),
        port,
        admin: Some(admin),
        child,
        _dir: dir,
    }
}

fn haproxy(backend: SocketAddr) -> Option<Proxy> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let port = free_port();
    let cfg = format!(
        "global\n    nbthread 2\n    maxconn 8192\ndefaults\n    mode http\n    timeout connect 5s
    timeout client 75s\n    timeout server 75s\n    timeout queue {QUEUE_TIMEOUT}
    option http-keep-alive\n    http-reuse always
frontend proxy\n    bind 127.0.0.1:{port}\n    default_backend legacy
backend legacy\n    server backend {backend} maxconn {WORKERS} maxqueue {QUEUE_SIZE} pool-max-conn 1024\n"
    );
    let path = dir.path().join("haproxy.cfg");
    std::fs::write(&path, cfg).expect("write the config");
    let child = Command::new("haproxy")
        .args(["-db", "-f"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    wait_port(port);
    Some(Proxy {
        name: "HAProxy maxconn 8 + timeout queue".into(),
        port,
        admin: None,
        child,
        _dir: dir,
    })
}

/// One identity's results in the measured window.
#[derive(Default, Clone)]
struct Tally {
    ok: u64,
    unavailable: u64,
    other: u64,
    latencies: Vec<Duration>,
}

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    sum * sum / (xs.len() as f64 * squares)
}

/// Drive the load; the results in the measured window, and what the backend served in it
/// (requests a second).
async fn drive(port: u16, seconds: Duration, served: Arc<AtomicUsize>) -> (Vec<Tally>, f64) {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let tallies = Arc::new(Mutex::new(vec![Tally::default(); IDENTITIES]));
    let start = Instant::now();
    let measured_from = start + WARMUP;
    let end = measured_from + seconds;
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let identity = c % IDENTITIES;
        let rate = if identity == 0 {
            10.0 * LIGHT_RATE
        } else {
            LIGHT_RATE
        };
        let period = Duration::from_secs_f64(1.0 / rate);
        let (client, tallies) = (client.clone(), tallies.clone());
        let url: hyper::Uri = format!("http://127.0.0.1:{port}/").parse().expect("a URL");
        clients.push(tokio::spawn(async move {
            // Spread the clients' first requests over one period.
            let offset = period.mul_f64(c as f64 / CLIENTS as f64);
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
            let mut inflight = Vec::new();
            loop {
                tick.tick().await;
                let sent = Instant::now();
                if sent >= end {
                    break;
                }
                let req = hyper::Request::get(url.clone())
                    .header("x-tenant", format!("tenant-{identity}"))
                    .body(Empty::new())
                    .expect("a request");
                let (client, tallies) = (client.clone(), tallies.clone());
                inflight.push(tokio::spawn(async move {
                    let status = match client.request(req).await {
                        Ok(res) => {
                            let status = res.status().as_u16();
                            let _ = res.into_body().collect().await;
                            status
                        }
                        Err(_) => 0,
                    };
                    if sent < measured_from {
                        return;
                    }
                    let mut t = tallies.lock().expect("tallies");
                    let t = &mut t[identity];
                    match status {
                        200 => {
                            t.ok += 1;
                            t.latencies.push(sent.elapsed());
                        }
                        503 => t.unavailable += 1,
                        _ => t.other += 1,
                    }
                }));
            }
            for r in inflight {
                let _ = r.await;
            }
        }));
    }
    let backend_rate = tokio::spawn(async move {
        tokio::time::sleep_until(measured_from.into()).await;
        let before = served.load(Ordering::SeqCst);
        tokio::time::sleep_until(end.into()).await;
        (served.load(Ordering::SeqCst) - before) as f64 / seconds.as_secs_f64()
    });
    for c in clients {
        let _ = c.await;
    }
    let t = tallies.lock().expect("tallies").clone();
    (t, backend_rate.await.unwrap_or(0.0))
}

fn scrape(admin: u16, series: &str) -> Option<String> {
    let out = Command::new("curl")
        .args(["-s", &format!("http://127.0.0.1:{admin}/metrics")])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .map(str::to_owned)
}

fn report(proxy: &Proxy, backend: &Backend, tallies: &mut [Tally], seconds: Duration, served: f64) {
    let secs = seconds.as_secs_f64();
    let ok: u64 = tallies.iter().map(|t| t.ok).sum();
    let unavailable: u64 = tallies.iter().map(|t| t.unavailable).sum();
    let other: u64 = tallies.iter().map(|t| t.other).sum();
    let (heavy, light) = tallies.split_at_mut(1);
    let mut light_latencies: Vec<Duration> = light
        .iter()
        .flat_map(|t| t.latencies.iter().copied())
        .collect();
    let light_ok: Vec<f64> = light.iter().map(|t| t.ok as f64 / secs).collect();
    let light_503: u64 = light.iter().map(|t| t.unavailable).sum();
    let offered_light = LIGHT_RATE * (CLIENTS / IDENTITIES) as f64;
    let cap = proxy
        .admin
        .and_then(|a| scrape(a, "tollgate_upstream_target_max_in_flight{"))
        .unwrap_or_else(|| "-".into());
    println!(
        "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {:.0} | {:.1}% | {} | {:.4} | {} |",
        proxy.name,
        backend.max_inside.load(Ordering::SeqCst),
        cap,
        served,
        ok as f64 / secs,
        percentile(&mut light_latencies, 0.5).as_secs_f64() * 1e3,
        percentile(&mut light_latencies, 0.99).as_secs_f64() * 1e3,
        light_503,
        percentile(&mut heavy[0].latencies, 0.99).as_secs_f64() * 1e3,
        100.0 * heavy[0].unavailable as f64 / (heavy[0].ok + heavy[0].unavailable).max(1) as f64,
        unavailable + other,
        jain(&light_ok),
        light_ok
            .iter()
            .map(|x| format!("{:.1}", x / offered_light * 100.0))
            .collect::<Vec<_>>()
            .join("/"),
    );
}

fn main() {
    let seconds = Duration::from_secs(
        std::env::var("SHIELD_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(10),
    );
    let peers = std::env::var("PEERS").unwrap_or_else(|_| "haproxy".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("load runtime");
    println!(
        "backend: {WORKERS} workers, {} ms each ({} req/s); offered: {:.0} req/s (9 light identities x {:.1}, heavy {:.1}); {} s measured after {} s",
        SERVICE.as_millis(),
        WORKERS as f64 / SERVICE.as_secs_f64(),
        LIGHT_RATE * CLIENTS as f64 * 1.9,
        LIGHT_RATE * (CLIENTS / IDENTITIES) as f64,
        10.0 * LIGHT_RATE * (CLIENTS / IDENTITIES) as f64,
        seconds.as_secs(),
        WARMUP.as_secs()
    );
    println!("\n| proxy | backend max in flight | cap | backend served req/s | goodput req/s | light p50 ms | light p99 ms | light 503s | heavy p99 ms | heavy 503 share | all 503s | Jain (light) | light served % of offered |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut runs: Vec<Box<dyn Fn(SocketAddr) -> Option<Proxy>>> = vec![
        Box::new(|b| {
            Some(tollgate(
                "tollgate max_in_flight: 8",
                b,
                "    max_in_flight: 8",
            ))
        }),
        Box::new(|b| {
            Some(tollgate(
                "tollgate max_in_flight: adaptive",
                b,
                "    max_in_flight: adaptive\n    adaptive: { min: 1, max: 64 }",
            ))
        }),
    ];
    if peers.split_whitespace().any(|p| p == "haproxy") {
        runs.push(Box::new(haproxy));
    }
    for run in runs {
        let backend = start_backend();
        let Some(proxy) = run(backend.addr) else {
            eprintln!("skipped a peer that did not start (is it installed?)");
            continue;
        };
        let (mut tallies, served) = rt.block_on(drive(proxy.port, seconds, backend.served.clone()));
        report(&proxy, &backend, &mut tallies, seconds, served);
        assert_eq!(
            backend.inside.load(Ordering::SeqCst),
            0,
            "the backend drained"
        );
    }
}
