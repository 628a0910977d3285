//! The candidate config end to end: decided beside the live config on every request and
//! counted in `tollgate_candidate_decisions_total`, never enforced (the upstream sees every
//! request the live config admits); reloaded when its file changes, keeping the buckets of its
//! unchanged limits; a broken one leaves the live config serving and is reported; `tollgate
//! check` names the candidate file, line and column of its problems.

use crate::common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{check, config, find_sample, sample, upstream_app, Http, MockUpstream, TestProxy};

/// A candidate file in the directory the test proxy's config is written to, so that the
/// config names it by its bare file name (relative to the config's directory).
struct CandidateFile(tempfile::TempPath);

impl CandidateFile {
    fn new(yaml: &str) -> Self {
        let file = tempfile::Builder::new()
            .prefix("tollgate-candidate-")
            .suffix(".yaml")
            .tempfile_in(std::env::temp_dir())
            .expect("create the candidate file");
        std::fs::write(file.path(), yaml).expect("write the candidate");
        Self(file.into_temp_path())
    }

    fn name(&self) -> String {
        self.0.file_name().unwrap().to_string_lossy().into_owned()
    }

    /// Replace the file as an editor or the kubelet does: a new file renamed over it.
    fn rewrite(&self, yaml: &str) {
        let next = PathBuf::from(format!("{}.next", self.0.display()));
        std::fs::write(&next, yaml).expect("write the new candidate");
        std::fs::rename(&next, &self.0).expect("rename it over the candidate");
    }
}

/// A live config forwarding everything to `upstream`, with an admin listener and `routes`.
fn live(upstream: &MockUpstream, candidate: &CandidateFile, routes: &str) -> String {
    config(&format!(
        "admin:\n  address: 127.0.0.1:0\ncandidate: {}\n{}routes:\n{routes}",
        candidate.name(),
        upstream_app(upstream.addr(), "5s"),
    ))
}

/// A candidate: a file of the same format, without listeners (they would be ignored).
fn candidate_yaml(routes: &str) -> String {
    format!("upstreams:\n  app:\n    targets: [127.0.0.1:9]\nroutes:\n{routes}")
}

fn route(name: &str, prefix: &str, limit: &str, rate: &str, burst: u32) -> String {
    format!(
        "  - name: {name}\n    match: {{ path_prefix: {prefix} }}\n    upstream: app\n    limits:\n      - {{ name: {limit}, rate: {rate}, burst: {burst}, key: [ip] }}\n"
    )
}

fn decisions(text: &str, route: &str, limit: &str, outcome: &str) -> u64 {
    let series = format!(
        "tollgate_candidate_decisions_total{{route=\"{route}\",limit=\"{limit}\",outcome=\"{outcome}\"}}"
    );
    find_sample(text, &series).unwrap_or(0)
}

