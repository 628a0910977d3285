//! The Redis limiter against real redis-server processes: the same answers as `local::check`,
//! atomic multi-limit checks, keys and TTLs, NOSCRIPT, failures (kill, stall, absent at
//! startup), the negative cache, two proxies on one bucket. Cluster: `redis_cluster.rs`.

use crate::common::redis as redis_helpers;

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis_helpers::{free_port, limit, one, RedisServer, PREFIX};
use tollgate::identity::{ClientId, KeySpec};
use tollgate::limiter::redis::{RedisConfig, RedisLimiter, Unavailable};
use tollgate::limiter::test_util;
use tollgate::limiter::Clock;
use tollgate::limiter::{Check, Limit, Verdict};

fn limiter(url: String, timeout: Duration) -> RedisLimiter {
    let cfg = RedisConfig {
        url: Some(url),
        cluster: Vec::new(),
        timeout,
        key_prefix: PREFIX.into(),
        ..RedisConfig::default()
    };
    RedisLimiter::new(&cfg).expect("a valid config")
}

fn local_one(lim: &Limit, client: u128, clock: &Clock) -> Verdict {
    test_util::check_in_process(lim, client, clock.now().us())
}

/// Step both backends through the same arrivals; their verdicts must agree.
async fn same_as_local(l: &RedisLimiter, lim: &Limit, clock: &Clock, expect: &[(bool, u64)]) {
    for &(admitted, remaining) in expect {
        let r = one(l, lim, 1).await.expect("redis answers");
        let loc = local_one(lim, 1, clock);
        assert_eq!((r.admitted, r.remaining), (admitted, remaining), "redis");
        assert_eq!(
            (loc.admitted, loc.remaining),
            (admitted, remaining),
            "local"
        );
        // The two clocks started a few hundred microseconds apart.
        assert!(
            (r.reset_us - loc.reset_us).abs() < 20_000.0,
            "{r:?} {loc:?}"
        );
        assert!((r.retry_after_us - loc.retry_after_us).abs() < 20_000.0);
    }
}

#[tokio::test]
async fn burst_refill_and_cost_match_local() {
    let server = RedisServer::start();
    let l = limiter(server.url(), Duration::from_secs(1));
    // 4/s, burst 3: a token every 250 ms.
    let lim = limit("burst", 4.0, 3, 1);
    let clock = Clock::new();
    let burst = [(true, 2), (true, 1), (true, 0), (false, 0), (false, 0)];
    same_as_local(&l, &lim, &clock, &burst).await;
    // 600 ms later: 2.4 tokens back, two whole ones.
    tokio::time::sleep(Duration::from_millis(600)).await;
    same_as_local(&l, &lim, &clock, &[(true, 1), (true, 0), (false, 0)]).await;
    // Cost 4 out of 10: 6, 2, then 2 left and rejected, 2 s of wait (1 token/s).
    let heavy = limit("heavy", 1.0, 10, 4);
    same_as_local(&l, &heavy, &clock, &[(true, 6), (true, 2), (false, 2)]).await;
    let v = one(&l, &heavy, 1).await.unwrap();
    assert!((v.retry_after_us - 2e6).abs() < 20_000.0, "{v:?}");
}

#[tokio::test]
async fn a_rejection_by_one_limit_takes_nothing_from_the_other() {
    let server = RedisServer::start();
    let l = limiter(server.url(), Duration::from_secs(1));
    let (a, b) = (limit("a", 0.01, 10, 1), limit("b", 0.01, 1, 1));
    let both = [
        Check {
            limit: &a,
            client: ClientId(7),
        },
        Check {
            limit: &b,
            client: ClientId(7),
        },
    ];
    let v = l.check(&both, &[true, true]).await.unwrap();
    assert!(v[0].admitted && v[1].admitted);
    for _ in 0..5 {
        let v = l.check(&both, &[true, true]).await.unwrap();
        assert!(v[0].admitted && !v[1].admitted, "{v:?}");
    }
    assert_eq!(one(&l, &a, 7).await.unwrap().remaining, 8, "a charged once");
    // A shadow limit's rejection blocks nothing: `a` is charged.
    let v = l.check(&both, &[true, false]).await.unwrap();
    assert!(v[0].admitted && !v[1].admitted);
    assert_eq!(one(&l, &a, 7).await.unwrap().remaining, 6);
}

