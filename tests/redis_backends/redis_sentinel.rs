//! `limiter.redis.sentinel`: the limiter follows the master a real Sentinel names through a
//! failover (`SENTINEL FAILOVER`, and the master killed), and a client's tokens carry over
//! exactly by replication. The servers and the Sentinel have passwords; connections are named.

use crate::common;
use crate::common::redis as redis_helpers;

use std::time::{Duration, Instant};

use common::{config, Http, TestProxy};
use redis_helpers::{cli_with, limit, make_certs, one, SentinelSet, MASTER, MINIMAL_ACL, PREFIX};
use tollgate::config::settings::{RedisTls, SentinelSpec};
use tollgate::limiter::redis::{RedisConfig, RedisLimiter};
use tollgate::limiter::{Limit, Verdict};

const PASSWORD: &str = "server-secret";
const SENTINEL_PASSWORD: &str = "sentinel-secret";

fn limiter(set: &SentinelSet) -> RedisLimiter {
    limiter_with(set.sentinel_node(), None)
}

/// A limiter asking the Sentinel at `node`, with TLS files `tls`.
fn limiter_with(node: String, tls: Option<RedisTls>) -> RedisLimiter {
    let cfg = RedisConfig {
        sentinel: Some(SentinelSpec {
            master: MASTER.into(),
            nodes: vec![node],
            username: None,
            password: Some(SENTINEL_PASSWORD.into()),
        }),
        password: Some(PASSWORD.into()),
        tls,
        client_name: "tollgate-sentinel-test".into(),
        timeout: Duration::from_millis(500),
        key_prefix: PREFIX.into(),
        ..RedisConfig::default()
    };
    RedisLimiter::new(&cfg).expect("a valid config")
}