/// Poll the metrics until `done` holds; panics with the last scrape after 10 s.
async fn wait_until(proxy: &TestProxy, what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = proxy.scrape().await;
        if done(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "{what} within 10 s:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn send(http: &Http, url: &str, n: usize) -> Vec<u16> {
    let mut codes = Vec::new();
    for _ in 0..n {
        codes.push(http.get(url).await.code());
    }
    codes
}

/// Live: a loose limit on `/api/` and a strict one on `/strict/`. Candidate: the opposite,
/// and no route for `/other/`. Every request the live config admits reaches the upstream;
/// the candidate counts exactly what its own limits would have done, the requests the live
/// config refused and the ones it has no route for included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_candidate_counts_what_it_would_limit_and_changes_nothing() {
    let upstream = MockUpstream::start();
    let candidate = CandidateFile::new(&candidate_yaml(
        &(route("c-api", "/api/", "three", "1/min", 3)
            + &route("c-strict", "/strict/", "hundred", "1000/s", 100)),
    ));
    let routes = route("api", "/api/", "loose", "1000/s", 1000)
        + &route("strict", "/strict/", "tight", "1/min", 1)
        + &route("other", "/other/", "other", "1000/s", 1000);
    let proxy = TestProxy::start(&live(&upstream, &candidate, &routes));
    let http = Http::new();
    assert_eq!(send(&http, &proxy.url("/api/x"), 10).await, [200; 10]);
    let strict = send(&http, &proxy.url("/strict/x"), 5).await;
    assert_eq!(
        strict,
        [200, 429, 429, 429, 429],
        "the live limit still decides"
    );
    assert_eq!(send(&http, &proxy.url("/other/x"), 2).await, [200; 2]);
    assert!(upstream.wait_for(13, Duration::from_secs(5)));
    assert_eq!(
        upstream.count(),
        13,
        "every request the live config admits is forwarded"
    );
    let text = proxy.scrape().await;
    assert_eq!(decisions(&text, "c-api", "three", "admitted"), 3);
    assert_eq!(decisions(&text, "c-api", "three", "limited"), 7);
    // The live config refused four of these: the candidate still sees all five.
    assert_eq!(decisions(&text, "c-strict", "hundred", "admitted"), 5);
    assert_eq!(decisions(&text, "c-strict", "hundred", "limited"), 0);
    assert_eq!(decisions(&text, "", "", "no_route"), 2);
    // The live decisions are the live limits' alone.
    let live = |route: &str, limit: &str, outcome: &str| -> u64 {
        sample(
            &text,
            &format!("tollgate_limit_decisions_total{{route=\"{route}\",limit=\"{limit}\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(live("api", "loose", "admitted"), 10);
    assert_eq!(live("api", "loose", "limited"), 0);
    assert_eq!(live("strict", "tight", "limited"), 4);
    assert_eq!(
        sample::<u64>(&text, "tollgate_candidate_last_reload_successful"),
        1
    );
    // Responses carry the live limit's headers only.
    let r = http.get(&proxy.url("/api/x")).await;
    assert_eq!(r.code(), 200);
    assert_eq!(r.header("ratelimit-policy"), "\"loose\";q=1000;w=1");
}

/// An edited candidate is reloaded: the changed limit counts with new buckets at its new
/// burst, the unchanged one keeps its buckets (and so its count of tokens used).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_candidate_is_reloaded_and_keeps_the_buckets_of_unchanged_limits() {
    let upstream = MockUpstream::start();
    let a = route("a", "/a/", "la", "1/min", 2);
    let candidate = CandidateFile::new(&candidate_yaml(
        &(a.clone() + &route("b", "/b/", "lb", "1/min", 3)),
    ));
    let routes = route("all", "/", "loose", "1000/s", 1000);
    let proxy = TestProxy::start(&live(&upstream, &candidate, &routes));
    let http = Http::new();
    assert_eq!(send(&http, &proxy.url("/a/"), 3).await, [200; 3]);
    assert_eq!(send(&http, &proxy.url("/b/"), 3).await, [200; 3]);
    let text = proxy.scrape().await;
    assert_eq!(
        [
            decisions(&text, "a", "la", "admitted"),
            decisions(&text, "a", "la", "limited")
        ],
        [2, 1]
    );
    assert_eq!(decisions(&text, "b", "lb", "admitted"), 3);

    candidate.rewrite(&candidate_yaml(&(a + &route("b", "/b/", "lb", "1/min", 5))));
    assert!(
        proxy.wait_for_generation(2, Duration::from_secs(10)).await,
        "a candidate edit reloads"
    );
    let loads = "tollgate_candidate_loads_total{result=\"ok\"}";
    assert_eq!(sample::<u64>(&proxy.scrape().await, loads), 2);
    assert_eq!(send(&http, &proxy.url("/a/"), 3).await, [200; 3]);
    assert_eq!(send(&http, &proxy.url("/b/"), 6).await, [200; 6]);
    let text = proxy.scrape().await;
    // `la` is unchanged: its bucket is still empty.
    assert_eq!(
        [
            decisions(&text, "a", "la", "admitted"),
            decisions(&text, "a", "la", "limited")
        ],
        [2, 4]
    );
    // `lb` changed: a new bucket of 5.
    assert_eq!(
        [
            decisions(&text, "b", "lb", "admitted"),
            decisions(&text, "b", "lb", "limited")
        ],
        [8, 1]
    );
    assert_eq!(upstream.count(), 15);
}

/// A candidate that does not load: the live config starts and serves, the failure is counted;
/// fixed, it is evaluated; broken again, the previous candidate goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_candidate_leaves_the_live_config_serving_and_is_reported() {
    let upstream = MockUpstream::start();
    let broken = candidate_yaml("  - name: c\n    upstream: app\n    limits:\n      - { name: lc, rate: fast, key: [ip] }\n");
    let candidate = CandidateFile::new(&broken);
    let routes = route("all", "/", "loose", "1000/s", 1000);
    let proxy = TestProxy::start(&live(&upstream, &candidate, &routes));
    let http = Http::new();
    assert_eq!(send(&http, &proxy.url("/x"), 2).await, [200; 2]);
    let text = proxy.scrape().await;
    assert_eq!(
        sample::<u64>(&text, "tollgate_candidate_last_reload_successful"),
        0
    );
    assert_eq!(
        sample::<u64>(&text, "tollgate_candidate_loads_total{result=\"failed\"}"),
        1
    );
    assert_eq!(
        sample::<u64>(&text, "tollgate_config_last_reload_successful"),
        1
    );
    assert!(
        !text.contains("tollgate_candidate_decisions_total{"),
        "no candidate: {text}"
    );

    candidate.rewrite(&candidate_yaml(&route("c", "/", "lc", "1/min", 1)));
    wait_until(&proxy, "the fixed candidate loads", |t| {
        find_sample::<u64>(t, "tollgate_candidate_last_reload_successful") == Some(1)
    })
    .await;
    assert_eq!(send(&http, &proxy.url("/x"), 2).await, [200; 2]);
    candidate.rewrite(&broken);
    let text = wait_until(&proxy, "the broken candidate is refused", |t| {
        find_sample::<u64>(t, "tollgate_candidate_loads_total{result=\"failed\"}") == Some(2)
    })
    .await;
    assert_eq!(
        sample::<u64>(&text, "tollgate_candidate_last_reload_successful"),
        0
    );
    // The previous candidate goes on, with its bucket: the next request is over its limit.
    assert_eq!(send(&http, &proxy.url("/x"), 1).await, [200]);
    let text = proxy.scrape().await;
    assert_eq!(decisions(&text, "c", "lc", "admitted"), 1);
    assert_eq!(decisions(&text, "c", "lc", "limited"), 2);
    assert_eq!(upstream.count(), 5);
}

/// `tollgate check` validates the candidate too, and names its file, line and column.
#[test]
fn check_names_the_candidate_file_line_and_column() {
    let out = check("tests/fixtures/candidate/live-broken.yaml");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let f = "tests/fixtures/candidate/broken.yaml";
    assert_eq!(
        stderr,
        format!("{f}: 2 problems\n  {f}:7:36: routes[0].limits[0].rate: rate `fast` must look like `10/s`, `5/min`, `100/h`, `1000/day` or `100/10s`\n  {f}:9:15: routes[1].upstream: unknown upstream `nowhere`\n")
    );
    let out = check("tests/fixtures/candidate/live.yaml");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("candidate tests/fixtures/candidate/strict.yaml (evaluated, never enforced):\nroute api-strict: * /api/* -> upstream app\n  limit per-ip: 1/s, burst 2, key [ip], on_failure open\n"),
        "{stdout}"
    );
}