/// A check that asks for a lease takes, once admitted, as many more tokens as the bucket holds
/// after its cost, up to the ask: the reply's `remaining` counts them (the caller holds
/// min(ask, remaining)); a top-up takes none for itself; a rejected check takes nothing.
#[tokio::test]
async fn a_lease_takes_its_tokens_only_when_the_check_charges() {
    use tollgate::limiter::leasing::Ask;
    let server = RedisServer::start();
    let l = limiter(server.url(), Duration::from_secs(1));
    let lim = limit("leased", 0.01, 10, 1);
    let check = [Check {
        limit: &lim,
        client: ClientId(9),
    }];
    let ask = |tokens, top_up| [Ask { tokens, top_up }];
    let (v, _) = l
        .check_tuned(None, &check, &[true], &[], &ask(4, false))
        .await
        .unwrap();
    assert!(v[0].admitted && v[0].remaining == 9, "{v:?}");
    // 1 + 4 taken: 5 left.
    assert_eq!(one(&l, &lim, 9).await.unwrap().remaining, 4);
    // A top-up of 3 takes 3 and nothing for itself.
    let (v, _) = l
        .check_tuned(None, &check, &[true], &[], &ask(3, true))
        .await
        .unwrap();
    assert!(v[0].admitted && v[0].remaining == 4, "{v:?}");
    // An ask beyond what is left takes what is left: 1 for the check, 0 after.
    let (v, _) = l
        .check_tuned(None, &check, &[true], &[], &ask(50, false))
        .await
        .unwrap();
    assert!(v[0].admitted && v[0].remaining == 0, "{v:?}");
    let v = one(&l, &lim, 9).await.unwrap();
    assert!(!v.admitted, "{v:?}");
    // Rejected: nothing taken, nothing leased (the bucket refills by time alone).
    let (v, _) = l
        .check_tuned(None, &check, &[true], &[], &ask(5, false))
        .await
        .unwrap();
    assert!(!v[0].admitted, "{v:?}");
}

/// The script reads a call's keys with MGET in chunks: a check of 9000 buckets (more than
/// Lua's `unpack` can take at once) is decided, charged all-or-nothing, and read back right.
#[tokio::test]
async fn a_check_of_thousands_of_buckets_reads_them_all() {
    let server = RedisServer::start();
    let l = limiter(server.url(), Duration::from_secs(5));
    let limits: Vec<Limit> = (0..9000)
        .map(|i| limit(&format!("l{i}"), 0.01, 2, 1))
        .collect();
    let checks: Vec<Check<'_>> = limits
        .iter()
        .map(|limit| Check {
            limit,
            client: ClientId(3),
        })
        .collect();
    let enforced = vec![true; checks.len()];
    for remaining in [1, 0] {
        let v = l.check(&checks, &enforced).await.expect("redis answers");
        assert!(v.iter().all(|v| v.admitted && v.remaining == remaining));
    }
    assert_eq!(server.keys().len(), 9000);
    let v = l.check(&checks, &enforced).await.expect("redis answers");
    assert!(v.iter().all(|v| !v.admitted), "every bucket is empty");
    // The last bucket alone: it was charged twice, like the first.
    assert!(!one(&l, &limits[8999], 3).await.unwrap().admitted);
}

#[tokio::test]
async fn keys_are_digests_and_expire_when_the_bucket_is_full() {
    let server = RedisServer::start();
    let l = limiter(server.url(), Duration::from_secs(1));
    let lim = limit("per-key", 10.0, 20, 1); // full again at most 2 s after a request
    let spec = KeySpec(vec![tollgate::identity::Alternative::parse(
        "header:X-API-Key",
    )
    .unwrap()]);
    let mut headers = http::HeaderMap::new();
    headers.insert("x-api-key", "secret-api-key-123".parse().unwrap());
    let (method, uri) = (http::Method::GET, http::Uri::from_static("/"));
    let view = tollgate::identity::RequestView {
        method: &method,
        uri: &uri,
        headers: &headers,
        client_ip: "192.0.2.1".parse().unwrap(),
        jwt: None,
    };
    let client = view.resolve(&spec);
    for _ in 0..5 {
        let checks = [Check {
            limit: &lim,
            client,
        }];
        assert!(l.check(&checks, &[true]).await.unwrap()[0].admitted);
    }
    let keys = server.keys();
    assert_eq!(keys, vec![format!("{PREFIX}per-key:{{{}}}", client.hex())]);
    assert!(keys.iter().all(|k| !k.contains("secret")));
    let pttl: i64 = server.cli(&["pttl", &keys[0]]).trim().parse().unwrap();
    // 5 tokens taken at 10/s: full again in 500 ms; never more than burst/rate = 2 s.
    assert!(pttl > 0 && pttl <= 500, "pttl {pttl}");
}

