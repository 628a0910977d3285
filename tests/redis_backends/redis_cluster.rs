//! The Redis limiter against a real three-master Redis Cluster: exact limits, keys spread by
//! client, a per-client and a global limit in one check (two slots, with refund), NOSCRIPT,
//! a cluster absent at startup, and a master killed (its slots fail fast, the others' go on).

use crate::common::redis as redis_helpers;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use redis_helpers::{free_cluster_port, limit, one, RedisCluster, PREFIX};
use tollgate::identity::ClientId;
use tollgate::limiter::redis::{RedisConfig, RedisLimiter, Unavailable};
use tollgate::limiter::{Check, Limit, Verdict};

fn cluster_limiter(urls: Vec<String>, timeout: Duration) -> RedisLimiter {
    let cfg = RedisConfig {
        url: None,
        cluster: urls,
        timeout,
        key_prefix: PREFIX.into(),
        ..RedisConfig::default()
    };
    RedisLimiter::new(&cfg).expect("a valid config")
}

#[tokio::test]
async fn cluster_limits_are_exact_spread_and_refunded() {
    let cluster = RedisCluster::start();
    let l = cluster_limiter(cluster.urls(), Duration::from_secs(1)).with_negative_cache(0);
    let per_client = limit("per-client", 0.01, 2, 1);
    let global = limit("global", 0.01, 3, 1);
    // Many clients: their buckets land on every master.
    for client in 0..100 {
        assert!(one(&l, &per_client, 1000 + client).await.unwrap().admitted);
    }
    let with_keys = cluster.nodes.iter().filter(|n| !n.keys().is_empty());
    assert!(with_keys.count() >= 2);
    assert_eq!(
        cluster.nodes.iter().map(|n| n.keys().len()).sum::<usize>(),
        100
    );
    // A client whose bucket is in another slot than the global one.
    let g = ClientId(0);
    let slot = |lim: &Limit, c: ClientId| cluster.keyslot(&l.key(lim, c));
    let third = (1u128..1000)
        .map(ClientId)
        .find(|&c| slot(&per_client, c) != slot(&global, g))
        .unwrap();
    let route = |c: ClientId| {
        [
            Check {
                limit: &per_client,
                client: c,
            },
            Check {
                limit: &global,
                client: g,
            },
        ]
    };
    // Clients 10, 11 take the global bucket's three tokens; per-client is exact.
    let ok = |v: &[Verdict]| v.iter().all(|v| v.admitted);
    assert!(ok(&l
        .check(&route(ClientId(10)), &[true, true])
        .await
        .unwrap()));
    assert!(ok(&l
        .check(&route(ClientId(10)), &[true, true])
        .await
        .unwrap()));
    let v = l.check(&route(ClientId(10)), &[true, true]).await.unwrap();
    assert!(!v[0].admitted && v[1].admitted, "per-client rejects: {v:?}");
    assert!(ok(&l
        .check(&route(ClientId(11)), &[true, true])
        .await
        .unwrap()));
    // `third`'s per-client bucket admits, the global one rejects: refunded.
    let v = l.check(&route(third), &[true, true]).await.unwrap();
    assert!(v[0].admitted && !v[1].admitted, "{v:?}");
    assert_eq!(one(&l, &per_client, third.0).await.unwrap().remaining, 1);
    assert!(l.stats().refunds >= 1);
    // NOSCRIPT on a cluster: SCRIPT LOAD reaches the master that needs it.
    for n in &cluster.nodes {
        n.cli(&["script", "flush"]);
    }
    assert_eq!(one(&l, &per_client, third.0).await.unwrap().remaining, 0);
    report_latency(&l).await;
}