/// A candidate whose limiter is Redis is still decided in process, at each limit's per-replica
/// share (`local_fallback.divide_by`): no Redis is running here, and nothing waits for one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_candidate_is_decided_in_process_at_its_per_replica_share() {
    let upstream = MockUpstream::start();
    let candidate = CandidateFile::new(&format!(
        "limiter:\n  backend: redis\n  redis: {{ url: \"redis://{}\" }}\n  local_fallback: {{ divide_by: 2 }}\n{}",
        common::refused_addr(),
        candidate_yaml(&route("c", "/", "fleet", "1/min", 4)),
    ));
    let routes = route("all", "/", "loose", "1000/s", 1000);
    let proxy = TestProxy::start(&live(&upstream, &candidate, &routes));
    let http = Http::new();
    assert_eq!(send(&http, &proxy.url("/x"), 5).await, [200; 5]);
    let text = proxy.scrape().await;
    assert_eq!(
        decisions(&text, "c", "fleet", "admitted"),
        2,
        "burst 4 / 2 replicas"
    );
    assert_eq!(decisions(&text, "c", "fleet", "limited"), 3);
    assert_eq!(decisions(&text, "c", "fleet", "without_backend"), 0);
}

/// A candidate concurrency slot is held for the request's lifetime, as a live one is: while a
/// slow request is in flight the candidate would refuse the client's next one, and once its
/// response is done, admit it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_concurrency_slot_is_held_while_the_request_is_in_flight() {
    let upstream = MockUpstream::start();
    let candidate = CandidateFile::new(&candidate_yaml(
        "  - name: c\n    upstream: app\n    limits:\n      - { name: one, concurrency: 1, key: [ip] }\n",
    ));
    let routes = route("all", "/", "loose", "1000/s", 1000);
    let proxy = TestProxy::start(&live(&upstream, &candidate, &routes));
    let slow = tokio::spawn({
        let url = proxy.url("/slow/500");
        async move { Http::new().get(&url).await.code() }
    });
    assert!(
        upstream.wait_for(1, Duration::from_secs(5)),
        "the slow request reaches the upstream"
    );
    let http = Http::new();
    assert_eq!(
        send(&http, &proxy.url("/x"), 1).await,
        [200],
        "never enforced"
    );
    assert_eq!(slow.await.unwrap(), 200);
    // Its client is gone: once its connection is closed, its response (and slot) is done.
    let text = wait_until(&proxy, "the slow request's connection to close", |t| {
        find_sample::<u64>(t, "tollgate_open_connections") == Some(1)
    })
    .await;
    assert_eq!(decisions(&text, "c", "one", "admitted"), 1);
    assert_eq!(decisions(&text, "c", "one", "limited"), 1);
    assert_eq!(send(&http, &proxy.url("/x"), 1).await, [200]);
    let text = proxy.scrape().await;
    assert_eq!(decisions(&text, "c", "one", "admitted"), 2);
    assert_eq!(decisions(&text, "c", "one", "limited"), 1);
}

