//! Bucket-table exhaustion through the real proxy: a flood of random API keys, from one address
//! and from many, against a limit with a small `max_buckets`. Memory stays bounded, the
//! flooder is limited as one client per address, and newcomers from other addresses still get
//! their own burst. Clients are real sockets from distinct loopback addresses; the proxy is
//! served in-process.

use crate::common;

use std::future::Future;
use std::time::Duration;

use common::{config, sample, Http, TestProxy};

/// No test here may take longer than this, whatever the proxy does.
const TEST_TIMEOUT: Duration = Duration::from_mins(1);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test did not finish in time")
}

/// 640 buckets at most, 20 per address; `per-key` allows 2 an hour per API key (nothing
/// refills while a test runs, however slow the machine).
fn proxy() -> TestProxy {
    TestProxy::start(&config(
        "admin:\n  address: 127.0.0.1:0\n\
         limiter:\n  local: { max_buckets: 640, max_buckets_per_peer: 20 }\n\
         routes:\n  - name: api\n    respond: { status: 200 }\n    limits:\n      \
         - { name: per-key, rate: 2/h, burst: 2, key: [header:X-API-Key] }\n",
    ))
}

/// Send one request per key in `keys` from `http`; how many were admitted.
async fn flood(http: &Http, url: &str, keys: impl Iterator<Item = String>) -> usize {
    let mut admitted = 0;
    for key in keys {
        let code = http.get_with(url, &[("x-api-key", &key)]).await.code();
        assert!(code == 200 || code == 429, "{code}");
        admitted += usize::from(code == 200);
    }
    admitted
}

/// A newcomer from `ip` with a fresh key: its statuses for three requests.
async fn newcomer(url: &str, ip: &str) -> Vec<u16> {
    let key = format!("newcomer-{ip}");
    Http::from_ip(ip)
        .statuses(3, url, &[("x-api-key", &key)])
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_random_key_flood_from_one_address_locks_nobody_else_out() {
    bounded(async {
        let proxy = proxy();
        let url = proxy.url("/api");
        let attacker = Http::from_ip("127.0.0.2");
        let admitted = flood(&attacker, &url, (0..3000).map(|i| format!("random-{i}"))).await;
        // 20 keys got a bucket each (one request each), the other 2980 shared one of 2.
        assert_eq!(admitted, 22);
        for ip in ["127.0.0.3", "127.0.0.4", "127.0.0.5"] {
            assert_eq!(
                newcomer(&url, ip).await,
                [200, 200, 429],
                "newcomer from {ip}"
            );
        }
        let scrape = Http::new()
            .get(&format!("http://{}/metrics", proxy.admin_addr()))
            .await;
        let text = scrape.text();
        let held = sample::<u64>(text, "tollgate_local_buckets{limit=\"per-key\"}");
        let shared = sample::<u64>(
            text,
            "tollgate_local_bucket_peer_overflows_total{limit=\"per-key\"}",
        );
        assert_eq!(held, 20 + 3, "{text}");
        assert_eq!(shared, 2980);
        println!(
            "3000 random keys from one address: {admitted} admitted, {held} buckets held, \
             {shared} counted in the address's bucket; 3 newcomers elsewhere: 200 200 429 each"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_many_addresses_keeps_memory_bound_and_newcomers_served() {
    bounded(async {
        let proxy = proxy();
        let url = proxy.url("/api");
        // 40 addresses x 60 keys: 2400 identities for a table of 640.
        let mut admitted = 0;
        for a in 10..50 {
            let http = Http::from_ip(&format!("127.0.1.{a}"));
            admitted += flood(&http, &url, (0..60).map(|i| format!("k-{a}-{i}"))).await;
        }
        let scrape = Http::new()
            .get(&format!("http://{}/metrics", proxy.admin_addr()))
            .await;
        let text = scrape.text();
        let held = sample::<u64>(text, "tollgate_local_buckets{limit=\"per-key\"}");
        assert!(held <= 640, "{held} buckets for a max_buckets of 640");
        // Each address: at most 20 keys with a bucket, the rest in its own bucket of 2.
        assert!(admitted <= 40 * 22, "{admitted}");
        for ip in ["127.0.2.1", "127.0.2.2"] {
            assert_eq!(
                newcomer(&url, ip).await,
                [200, 200, 429],
                "newcomer from {ip}"
            );
        }
        println!(
            "2400 keys from 40 addresses: {admitted} admitted, {held} buckets held (max 640); \
             newcomers from fresh addresses: 200 200 429"
        );
    })
    .await;
}
