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

/// Rewrite `path` every 30 ms, `versions` in turn, until `stop` is set.
fn keep_editing(
    path: std::path::PathBuf,
    versions: Vec<String>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for v in versions.iter().cycle() {
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            std::fs::write(&path, v).expect("rewrite the config");
            std::thread::sleep(Duration::from_millis(30));
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_signal_during_continuous_edits_reloads_at_once() {
    bounded(async {
        let text = limited(5);
        let proxy = TestProxy::start(&text);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        // The same bytes again and again: events that never pause, and nothing to reload.
        let editor = keep_editing(proxy.config_path().to_path_buf(), vec![text], stop.clone());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let asked = Instant::now();
        proxy.reload();
        let reloaded = proxy.wait_for_generation(2, Duration::from_secs(1)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        editor.join().unwrap();
        assert!(reloaded, "SIGHUP reloads at once, not when the edits pause");
        println!(
            "reloaded {:?} after the signal, edits going on",
            asked.elapsed()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_that_never_pause_are_read_within_the_maximum_wait() {
    bounded(async {
        let proxy = TestProxy::start(&limited(5));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let versions = vec![limited(6), limited(7)];
        let started = Instant::now();
        let editor = keep_editing(proxy.config_path().to_path_buf(), versions, stop.clone());
        let reloaded = proxy.wait_for_generation(2, Duration::from_secs(4)).await;
        let took = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        editor.join().unwrap();
        assert!(
            reloaded,
            "a file that changes every 30 ms is still read, after at most 2 s"
        );
        println!("first reload {took:?} into edits every 30 ms");
    })
    .await;
}
