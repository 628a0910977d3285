//! Concurrency limits (`concurrency: N`) through the real proxy, on real sockets: in process,
//! and over real redis-server processes shared by two replicas, one of them a binary killed
//! with SIGKILL while it holds slots.

use crate::common;
use crate::common::redis as redis_helpers;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{config, BinaryProxy, Http, Raw, TestProxy};
use redis_helpers::{RedisCluster, RedisServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// How long a test polls for a state before failing.
const DEADLINE: Duration = Duration::from_secs(15);

/// An HTTP/1.1 backend that answers `/fast` at once and holds each `/hold` until `release`.
struct Held {
    addr: SocketAddr,
    /// `/hold` requests that arrived.
    arrived: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
}

impl Held {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let arrived = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Semaphore::new(0));
        let (a, g) = (arrived.clone(), gate.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let (a, g) = (a.clone(), g.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    loop {
                        let mut chunk = [0u8; 4096];
                        let Ok(n) = s.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                        buf.drain(..end + 4);
                        if head.contains(" /hold") {
                            a.fetch_add(1, Ordering::SeqCst);
                            g.acquire().await.unwrap().forget();
                        }
                        let res = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if s.write_all(res).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            addr,
            arrived,
            gate,
        }
    }

    fn arrived(&self) -> usize {
        self.arrived.load(Ordering::SeqCst)
    }

    fn release(&self, n: usize) {
        self.gate.add_permits(n);
    }

    async fn wait_arrived(&self, n: usize) {
        let start = Instant::now();
        while self.arrived() < n {
            assert!(
                start.elapsed() < DEADLINE,
                "{n} held requests never arrived"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn routes(upstream: SocketAddr, limits: &str) -> String {
    format!(
        "upstreams:\n  app:\n    targets: [{upstream}]\n    connect_timeout: 1s\n    timeout: 60s\n\
         routes:\n  - name: r\n    match: {{ path_prefix: / }}\n    upstream: app\n    limits:\n{limits}"
    )
}

const TWO: &str = "      - { name: c, concurrency: 2, key: [ip] }\n";

/// Poll `/fast` until it is admitted (200), within the deadline.
async fn until_admitted(http: &Http, url: &str) {
    let start = Instant::now();
    loop {
        let r = http.get(url).await;
        if r.code() == 200 {
            return;
        }
        assert!(matches!(r.code(), 429 | 503), "{r:?}");
        assert!(start.elapsed() < DEADLINE, "the slot never came free");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Hold `n` requests to `url` in flight (each on a connection of its own).
fn hold(url: &str, n: usize) -> Vec<tokio::task::JoinHandle<u16>> {
    (0..n)
        .map(|_| {
            let url = url.to_owned();
            tokio::spawn(async move { Http::new().get(&url).await.code() })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_in_flight_then_429_and_a_finished_or_aborted_request_frees_its_slot() {
    let up = Held::start().await;
    let proxy = TestProxy::start(&config(&routes(up.addr, TWO)));
    let http = Http::new();
    let admitted = http.get(&proxy.url("/fast")).await;
    assert_eq!(admitted.code(), 200);
    assert_eq!(admitted.opt_header("ratelimit"), None, "{admitted:?}");
    let held = hold(&proxy.url("/hold"), 2);
    up.wait_arrived(2).await;
    // Full: the third is refused, with a retry in a second.
    let r = http.get(&proxy.url("/fast")).await;
    assert_eq!(r.code(), 429, "{r:?}");
    assert_eq!(r.header("retry-after"), "1");
    // The refusal reports the limit (slots as `q`, none left, a second to wait); an admitted
    // request reports none (a slot is not a token), as the README says.
    assert_eq!(r.header("ratelimit"), "\"c\";r=0;t=1", "{r:?}");
    assert!(r.text().contains("'c'"), "{}", r.text());
    // One finishes: its slot is free (once its response body is done).
    up.release(1);
    until_admitted(&http, &proxy.url("/fast")).await;
    // Fill again, then abort one: the client going away frees its slot.
    let mut raw = Raw::open(proxy.addr()).await;
    raw.send(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n").await;
    up.wait_arrived(3).await;
    assert_eq!(http.get(&proxy.url("/fast")).await.code(), 429);
    drop(raw);
    until_admitted(&http, &proxy.url("/fast")).await;
    up.release(10);
    let codes: Vec<u16> = futures_join(held).await;
    assert_eq!(codes, [200, 200]);
}

async fn futures_join(handles: Vec<tokio::task::JoinHandle<u16>>) -> Vec<u16> {
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_rejection_gives_the_slot_back_and_a_concurrency_one_takes_no_token() {
    let up = Held::start().await;
    let limits = "      - { name: c, concurrency: 1, key: [ip] }\n      - { name: r, rate: 1/min, burst: 2, key: [ip] }\n";
    let proxy = TestProxy::start(&config(&routes(up.addr, limits)));
    let http = Http::new();
    let held = hold(&proxy.url("/hold"), 1);
    up.wait_arrived(1).await;
    // Refused by the concurrency limit: no token is taken from `r`.
    for _ in 0..3 {
        let r = http.get(&proxy.url("/fast")).await;
        assert_eq!((r.code(), r.header("retry-after")), (429, "1"));
    }
    up.release(1);
    assert_eq!(futures_join(held).await, [200]);
    // `r` still holds its second token, and then refuses: its rejection held no slot.
    until_admitted(&http, &proxy.url("/fast")).await;
    let r = http.get(&proxy.url("/fast")).await;
    assert_eq!(r.code(), 429);
    assert!(r.text().contains("'r'"), "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_counts_but_never_rejects_and_the_config_refuses_rate_with_concurrency() {
    let up = Held::start().await;
    let limits = "      - { name: c, concurrency: 1, key: [ip], shadow: true }\n";
    let proxy = TestProxy::start(&config(&routes(up.addr, limits)));
    let held = hold(&proxy.url("/hold"), 3);
    up.wait_arrived(3).await;
    up.release(3);
    assert_eq!(futures_join(held).await, [200, 200, 200]);
    let bad = config(&routes(
        up.addr,
        "      - { name: c, concurrency: 2, rate: 1/s, key: [ip] }\n",
    ));
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &bad).unwrap();
    let out = common::check(file.path().to_str().unwrap());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(err.contains("both `rate` and `concurrency`"), "{err}");
    assert!(
        err.contains(":13:9: routes[0].limits[0]"),
        "names line and column: {err}"
    );
}

fn redis_block(url: &str) -> String {
    format!("limiter:\n  backend: redis\n  redis:\n    url: \"{url}\"\n    timeout: 1s\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_n_and_a_killed_replica_frees_its_slots_within_the_lease() {
    let redis = RedisServer::start();
    let up = Held::start().await;
    // `closed`: a request that did not get its lease from Redis is refused, not let through.
    let limits = "      - { name: c, concurrency: 3, key: [ip], lease: 2s, on_failure: closed }\n";
    let yaml = config(&format!(
        "{}{}",
        redis_block(&redis.url()),
        routes(up.addr, limits)
    ));
    let a = TestProxy::start(&yaml);
    let b = TestProxy::start(&yaml);
    let http = Http::new();
    // Two in flight through A, one through B: the fleet's three.
    let mut held = hold(&a.url("/hold"), 2);
    up.wait_arrived(2).await;
    held.extend(hold(&b.url("/hold"), 1));
    up.wait_arrived(3).await;
    for p in [&a, &b] {
        let r = http.get(&p.url("/fast")).await;
        assert_eq!((r.code(), r.header("retry-after")), (429, "1"), "{r:?}");
    }
    // Held past several lease periods: renewals keep the slots taken.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        http.get(&b.url("/fast")).await.code(),
        429,
        "renewed leases"
    );
    up.release(1);
    until_admitted(&http, &b.url("/fast")).await;
    // Exactly the two still held: no permit may be left over for the replica below.
    up.release(2);
    assert_eq!(futures_join(held).await, [200, 200, 200]);
    // A binary replica holds two slots and is killed: they come free within the lease.
    let c = BinaryProxy::start(&yaml);
    // Its connection to Redis is up once it answers (503 until then).
    until_admitted(&http, &c.url("/fast")).await;
    let before = up.arrived();
    let mut raws = Vec::new();
    for _ in 0..3 {
        let mut raw = Raw::open(c.addr()).await;
        raw.send(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n").await;
        raws.push(raw);
    }
    up.wait_arrived(before + 3).await;
    assert_eq!(http.get(&a.url("/fast")).await.code(), 429);
    let members: u64 = redis
        .keys()
        .iter()
        .filter(|k| k.contains(":c:{"))
        .map(|k| redis.cli(&["ZCARD", k]).trim().parse::<u64>().unwrap())
        .sum();
    assert_eq!(members, 3, "one lease per request in flight");
    let status = std::process::Command::new("kill")
        .args(["-KILL", &c.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    until_admitted(&http, &a.url("/fast")).await;
    up.release(10);
    drop(raws);
}

/// Many requests arriving at once go to Redis as few batched calls: exactly N of them get a
/// slot, on one server and on a Cluster, and their releases come back in batches too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takes_arriving_together_are_batched_and_admit_exactly_n() {
    let server = RedisServer::start();
    let cluster = RedisCluster::start();
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let limiters = [
        redis_block(&server.url()),
        format!(
            "limiter:\n  backend: redis\n  redis:\n    cluster: [{}]\n    timeout: 1s\n",
            nodes.join(", ")
        ),
    ];
    let limits = "      - { name: c, concurrency: 5, key: [ip], on_failure: closed }\n";
    for (i, limiter) in limiters.iter().enumerate() {
        let up = Held::start().await;
        let proxy = TestProxy::start(&config(&format!("{limiter}{}", routes(up.addr, limits))));
        let http = Http::new();
        until_admitted(&http, &proxy.url("/fast")).await;
        let calls = |i: usize| {
            if i == 0 {
                server.script_calls()
            } else {
                cluster.script_calls()
            }
        };
        let before = calls(i);
        let held = hold(&proxy.url("/hold"), 40);
        up.wait_arrived(5).await;
        // The 35 refused answer while the 5 are held.
        let start = Instant::now();
        while held.iter().filter(|h| h.is_finished()).count() < 35 {
            assert!(start.elapsed() < DEADLINE, "the refusals never came");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        up.release(100);
        let codes = futures_join(held).await;
        let admitted = codes.iter().filter(|&&c| c == 200).count();
        let refused = codes.iter().filter(|&&c| c == 429).count();
        let made = calls(i) - before;
        eprintln!("limiter {i}: {admitted} admitted, {refused} refused, {made} script calls");
        assert_eq!((admitted, refused), (5, 35), "{codes:?}");
        assert!(
            made <= 20,
            "{made} script calls for 40 takes and 5 releases"
        );
    }
}
