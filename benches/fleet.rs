//! The fleet model: N tollgate replicas (processes of the release binary) sharing one tenant's
//! limit over one redis-server and over a 3-master Redis Cluster, with and without
//! `leasing: auto`, offered a load (by default three times the limit's rate) by one client
//! spread evenly over the replicas. Reports what docs/performance.md tabulates for N = 2, 8 and 32: Redis script
//! calls and redis-server CPU per request, what one Redis core would sustain at that CPU, and
//! the requests admitted against the bucket's `burst + rate x t` and the leased bound
//! `burst + rate x t + N x L`.
//!
//! `cargo bench --bench fleet` (benches/load.sh fleet builds the release binary first).
//! Settings: TOLLGATE_BIN [target/release/tollgate], FLEET_SECONDS [4], FLEET_SIZES [2 8 32],
//! FLEET_OFFERED [3000]: requests a second offered, all replicas together (3x the limit's rate;
//! 800 shows a hot tenant within its limit), FLEET_HOLD [unset: `leasing: auto`, held 1 s]:
//! the leases' hold in seconds (`leasing: { hold: ... }`, sized as `auto`).
//! Everything runs on 127.0.0.1 and stops when the run ends.
#![allow(clippy::disallowed_types)]
// std's Instant: tests and benchmarks time the real world

// A load run is one scenario read top to bottom: its length is the scenario's.
#![allow(clippy::too_many_lines)]

use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// The tenant's limit: tokens a second and burst.
const RATE: u32 = 1_000;
const BURST: u32 = 1_000;
/// Requests in flight at most (the client's connections).
const IN_FLIGHT: usize = 256;

/// A process this run started, killed when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    // A cluster node's bus listens 10,000 above its port.
    loop {
        let port = StdListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        if port <= 55_535 {
            return port;
        }
    }
}