/// The first verdict Redis decides (checks that fail meanwhile are retried), and how many
/// checks failed before it. Panics after 30 s.
async fn decided(l: &RedisLimiter, lim: &Limit) -> (Verdict, u32) {
    let started = Instant::now();
    let mut failed = 0;
    loop {
        match one(l, lim, 7).await {
            Ok(v) => return (v, failed),
            Err(_) => failed += 1,
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "Redis decided nothing for 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Burst 5 and no refill to speak of: three checks before the failover leave exactly two.
async fn three_before(set: &SentinelSet, l: &RedisLimiter, lim: &Limit) -> (usize, usize) {
    for remaining in [4, 3, 2] {
        let (v, _) = decided(l, lim).await;
        assert!(v.admitted && v.remaining == remaining, "{v:?}");
    }
    let old = set.index_of(set.master_port());
    let new = 1 - old;
    set.wait_replicated(old, new);
    (old, new)
}

/// After the failover: exactly two more admitted, on the new master, by named connections.
async fn two_after(set: &SentinelSet, l: &RedisLimiter, lim: &Limit, new: usize) {
    let (second, _) = decided(l, lim).await;
    assert!(second.admitted && second.remaining == 0, "{second:?}");
    let (third, _) = decided(l, lim).await;
    assert!(!third.admitted, "{third:?}");
    assert_eq!(set.master_port(), set.known_port(new));
    let keys = set.server_cli(new, &["--scan"]);
    assert_eq!(keys.lines().count(), 1, "{keys}");
    let clients = set.server_cli(new, &["client", "list"]);
    assert!(
        clients.contains("name=tollgate-sentinel-test "),
        "{clients}"
    );
    assert!(l.stats().failovers >= 1, "{:?}", l.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_sentinel_failover_with_the_count_carried_over() {
    let set = SentinelSet::start(Some(PASSWORD), Some(SENTINEL_PASSWORD));
    let l = limiter(&set);
    let lim = limit("failover", 0.000_1, 5, 1);
    let (old, new) = three_before(&set, &l, &lim).await;
    let clients = set.server_cli(old, &["client", "list"]);
    assert!(
        clients.contains("name=tollgate-sentinel-test "),
        "{clients}"
    );

    // No check while both servers may be masters: what the old one took then would be lost
    // when it turns replica (Sentinel's failover is not a handover).
    set.fail_over(old, new);
    let started = Instant::now();
    let (first, failed) = decided(&l, &lim).await;
    eprintln!(
        "SENTINEL FAILOVER: first decision {:?} after the old master turned replica \
         ({failed} check(s) failed meanwhile)",
        started.elapsed()
    );
    assert!(first.admitted && first.remaining == 1, "{first:?}");
    two_after(&set, &l, &lim, new).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_killed_master_to_the_promoted_replica() {
    let mut set = SentinelSet::start(Some(PASSWORD), Some(SENTINEL_PASSWORD));
    let l = limiter(&set);
    let lim = limit("killed", 0.000_1, 5, 1);
    let (old, new) = three_before(&set, &l, &lim).await;

    // When the Sentinel names the new master, watched from a thread of its own.
    let (port, new_port) = (set.sentinel_port, set.known_port(new));
    let killed = Instant::now();
    let promoted = std::thread::spawn(move || loop {
        let out = cli_with(
            port,
            Some(SENTINEL_PASSWORD),
            &["sentinel", "get-master-addr-by-name", MASTER],
        );
        if out.contains(&new_port.to_string()) || killed.elapsed() > Duration::from_secs(30) {
            return killed.elapsed();
        }
        std::thread::sleep(Duration::from_millis(5));
    });
    set.servers[old].kill();
    // Checks fail (the failure policy applies) until the Sentinel promotes the replica.
    let (first, failed) = decided(&l, &lim).await;
    let decided_after = killed.elapsed();
    eprintln!(
        "master killed: the Sentinel named the replica {:?} after the kill (it waits 1 s to \
         call a master down), the first decision by it came {decided_after:?} after the kill \
         ({failed} check(s) failed meanwhile)",
        promoted.join().unwrap()
    );
    assert!(first.admitted && first.remaining == 1, "{first:?}");
    assert!(failed > 0, "the kill went unnoticed");
    two_after(&set, &l, &lim, new).await;
}

/// Through the proxy's YAML (the minimal ACL user, both passwords from the environment), with
/// two workers, each
/// with its own connection: a limit failing closed answers 503 while Redis cannot decide, so
/// 200 and 429 are Redis's own verdicts, and exactly two more 200s follow the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_follows_a_failover_from_its_yaml() {
    let mut set = SentinelSet::start(Some(PASSWORD), Some(SENTINEL_PASSWORD));
    // The ACL of docs/operations.md, on both servers (ACLs are not replicated).
    let mut acl = vec!["ACL", "SETUSER", "tollgate", "on", ">acl-secret"];
    acl.extend(MINIMAL_ACL);
    // Sentinel mode also asks each server its ROLE.
    acl.push("+role");
    for i in 0..2 {
        assert_eq!(set.server_cli(i, &acl).trim(), "OK");
    }
    std::env::set_var("TOLLGATE_TEST_SENTINEL_SERVER_PW", "acl-secret");
    std::env::set_var("TOLLGATE_TEST_SENTINEL_OWN_PW", SENTINEL_PASSWORD);
    let yaml = config(&format!(
        "admin:\n  address: 127.0.0.1:0\n\
         limiter:\n  backend: redis\n  on_failure: closed\n  redis:\n    sentinel:\n      master: {MASTER}\n      nodes: [{}]\n      password: ${{TOLLGATE_TEST_SENTINEL_OWN_PW}}\n    username: tollgate\n    password: ${{TOLLGATE_TEST_SENTINEL_SERVER_PW}}\n    timeout: 500ms\n\
         routes:\n  - name: all\n    respond: {{ status: 200 }}\n    limits:\n      - {{ name: sentinel-limit, rate: 1/h, burst: 5, key: [ip] }}\n",
        set.sentinel_node()
    ));
    let proxy = TestProxy::start(&yaml);
    let http = Http::new();
    assert_eq!(
        http.statuses(3, &proxy.url("/"), &[]).await,
        [200, 200, 200]
    );
    let served = http
        .get(&format!("http://{}/config", proxy.admin_addr()))
        .await;
    assert!(!served.text().contains("acl-secret"), "{}", served.text());
    assert!(
        !served.text().contains(SENTINEL_PASSWORD),
        "{}",
        served.text()
    );

    let old = set.index_of(set.master_port());
    let new = 1 - old;
    set.wait_replicated(old, new);
    let killed = Instant::now();
    set.servers[old].kill();
    let mut after = Vec::new();
    while after.len() < 3 {
        assert!(killed.elapsed() < Duration::from_secs(30), "{after:?}");
        match http.get(&proxy.url("/")).await.code() {
            503 => tokio::time::sleep(Duration::from_millis(20)).await,
            code => after.push((code, killed.elapsed())),
        }
    }
    eprintln!(
        "through the proxy: first decision {:?} after the kill",
        after[0].1
    );
    let codes: Vec<u16> = after.iter().map(|&(c, _)| c).collect();
    assert_eq!(codes, [200, 200, 429]);
    let clients = set.server_cli(new, &["client", "list"]);
    assert!(
        clients
            .lines()
            .any(|l| l.contains("name=tollgate ") && l.contains("user=tollgate ")),
        "{clients}"
    );
}

/// The Sentinel and the servers over TLS only for the limiter (client certificates required
/// everywhere), with the CA and client certificate of `limiter.redis.tls`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_a_failover_over_tls() {
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    let set = SentinelSet::start_with(Some(PASSWORD), Some(SENTINEL_PASSWORD), Some(certs.path()));
    let read = |name: &str| std::fs::read(certs.path().join(name)).unwrap();
    let tls = RedisTls {
        ca: Some(read("ca.crt")),
        client: Some((read("client.crt"), read("client.key"))),
    };
    let l = limiter_with(format!("127.0.0.1:{}", set.sentinel_tls_port), Some(tls));
    let lim = limit("tls-failover", 0.000_1, 5, 1);
    let (old, new) = three_before(&set, &l, &lim).await;
    set.fail_over(old, new);
    let (first, _) = decided(&l, &lim).await;
    assert!(first.admitted && first.remaining == 1, "{first:?}");
    two_after(&set, &l, &lim, new).await;
}

/// A manual failover under load (16 tasks checking one key as fast as they can): checks move
/// to the replica at its promotion, long before the old master is demoted. Every admitted
/// check took one token, so the tokens missing on the new master at the end are the decisions
/// the old master made after the promotion, lost at its resync; they are printed with the
/// checks of one second before the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_follow_the_promotion_not_the_demotion() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;
    const BURST: u32 = 2_000_000_000;
    let set = SentinelSet::start(Some(PASSWORD), Some(SENTINEL_PASSWORD));
    let l = Arc::new(limiter(&set));
    let lim = Arc::new(limit("promotion", 0.000_001, BURST, 1));
    decided(&l, &lim).await;
    let old = set.index_of(set.master_port());
    let new = 1 - old;
    let stop = Arc::new(AtomicBool::new(false));
    // The first check (above) was admitted too.
    let admitted = Arc::new(AtomicU64::new(1));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (l, lim, stop, admitted) = (l.clone(), lim.clone(), stop.clone(), admitted.clone());
            tokio::spawn(async move {
                while !stop.load(Relaxed) {
                    if matches!(one(&l, &lim, 7).await, Ok(v) if v.admitted) {
                        admitted.fetch_add(1, Relaxed);
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = admitted.load(Relaxed);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let per_second = admitted.load(Relaxed) - before;
    let on_new = set.script_calls(new);
    tokio::task::block_in_place(|| {
        set.failover();
        set.wait_until("checks reach the new master", |s| {
            s.script_calls(new) > on_new + 10
        });
        set.wait_until("the Sentinel names the replica", |s| {
            s.master_port() == s.known_port(new)
        });
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let (closing, _) = decided(&l, &lim).await;
    let counted = u64::from(BURST) - closing.remaining;
    let lost = (admitted.load(Relaxed) + 1).saturating_sub(counted);
    eprintln!(
        "SENTINEL FAILOVER under load: {per_second} checks a second; {lost} admitted checks \
         were lost with the old master ({:.2}% of a second's)",
        lost as f64 * 100.0 / per_second as f64
    );
    assert!(
        lost * 20 < per_second,
        "{lost} decisions lost against {per_second} a second"
    );
    assert!(l.stats().failovers >= 1, "{:?}", l.stats());
}

/// With every Sentinel gone, a dropped connection comes back to the last master they named
/// (it still answers `ROLE` as a master): the limits stay on, instead of failing every check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_sentinels_the_last_master_named_keeps_serving() {
    let mut set = SentinelSet::start(Some(PASSWORD), Some(SENTINEL_PASSWORD));
    let l = limiter(&set);
    let lim = limit("no-sentinel", 0.000_1, 5, 1);
    let (first, _) = decided(&l, &lim).await;
    assert_eq!(first.remaining, 4);
    let master = set.index_of(set.master_port());
    set.stop_sentinel();
    let killed = set.server_cli(master, &["client", "kill", "type", "normal"]);
    assert!(!killed.trim().is_empty(), "{killed}");
    let (next, failed) = decided(&l, &lim).await;
    assert!(next.admitted && next.remaining == 3, "{next:?}");
    assert!(
        failed <= 2,
        "{failed} checks failed before the last master was used"
    );
}