/// Print what one check costs on a loopback cluster, on one slot and on two.
async fn report_latency(l: &RedisLimiter) {
    let (wide, wide_global) = (
        limit("wide", 1.0, 1_000_000, 1),
        limit("wide-g", 1.0, 1_000_000, 1),
    );
    let mut checks = vec![Check {
        limit: &wide,
        client: ClientId(5),
    }];
    for slots in [1, 2] {
        let t = Instant::now();
        for _ in 0..500 {
            assert!(l.check(&checks, &[true, true]).await.unwrap()[0].admitted);
        }
        eprintln!(
            "figure: cluster check over {slots} slot(s), mean {:?}",
            t.elapsed() / 500
        );
        checks.push(Check {
            limit: &wide_global,
            client: ClientId(0),
        });
    }
}

#[tokio::test]
async fn starts_without_the_cluster_and_connects_when_it_appears() {
    let mut ports = [0u16; 3];
    for i in 0..3 {
        ports[i] = loop {
            let p = free_cluster_port();
            if !ports.contains(&p) {
                break p;
            }
        };
    }
    let urls = ports
        .iter()
        .map(|p| format!("redis://127.0.0.1:{p}"))
        .collect();
    let t = Instant::now();
    let l = cluster_limiter(urls, Duration::from_millis(200))
        .with_breaker(3, Duration::from_millis(100));
    assert!(
        t.elapsed() < Duration::from_millis(50),
        "new() must not block"
    );
    let lim = limit("late", 0.01, 10, 1);
    let t = Instant::now();
    assert!(one(&l, &lim, 1).await.is_err());
    assert!(t.elapsed() < Duration::from_millis(400));
    let _cluster = RedisCluster::start_on(ports);
    let t = Instant::now();
    while one(&l, &lim, 1).await.is_err() {
        assert!(t.elapsed() < Duration::from_secs(10), "never connected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("figure: cluster answered {:?} after it formed", t.elapsed());
}

#[tokio::test]
async fn a_killed_master_fails_within_the_timeout_and_only_its_slots_fail_fast() {
    let mut cluster = RedisCluster::start();
    let timeout = Duration::from_millis(200);
    let l = cluster_limiter(cluster.urls(), timeout);
    let lim = limit("kill", 0.01, 10, 1);
    // A client of master 0, and one whose breaker range holds none of master 0's slots.
    let dead_ranges = cluster.slot_ranges(0);
    let breaker_of = |slot: u16| usize::from(slot) / RedisLimiter::SLOTS_PER_BREAKER;
    let dead_breakers: HashSet<usize> = dead_ranges
        .iter()
        .flat_map(|&(a, b)| breaker_of(a)..=breaker_of(b))
        .collect();
    let slot = |c: u128| cluster.keyslot(&l.key(&lim, ClientId(c)));
    let dead = (0..1000u128)
        .find(|&c| dead_ranges.iter().any(|&(a, b)| (a..=b).contains(&slot(c))))
        .expect("a client of master 0");
    let alive = (0..1000u128)
        .find(|&c| !dead_breakers.contains(&breaker_of(slot(c))))
        .expect("a client of another master");
    assert!(one(&l, &lim, dead).await.unwrap().admitted);
    assert!(one(&l, &lim, alive).await.unwrap().admitted);

    cluster.nodes[0].kill();
    let t = Instant::now();
    assert!(one(&l, &lim, dead).await.is_err());
    let took = t.elapsed();
    eprintln!("figure: check on a killed master failed in {took:?}");
    assert!(took < timeout * 2);
    // Three consecutive failures open the breaker of the dead client's slots ...
    for _ in 1..RedisLimiter::BREAKER_FAILURES {
        assert!(one(&l, &lim, dead).await.is_err());
    }
    let t = Instant::now();
    assert_eq!(one(&l, &lim, dead).await, Err(Unavailable::BreakerOpen));
    eprintln!("figure: with its breaker open: {:?}", t.elapsed());
    assert!(t.elapsed() < timeout / 2);
    assert!(l.breaker_open());
    // ... and only that one: a live master's client is still answered by Redis.
    let v = one(&l, &lim, alive).await;
    assert!(v.is_ok_and(|v| v.admitted && v.remaining == 8), "{v:?}");
}