fn wait_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("redis-cli is installed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One redis-server, or three as a cluster: the ports, and the processes.
struct Redis {
    ports: Vec<u16>,
    _servers: Vec<Process>,
    _dir: tempfile::TempDir,
}

impl Redis {
    fn start(cluster: bool) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let n = if cluster { 3 } else { 1 };
        let mut ports = Vec::new();
        let mut servers = Vec::new();
        for i in 0..n {
            let port = free_port();
            let node_dir = dir.path().join(format!("node-{i}"));
            std::fs::create_dir_all(&node_dir).expect("a node directory");
            let mut cmd = Command::new("redis-server");
            cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .arg("--port")
                .arg(port.to_string())
                .arg("--dir")
                .arg(&node_dir);
            if cluster {
                cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"]);
            }
            let child = cmd
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server is installed");
            servers.push(Process(child));
            wait_port(port);
            ports.push(port);
        }
        if cluster {
            let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
            let out = Command::new("redis-cli")
                .args(["--cluster", "create"])
                .args(&addrs)
                .args(["--cluster-replicas", "0", "--cluster-yes"])
                .output()
                .expect("redis-cli is installed");
            assert!(out.status.success(), "cluster create failed");
            let deadline = Instant::now() + Duration::from_secs(20);
            while !ports
                .iter()
                .all(|&p| cli(p, &["cluster", "info"]).contains("cluster_state:ok"))
            {
                assert!(Instant::now() < deadline, "the cluster never came up");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Self {
            ports,
            _servers: servers,
            _dir: dir,
        }
    }

    /// The limiter block of a replica's config.
    fn limiter(&self) -> String {
        if self.ports.len() == 1 {
            format!(
                "  redis: {{ url: \"redis://127.0.0.1:{}\" }}",
                self.ports[0]
            )
        } else {
            let urls: Vec<String> = (self.ports.iter())
                .map(|p| format!("\"redis://127.0.0.1:{p}\""))
                .collect();
            format!("  redis: {{ cluster: [{}] }}", urls.join(", "))
        }
    }

    /// Script calls and CPU (µs, user + system) of all servers so far.
    fn counters(&self) -> (u64, f64) {
        let (mut calls, mut cpu) = (0, 0.0);
        for &port in &self.ports {
            let info = cli(port, &["info", "all"]);
            for line in info.lines() {
                let line = line.trim();
                if line.starts_with("cmdstat_eval") {
                    let n = line
                        .split("calls=")
                        .nth(1)
                        .and_then(|r| r.split(',').next());
                    calls += n.and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
                }
                for field in ["used_cpu_sys:", "used_cpu_user:"] {
                    if let Some(v) = line.strip_prefix(field) {
                        cpu += v.parse::<f64>().unwrap_or(0.0) * 1e6;
                    }
                }
            }
        }
        (calls, cpu)
    }
}

/// N replicas of the binary on one Redis: their ports, and the processes.
fn replicas(
    bin: &str,
    redis: &Redis,
    n: usize,
    leasing: Option<&str>,
    dir: &std::path::Path,
) -> (Vec<u16>, Vec<Process>) {
    let lease = leasing.map_or(String::new(), |l| format!(", leasing: {l}"));
    let mut ports = Vec::new();
    let mut procs = Vec::new();
    for i in 0..n {
        let port = free_port();
        let yaml = format!(
            "listeners:\n  - address: 127.0.0.1:{port}\n\
             limiter:\n  backend: redis\n  on_failure: closed\n{}\n\
             routes:\n  - name: api\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: tenant, rate: {RATE}/s, burst: {BURST}, key: [\"header:X-Tenant\"]{lease} }}\n",
            redis.limiter()
        );
        let path = dir.join(format!("replica-{i}.yaml"));
        std::fs::write(&path, yaml).expect("write a config");
        let child = Command::new(bin)
            .args(["--log-level", "error", "run", "--config"])
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{bin}: {e} (build it: cargo build --release)"));
        procs.push(Process(child));
        ports.push(port);
    }
    for &p in &ports {
        wait_port(p);
    }
    (ports, procs)
}

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

async fn get(client: &HttpClient, port: u16, tenant: &str) -> Option<(u16, bool)> {
    let req = hyper::Request::get(format!("http://127.0.0.1:{port}/"))
        .header("x-tenant", tenant)
        .body(Empty::new())
        .ok()?;
    let res = client.request(req).await.ok()?;
    Some((
        res.status().as_u16(),
        res.headers().contains_key("ratelimit"),
    ))
}

/// One run's figures.
struct Run {
    requests: usize,
    admitted: usize,
    seconds: f64,
    calls: u64,
    cpu_us: f64,
}

/// Offer `offered` requests a second of tenant `hot` for `seconds`, request i to replica
/// i mod N, at most `IN_FLIGHT` at once.
async fn drive(
    client: &HttpClient,
    ports: &[u16],
    redis: &Redis,
    offered: u32,
    seconds: Duration,
) -> Run {
    // Every replica reaches Redis (a 200 with the RateLimit header) before the clock starts.
    for &port in ports {
        let deadline = Instant::now() + Duration::from_secs(20);
        while get(client, port, "warm-up").await != Some((200, true)) {
            assert!(
                Instant::now() < deadline,
                "replica on {port} never reached Redis"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let (calls0, cpu0) = redis.counters();
    let admitted = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let period = Duration::from_secs_f64(1.0 / f64::from(offered));
    let start = Instant::now();
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::new();
    let mut i = 0;
    while start.elapsed() < seconds {
        tick.tick().await;
        let permit = gate.clone().acquire_owned().await.expect("the gate");
        let (client, admitted, sent) = (client.clone(), admitted.clone(), sent.clone());
        let port = ports[i % ports.len()];
        i += 1;
        tasks.push(tokio::spawn(async move {
            let answer = get(&client, port, "hot").await;
            sent.fetch_add(1, Ordering::Relaxed);
            if matches!(answer, Some((200, _))) {
                admitted.fetch_add(1, Ordering::Relaxed);
            }
            drop(permit);
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let (calls1, cpu1) = redis.counters();
    Run {
        requests: sent.load(Ordering::Relaxed),
        admitted: admitted.load(Ordering::Relaxed),
        seconds,
        // Less the INFO calls' own: none are scripts.
        calls: calls1 - calls0,
        cpu_us: cpu1 - cpu0,
    }
}

fn main() {
    let bin = std::env::var("TOLLGATE_BIN").unwrap_or_else(|_| "target/release/tollgate".into());
    let seconds = std::env::var("FLEET_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4.0);
    let offered: u32 = std::env::var("FLEET_OFFERED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3 * RATE);
    let hold: Option<f64> = std::env::var("FLEET_HOLD")
        .ok()
        .and_then(|s| s.parse().ok());
    let leasing = hold.map_or("auto".to_string(), |h| {
        format!("{{ hold: {}ms }}", (h * 1000.0).round())
    });
    let hold = hold.unwrap_or(1.0);
    let sizes: Vec<usize> = std::env::var("FLEET_SIZES")
        .unwrap_or_else(|_| "2 8 32".into())
        .split_whitespace()
        .filter_map(|s| s.parse().ok())
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = rt.block_on(async {
        Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(IN_FLIGHT)
            .build(connector)
    });
    // `auto`'s most tokens per lease: min(1024 x cost, burst / 4, rate x hold).
    let lease_max = (1024).min(BURST / 4).min((f64::from(RATE) * hold) as u32);
    println!(
        "Limit {RATE}/s, burst {BURST}, one tenant offered {offered} req/s for {seconds} s, \
         spread evenly over the replicas; `leasing: {leasing}` leases at most L = {lease_max} tokens.\n"
    );
    println!("| Redis | replicas | leasing | requests | admitted | burst + rate x t | bound + N x L | script calls per request | redis-server CPU per request (µs) | requests/s one Redis core sustains at that CPU |");
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for cluster in [false, true] {
        for &n in &sizes {
            for leasing in [None, Some(leasing.as_str())] {
                let redis = Redis::start(cluster);
                let dir = tempfile::tempdir().expect("a temporary directory");
                let (ports, procs) = replicas(&bin, &redis, n, leasing, dir.path());
                let run = rt.block_on(drive(
                    &client,
                    &ports,
                    &redis,
                    offered,
                    Duration::from_secs_f64(seconds),
                ));
                drop(procs);
                let exact = f64::from(BURST) + f64::from(RATE) * run.seconds;
                let bound = exact + (n as f64) * f64::from(lease_max);
                let per_request = run.cpu_us / run.requests.max(1) as f64;
                println!(
                    "| {} | {n} | {} | {} | {} | {exact:.0} | {bound:.0} | {:.4} | {per_request:.2} | {:.0} |",
                    if cluster { "3-master Cluster" } else { "one redis-server" },
                    leasing.unwrap_or("off"),
                    run.requests,
                    run.admitted,
                    run.calls as f64 / run.requests.max(1) as f64,
                    1e6 / per_request.max(1e-9),
                );
                assert!(
                    (run.admitted as f64) <= bound,
                    "admitted {} over the bound {bound:.0}",
                    run.admitted
                );
            }
        }
    }
}