/// A candidate needs no listeners, and its listeners and admin are not even compiled (a
/// missing certificate or token file there is no error); it cannot name a candidate itself.
/// Its path is relative to the main config's directory.
#[test]
fn a_candidate_ignores_listeners_and_admin_and_names_no_candidate() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("tollgate.yaml");
    std::fs::write(&main, config("candidate: c.yaml\n")).unwrap();
    let write = |yaml: &str| std::fs::write(dir.path().join("c.yaml"), yaml).unwrap();
    write(&format!(
        "listeners:\n  - address: 127.0.0.1:0\n    tls: {{ cert: /no/such.pem, key: /no/such.key }}\nadmin: {{ address: 127.0.0.1:0, token_file: /no/such/token }}\n{}",
        candidate_yaml(&route("c", "/", "lc", "1/s", 1))
    ));
    let settings = tollgate::config::load(&main).expect("the live config loads");
    let candidate = settings.candidate.as_ref().expect("a candidate");
    assert_eq!(candidate.path, dir.path().join("c.yaml"));
    let loaded = candidate.settings.as_ref().expect("the candidate loads");
    assert!(loaded.listeners.is_empty() && loaded.admin.is_none());
    assert_eq!(&*loaded.routes[0].name, "c");

    write("candidate: other.yaml\n");
    let settings = tollgate::config::load(&main).expect("the live config still loads");
    let e = settings
        .candidate_error()
        .expect("the candidate is refused");
    assert_eq!(e.file, dir.path().join("c.yaml").display().to_string());
    assert_eq!(e.problems.len(), 1, "{e}");
    assert_eq!(
        e.problems[0].message,
        "a candidate config cannot name a candidate of its own"
    );
    assert_eq!(e.problems[0].at, Some((1, 12)));
}
