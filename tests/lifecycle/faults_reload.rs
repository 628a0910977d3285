//! A config file caught half-written by the reload watcher: written in place by a writer that
//! pauses with the file open, or in several writes that each close it. Every intermediate
//! version here parses and drops a limit; none may be applied. The proxy is served in-process
//! and each test watches its config generation (1 as started).

use crate::common;

use std::future::Future;
use std::io::Write;
use std::time::{Duration, Instant};

use common::{config, Http, TestProxy};

/// No test here may take longer than this, whatever the proxy does.
const TEST_TIMEOUT: Duration = Duration::from_secs(20);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test did not finish in time")
}

/// Route `r` answering 200, limited per IP to `burst` a minute. Its last lines are the
/// limit: cut before them, the file still parses, with the route unlimited.
fn limited(burst: u32) -> String {
    config(&format!(
        "routes:\n  - name: r\n    respond: {{ status: 200 }}\n    limits:\n      \
         - {{ name: per-ip, rate: 100/min, burst: {burst}, key: [ip] }}\n"
    ))
}

/// The text up to (without) the route's `limits:`: a valid config, with the route unlimited.
fn without_limit(full: &str) -> &str {
    let cut = &full[..full.find("    limits:").expect("the limits")];
    assert!(
        tollgate::config::parse(cut).is_ok(),
        "the cut must parse: {cut}"
    );
    cut
}

/// Watch, for `period`, that the live config keeps `per-ip`: every answer carries its
/// `RateLimit-Policy` and the generation stays at `generation`.
async fn limit_stays(proxy: &TestProxy, generation: u64, period: Duration) -> usize {
    let http = Http::new();
    let until = Instant::now() + period;
    let mut probes = 0;
    while Instant::now() < until {
        let r = http.get(&proxy.url("/")).await;
        assert!(
            r.opt_header("ratelimit-policy").is_some(),
            "the limit vanished: {} {:?} (generation {})",
            r.code(),
            r.headers,
            proxy.generation()
        );
        assert_eq!(
            proxy.generation(),
            generation,
            "a half-written file was applied"
        );
        probes += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    probes
}

/// Wait until the live `RateLimit-Policy` has `q=burst`.
async fn until_burst(proxy: &TestProxy, burst: u32) {
    let http = Http::new();
    let deadline = Instant::now() + Duration::from_secs(8);
    let want = format!("q={burst}");
    loop {
        let r = http.get(&proxy.url("/")).await;
        if r.opt_header("ratelimit-policy")
            .is_some_and(|p| p.contains(&want))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "burst {burst} never live: {:?}",
            r.headers
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_half_written_by_a_writer_that_pauses_is_not_applied() {
    bounded(async {
        let proxy = TestProxy::start(&limited(1000));
        let next = limited(999);
        let half = without_limit(&next);
        // In place: truncate, the first part, a pause with the file open, then the rest.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(proxy.config_path())
            .expect("open the config");
        file.write_all(half.as_bytes())
            .expect("write the first part");
        let probes = limit_stays(&proxy, 1, Duration::from_millis(800)).await;
        file.write_all(&next.as_bytes()[half.len()..])
            .expect("write the rest");
        drop(file);
        let closed = Instant::now();
        until_burst(&proxy, 999).await;
        assert_eq!(
            proxy.generation(),
            2,
            "exactly one reload, to the whole file"
        );
        println!(
            "in-place write paused 800 ms with half the file: not applied ({probes} probes kept \
             the limit); the whole file live {} ms after its close",
            closed.elapsed().as_millis()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_written_in_several_closes_is_applied_once_whole() {
    bounded(async {
        let proxy = TestProxy::start(&limited(1000));
        let next = limited(999);
        let half = without_limit(&next);
        // Three writes, 100 ms apart, each opening and closing the file: the first two leave a
        // file that parses without the limit.
        std::fs::write(proxy.config_path(), &half[..half.len() / 2 + 20]).expect("write");
        // (cut mid-route: it may or may not parse; either way it must not be applied)
        tokio::time::sleep(Duration::from_millis(100)).await;
        std::fs::write(proxy.config_path(), half).expect("write");
        let probes = limit_stays(&proxy, 1, Duration::from_millis(100)).await;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(proxy.config_path())
            .expect("open the config");
        file.write_all(&next.as_bytes()[half.len()..])
            .expect("write the rest");
        drop(file);
        until_burst(&proxy, 999).await;
        // Give a late reload of an intermediate version every chance to show.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(proxy.generation(), 2, "one reload, of the whole file");
        println!("three closes 100 ms apart: one reload, the whole file ({probes} probes between)");
    })
    .await;
}