#[tokio::test]
async fn script_flush_falls_back_to_loading_the_script() {
    let server = RedisServer::start();
    let l = limiter(server.url(), Duration::from_secs(1));
    let lim = limit("flush", 0.01, 10, 1);
    assert_eq!(one(&l, &lim, 1).await.unwrap().remaining, 9);
    server.cli(&["script", "flush"]);
    assert_eq!(one(&l, &lim, 1).await.unwrap().remaining, 8);
    assert_eq!(one(&l, &lim, 1).await.unwrap().remaining, 7);
    // NOSCRIPT twice (a fresh server, then the flush), each followed by SCRIPT LOAD and the
    // EVALSHA again: 3 checks, 5 EVALSHA, 2 SCRIPT LOAD, no EVAL.
    assert_eq!(server.command_calls("evalsha"), 5);
    assert_eq!(server.command_calls("script|load"), 2);
    assert_eq!(server.command_calls("eval"), 0);
}

#[tokio::test]
async fn killed_redis_fails_fast_then_recovers_after_restart() {
    let mut server = RedisServer::start();
    let l = limiter(server.url(), Duration::from_millis(200))
        .with_breaker(3, Duration::from_millis(300));
    // Never exhausted, so every check goes to Redis (no negative cache).
    let lim = limit("kill", 0.01, 1_000_000, 1);
    assert!(one(&l, &lim, 1).await.unwrap().admitted);
    let t = Instant::now();
    for _ in 0..1000 {
        assert!(one(&l, &lim, 1).await.unwrap().admitted);
    }
    eprintln!("figure: check on loopback, mean {:?}", t.elapsed() / 1000);
    assert_eq!(l.stats().negative_hits, 0);

    server.kill();
    for i in 0..3 {
        let t = Instant::now();
        let r = one(&l, &lim, 1).await;
        eprintln!(
            "figure: failure {i} after kill: {:?} in {:?}",
            r,
            t.elapsed()
        );
        assert!(r.is_err());
        assert!(t.elapsed() < Duration::from_millis(400));
    }
    assert!(l.breaker_open());
    let t = Instant::now();
    for _ in 0..1000 {
        let r = one(&l, &lim, 1).await;
        assert_eq!(r, Err(Unavailable::BreakerOpen));
    }
    let per_call = t.elapsed() / 1000;
    eprintln!("figure: check with the breaker open, mean {per_call:?}");
    assert!(per_call < Duration::from_millis(20));

    server.restart();
    let back = wait_until_ok(&l, &lim, Duration::from_secs(5)).await;
    eprintln!("figure: answered again {back:?} after restart");
    assert!(!l.breaker_open());
    let s = l.stats();
    assert!(s.errors >= 1003 && s.breaker_rejections >= 1000, "{s:?}");
}

/// Poll until a check succeeds; returns how long it took.
async fn wait_until_ok(l: &RedisLimiter, lim: &Limit, within: Duration) -> Duration {
    let t = Instant::now();
    while one(l, lim, 1).await.is_err() {
        assert!(t.elapsed() < within, "Redis never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.elapsed()
}

#[tokio::test]
async fn stalled_redis_times_out_then_recovers() {
    let server = RedisServer::start();
    let timeout = Duration::from_millis(100);
    let l = limiter(server.url(), timeout).with_breaker(3, Duration::from_millis(300));
    let lim = limit("stall", 0.01, 100, 1);
    assert!(one(&l, &lim, 1).await.unwrap().admitted);
    server.pause();
    for _ in 0..3 {
        let t = Instant::now();
        assert_eq!(one(&l, &lim, 1).await, Err(Unavailable::Timeout));
        let took = t.elapsed();
        eprintln!("figure: check against a stalled Redis failed in {took:?}");
        assert!(took >= timeout && took < timeout * 3, "{took:?}");
    }
    assert_eq!(one(&l, &lim, 1).await, Err(Unavailable::BreakerOpen));
    server.resume();
    let back = wait_until_ok(&l, &lim, Duration::from_secs(3)).await;
    eprintln!("figure: answered again {back:?} after SIGCONT");
    assert_eq!(l.stats().timeouts, 3);
}

#[tokio::test]
async fn starts_without_redis_and_connects_when_it_appears() {
    let port = free_port();
    let t = Instant::now();
    let l = limiter(
        format!("redis://127.0.0.1:{port}"),
        Duration::from_millis(100),
    )
    .with_breaker(3, Duration::from_millis(100));
    assert!(
        t.elapsed() < Duration::from_millis(50),
        "new() must not block"
    );
    let lim = limit("late", 0.01, 10, 1);
    assert!(one(&l, &lim, 1).await.is_err());
    let _server = RedisServer::start_on(port);
    wait_until_ok(&l, &lim, Duration::from_secs(5)).await;
}

#[tokio::test]
async fn negative_cache_answers_a_flood_without_asking_redis() {
    let server = RedisServer::start();
    let l = limiter(server.url(), Duration::from_secs(1));
    let lim = limit("flood", 2.0, 2, 1); // a token every 500 ms
    assert!(one(&l, &lim, 1).await.unwrap().admitted);
    assert!(one(&l, &lim, 1).await.unwrap().admitted);
    let first = one(&l, &lim, 1).await.unwrap();
    assert!(!first.admitted);
    let (calls, evalsha) = (l.stats().redis_calls, server.command_calls("evalsha"));
    let mut last_retry = first.retry_after_us;
    let t = Instant::now();
    let mut flood = 0u64;
    while t.elapsed() < Duration::from_millis(300) {
        let v = one(&l, &lim, 1).await.unwrap();
        assert!(
            !v.admitted && v.remaining == 0 && v.retry_after_us > 0.0,
            "{v:?}"
        );
        assert!(v.retry_after_us <= last_retry && v.reset_us > 0.0);
        last_retry = v.retry_after_us;
        flood += 1;
    }
    assert_eq!(l.stats().redis_calls, calls, "the flood cost no Redis call");
    assert_eq!(server.command_calls("evalsha"), evalsha);
    assert_eq!(l.stats().negative_hits, flood);
    eprintln!("figure: {flood} rejections in 300 ms answered without Redis");
    // Another client and another limit are not affected.
    assert!(one(&l, &lim, 2).await.unwrap().admitted);
    // Once the token is back, Redis is asked again and admits exactly one.
    // (plus a margin for the part of the round trip the cache could not see)
    tokio::time::sleep(Duration::from_secs_f64(last_retry / 1e6 + 0.02)).await;
    assert!(one(&l, &lim, 1).await.unwrap().admitted);
    assert!(!one(&l, &lim, 1).await.unwrap().admitted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_hammering_one_bucket_never_over_admit() {
    let server = RedisServer::start();
    // Two limiters are two proxies of a fleet: separate connections, caches and breakers.
    let proxies: Vec<Arc<RedisLimiter>> = (0..2)
        .map(|_| Arc::new(limiter(server.url(), Duration::from_secs(2))))
        .collect();
    let lim = Arc::new(limit("shared", 0.001, 150, 1));
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (l, lim) = (proxies[i % 2].clone(), lim.clone());
            tokio::spawn(async move {
                let mut admitted = 0u32;
                for _ in 0..50 {
                    if one(&l, &lim, 42).await.unwrap().admitted {
                        admitted += 1;
                    }
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert_eq!(
        admitted, 150,
        "400 requests, burst 150, no refill to speak of"
    );
}

/// A replica that was idle while Redis restarted decides its first check after: its pooled
/// connection is found dead, replaced, and the call sent again on the new one (counted).
#[tokio::test]
async fn an_idle_replica_decides_its_first_check_after_a_restart() {
    let mut server = RedisServer::start();
    let l = limiter(server.url(), Duration::from_secs(2));
    let lim = limit("idle", 0.01, 1_000_000, 1);
    assert!(one(&l, &lim, 1).await.unwrap().admitted);
    let before = l.stats().reconnects;
    server.restart();
    // Idle until Redis is back: nothing asked meanwhile.
    let probe = server.cli(&["ping"]);
    assert!(probe.contains("PONG"), "{probe}");
    let first = one(&l, &lim, 1).await;
    assert!(first.is_ok_and(|v| v.admitted), "{first:?}");
    assert!(l.stats().reconnects > before, "{:?}", l.stats());
}
