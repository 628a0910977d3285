//! Hot reload end to end: in-place edits, editor-style replaces and Kubernetes ConfigMap symlink
//! swaps change limits and routes live; SIGHUP reloads; an invalid edit keeps the old config
//! serving, logs where the problem is and counts it in `/metrics`; limiter state survives a
//! reload that does not touch its limit.
//!
//! Tests that must see exactly their own file events, or need a config path of their own shape
//! (a symlink), run the binary through `Proc` on a config in a private directory; tests that
//! check what a reload logged run the binary through `BinaryProxy`; the others serve the proxy
//! in-process (`TestProxy`) and wait for its config generation rather than for a log line. The
//! configs of `BinaryProxy` and `TestProxy` sit in the shared temporary directory.

use crate::common;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{config, BinaryProxy, Http, Reply, TestProxy};

/// No test here may take longer than this, whatever the proxy does.
const TEST_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a reload may take to show before a test fails.
const RELOAD_DEADLINE: Duration = Duration::from_secs(5);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test)
        .await
        .expect("the test did not finish in time")
}

/// A route `r` answering `body` itself on every path, limited per IP to `burst` at 100/s.
fn answering(body: &str, burst: u32) -> String {
    config(&format!(
        "routes:\n  - name: r\n    respond: {{ status: 200, body: \"{body}\\n\" }}\n    \
         limits:\n      - {{ name: per-ip, rate: 100/s, burst: {burst}, key: [ip] }}\n"
    ))
}

/// The `q=` (burst) of the `RateLimit-Policy` a reply carries.
fn policy_q(r: &Reply) -> String {
    let policy = r.header("ratelimit-policy");
    policy
        .split(';')
        .find_map(|p| p.strip_prefix("q="))
        .unwrap_or_else(|| panic!("no q= in {policy:?}"))
        .to_owned()
}

/// Anything whose log lines a failing test should show (an in-process proxy has no log: its
/// config generation instead).
trait Logs {
    fn lines(&self) -> Vec<String>;
}

impl Logs for TestProxy {
    fn lines(&self) -> Vec<String> {
        vec![format!(
            "(in-process, no log) config generation {}",
            self.generation()
        )]
    }
}

impl Logs for BinaryProxy {
    fn lines(&self) -> Vec<String> {
        self.logs()
    }
}

/// A proxy serving on a config file that a test rewrites: in-process or the binary.
trait Served: Logs {
    fn url(&self, path: &str) -> String;
    fn config_path(&self) -> &Path;
}

impl Served for TestProxy {
    fn url(&self, path: &str) -> String {
        TestProxy::url(self, path)
    }
    fn config_path(&self) -> &Path {
        TestProxy::config_path(self)
    }
}

impl Served for BinaryProxy {
    fn url(&self, path: &str) -> String {
        BinaryProxy::url(self, path)
    }
    fn config_path(&self) -> &Path {
        BinaryProxy::config_path(self)
    }
}

/// Send `GET url` in a tight loop until `done` holds for a reply; return the time that took.
async fn until(
    proxy: &impl Logs,
    url: &str,
    what: &str,
    mut done: impl FnMut(&Reply) -> bool,
) -> Duration {
    let http = Http::new();
    let start = Instant::now();
    loop {
        let r = http.get(url).await;
        if done(&r) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < RELOAD_DEADLINE,
            "{what}: not seen within {RELOAD_DEADLINE:?}; last reply {} {:?} {:?}; logs: {:#?}",
            r.code(),
            r.headers,
            r.text(),
            proxy.lines()
        );
    }
}

/// Write `config` over the proxy's file and wait until `/two` answers `body`: the reload took.
async fn reload_until_two(proxy: &impl Served, config: String, body: &str, what: &str) {
    std::fs::write(proxy.config_path(), config).expect(what);
    until(proxy, &proxy.url("/two"), what, |r| r.text() == body).await;
}

/// Write `text` to a sibling of `path` and rename it over `path`, as editors and `kubectl cp` do.
fn replace_by_rename(path: &Path, text: &str) {
    let name = path.file_name().expect("a file name").to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).expect("write the new version");
    std::fs::rename(&tmp, path).expect("rename it over the config");
}

/// The value of the sample `series` (name and labels exactly as exposed) in a scrape.
fn sample(scrape: &str, series: &str) -> Option<u64> {
    scrape.lines().find_map(|l| {
        let value = l.strip_prefix(series)?.strip_prefix(' ')?;
        value.trim().parse().ok()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_edit_changes_the_limit_live() {
    bounded(async {
        let proxy = TestProxy::start(&answering("v1", 2));
        let url = proxy.url("/");
        let r = Http::new().get(&url).await;
        assert_eq!(policy_q(&r), "2");

        std::fs::write(proxy.config_path(), answering("v1", 5)).expect("edit the config");
        let took = until(&proxy, &url, "burst 5 after an in-place edit", |r| {
            policy_q(r) == "5"
        })
        .await;
        println!(
            "reload latency (in-place edit -> first reply on the new config): {} ms",
            took.as_millis()
        );
        assert!(
            proxy.wait_for_generation(2, Duration::from_secs(1)).await,
            "generation {}",
            proxy.generation()
        );
        let r = Http::new().get(&url).await;
        assert_eq!(r.code(), 200);
        assert_eq!(r.header("ratelimit-policy"), r#""per-ip";q=5;w=1"#);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_editor_style_replace_reloads() {
    bounded(async {
        let proxy = TestProxy::start(&answering("v1", 2));
        let url = proxy.url("/");
        assert_eq!(Http::new().get(&url).await.text(), "v1\n");

        replace_by_rename(proxy.config_path(), &answering("v2", 3));
        let took = until(&proxy, &url, "v2 after a rename", |r| r.text() == "v2\n").await;
        println!(
            "reload latency (write temp + rename): {} ms",
            took.as_millis()
        );
        assert_eq!(policy_q(&Http::new().get(&url).await), "3");

        // The watch survives the replace: the new file is watched too.
        replace_by_rename(proxy.config_path(), &answering("v3", 3));
        until(&proxy, &url, "v3 after a second rename", |r| {
            r.text() == "v3\n"
        })
        .await;
    })
    .await;
}

/// A ConfigMap volume: `tollgate.yaml -> ..data/tollgate.yaml`, `..data -> ..<timestamp>`.
struct ConfigMap {
    dir: tempfile::TempDir,
    version: Option<PathBuf>,
}

impl ConfigMap {
    fn new(text: &str) -> Self {
        let mut map = Self {
            dir: tempfile::tempdir().expect("a temporary directory"),
            version: None,
        };
        map.publish("..2026_01_01_00_00_00.1", text);
        std::os::unix::fs::symlink("..data/tollgate.yaml", map.path()).expect("link tollgate.yaml");
        map
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("tollgate.yaml")
    }

    /// What the kubelet does: write a new timestamped directory, point a temporary link at it,
    /// rename the link over `..data` (atomic), then delete the old directory.
    fn publish(&mut self, version: &str, text: &str) {
        let root = self.dir.path();
        std::fs::create_dir(root.join(version)).expect("create the version directory");
        std::fs::write(root.join(version).join("tollgate.yaml"), text).expect("write the version");
        std::os::unix::fs::symlink(version, root.join("..data_tmp")).expect("link ..data_tmp");
        std::fs::rename(root.join("..data_tmp"), root.join("..data")).expect("swap ..data");
        if let Some(old) = self.version.replace(root.join(version)) {
            std::fs::remove_dir_all(old).expect("remove the old version");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_symlink_swap_reloads() {
    bounded(async {
        let mut map = ConfigMap::new(&answering("v1", 2));
        let proxy = BinaryProxy::start_at(&map.path());
        let url = proxy.url("/");
        assert_eq!(Http::new().get(&url).await.text(), "v1\n");

        map.publish("..2026_01_01_00_00_00.2", &answering("v2", 4));
        let took = until(&proxy, &url, "v2 after the ..data swap", |r| {
            r.text() == "v2\n"
        })
        .await;
        println!(
            "reload latency (ConfigMap ..data swap): {} ms",
            took.as_millis()
        );
        assert_eq!(policy_q(&Http::new().get(&url).await), "4");

        // Again, now that the directory the first link pointed at is gone.
        map.publish("..2026_01_01_00_00_00.3", &answering("v3", 4));
        until(&proxy, &url, "v3 after the second swap", |r| {
            r.text() == "v3\n"
        })
        .await;
        assert!(proxy.wait_for_log("config reloaded generation=3", Duration::from_secs(1)));
        assert!(!proxy
            .logs()
            .iter()
            .any(|l| l.contains("config reload failed")));
    })
    .await;
}

/// The limited route of the invalid-edit test, with an admin listener, `rate` as given.
fn with_admin(body: &str, rate: &str) -> String {
    format!(
        "listeners:\n  - address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\nroutes:\n  \
         - name: r\n    respond: {{ status: 200, body: \"{body}\\n\" }}\n    limits:\n      \
         - {{ name: per-ip, rate: {rate}, burst: 5, key: [ip] }}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_edit_keeps_the_old_config_serving_and_is_counted() {
    bounded(async {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("tollgate.yaml");
        std::fs::write(&path, with_admin("old", "1/min")).expect("write the config");
        let proxy = BinaryProxy::start_at(&path);
        let url = proxy.url("/");
        let metrics = format!("http://{}/metrics", proxy.admin_addr());
        let http = Http::new();
        let r = http.get(&url).await;
        assert_eq!((r.code(), r.text()), (200, "old\n"));
        assert_eq!(r.header("ratelimit"), r#""per-ip";r=4;t=60"#);

        // A new body and an impossible rate: nothing of it may apply.
        let invalid = with_admin("new", "5/fortnight");
        std::fs::write(&path, &invalid).expect("write the invalid version");
        assert!(
            proxy.wait_for_log("config reload failed", RELOAD_DEADLINE),
            "no failed reload logged: {:#?}",
            proxy.logs()
        );
        let (line, col) = invalid
            .lines()
            .enumerate()
            .find_map(|(i, l)| Some((i + 1, l.find("5/fortnight")? + 1)))
            .expect("the bad rate is in the file");
        let at = format!("{}:{line}:{col}: routes[0].limits[0].rate", path.display());
        assert!(
            proxy.wait_for_log(&at, Duration::from_secs(1)),
            "the error names {at}: {:#?}",
            proxy.logs()
        );
        let r = http.get(&url).await;
        assert_eq!(r.text(), "old\n", "the old route still answers");
        assert_eq!(
            r.header("ratelimit"),
            r#""per-ip";r=3;t=120"#,
            "the old limit and its bucket still count"
        );
        let scrape = http.get(&metrics).await;
        assert_eq!(scrape.code(), 200);
        let s = scrape.text();
        assert_eq!(
            sample(s, r#"tollgate_config_reloads_total{result="failed"}"#),
            Some(1),
            "{s}"
        );
        assert_eq!(
            sample(s, r#"tollgate_config_reloads_total{result="ok"}"#),
            Some(0)
        );
        assert_eq!(sample(s, "tollgate_config_generation"), Some(1));

        // A YAML syntax error is refused the same way, with its position.
        std::fs::write(&path, "listeners: [\n").expect("write broken YAML");
        let deadline = Instant::now() + RELOAD_DEADLINE;
        let failed = loop {
            let s = http.get(&metrics).await;
            let failed = sample(
                s.text(),
                r#"tollgate_config_reloads_total{result="failed"}"#,
            );
            if failed != Some(1) || Instant::now() >= deadline {
                break failed;
            }
        };
        assert_eq!(failed, Some(2));
        // The counter goes up just before the error is logged; the position is the bracket
        // that is never closed.
        let at = format!("{}:1:12: unclosed bracket", path.display());
        assert!(
            proxy.wait_for_log(&at, Duration::from_secs(1)),
            "the error names {at}: {:#?}",
            proxy.logs()
        );
        assert_eq!(http.get(&url).await.text(), "old\n");

        // Fixing the file applies it.
        std::fs::write(&path, with_admin("fixed", "1/min")).expect("fix the config");
        assert!(
            proxy.wait_for_log("config reloaded generation=2", RELOAD_DEADLINE),
            "{:#?}",
            proxy.logs()
        );
        // Same limit, same bucket: four of its five tokens are spent.
        let r = http.get(&url).await;
        assert_eq!((r.code(), r.text()), (200, "fixed\n"));
        assert!(r.header("ratelimit").starts_with(r#""per-ip";r=1;"#));
        let s = http.get(&metrics).await;
        assert_eq!(
            sample(s.text(), r#"tollgate_config_reloads_total{result="ok"}"#),
            Some(1)
        );
        assert_eq!(sample(s.text(), "tollgate_config_generation"), Some(2));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads() {
    bounded(async {
        // The config is a link into a directory the proxy does not watch: only the signal can
        // make it notice an edit.
        let watched = tempfile::tempdir().expect("a temporary directory");
        let elsewhere = tempfile::tempdir().expect("a temporary directory");
        let real = elsewhere.path().join("real.yaml");
        std::fs::write(&real, answering("v1", 2)).expect("write the config");
        let path = watched.path().join("tollgate.yaml");
        std::os::unix::fs::symlink(&real, &path).expect("link the config");
        let proxy = BinaryProxy::start_at(&path);
        let url = proxy.url("/");
        assert_eq!(Http::new().get(&url).await.text(), "v1\n");

        std::fs::write(&real, answering("v2", 4)).expect("edit the config");
        proxy.signal("HUP");
        let took = until(&proxy, &url, "v2 after SIGHUP", |r| r.text() == "v2\n").await;
        println!("reload latency (edit + SIGHUP): {} ms", took.as_millis());
        assert_eq!(policy_q(&Http::new().get(&url).await), "4");
        assert!(proxy.wait_for_log("SIGHUP: reloading the config", Duration::from_secs(1)));
        assert!(proxy.wait_for_log("config reloaded generation=2", Duration::from_secs(1)));

        // A signal reloads even an unchanged file.
        proxy.signal("HUP");
        assert!(
            proxy.wait_for_log("config reloaded generation=3", RELOAD_DEADLINE),
            "{:#?}",
            proxy.logs()
        );
    })
    .await;
}

/// Routes `one` (`/one`, limit `one-per-ip` at `one_rate`) and `two` (`/two`, answering `two`).
fn two_routes(one_rate: &str, two: &str) -> String {
    config(&format!(
        "routes:\n  - name: one\n    match: {{ path: /one }}\n    respond: {{ status: 200 }}\n    \
         limits:\n      - {{ name: one-per-ip, {one_rate}, key: [ip] }}\n  - name: two\n    \
         match: {{ path: /two }}\n    respond: {{ status: 200, body: \"{two}\\n\" }}\n"
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limiter_state_survives_an_unrelated_reload() {
    bounded(async {
        // The binary: the test checks what the reload logged.
        let proxy = BinaryProxy::start(&two_routes("rate: 1/min, burst: 2", "two-v1"));
        let http = Http::new();
        let one = proxy.url("/one");
        assert_eq!(http.statuses(3, &one, &[]).await, [200, 200, 429]);

        reload_until_two(
            &proxy,
            two_routes("rate: 1/min, burst: 2", "two-v2"),
            "two-v2\n",
            "route two changed",
        )
        .await;
        let r = http.get(&one).await;
        assert_eq!(r.code(), 429, "the exhausted bucket survived the reload");
        assert!(r.header("ratelimit").starts_with(r#""one-per-ip";r=0;"#));
        assert!(proxy.wait_for_log(r#"changed=["route two"]"#, Duration::from_secs(1)));

        // A changed limit starts with fresh buckets.
        reload_until_two(
            &proxy,
            two_routes("rate: 2/min, burst: 2", "two-v3"),
            "two-v3\n",
            "route two changed again",
        )
        .await;
        assert_eq!(http.statuses(3, &one, &[]).await, [200, 200, 429]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_added_and_removed_by_a_reload() {
    let route = |name: &str| {
        format!(
            "  - name: {name}\n    match: {{ path: /{name} }}\n    \
             respond: {{ status: 200, body: \"{name}\\n\" }}\n"
        )
    };
    bounded(async {
        // The binary: the test checks what the reload logged.
        let proxy = BinaryProxy::start(&config(&format!(
            "routes:\n{}{}",
            route("keep"),
            route("old")
        )));
        let http = Http::new();
        assert_eq!(http.get(&proxy.url("/old")).await.code(), 200);
        assert_eq!(http.get(&proxy.url("/new")).await.code(), 404);

        std::fs::write(
            proxy.config_path(),
            config(&format!("routes:\n{}{}", route("keep"), route("new"))),
        )
        .expect("edit the routes");
        until(&proxy, &proxy.url("/new"), "the added route", |r| {
            r.code() == 200
        })
        .await;
        let r = http.get(&proxy.url("/new")).await;
        assert_eq!(r.text(), "new\n");
        assert_eq!(http.get(&proxy.url("/old")).await.code(), 404);
        assert_eq!(http.get(&proxy.url("/keep")).await.text(), "keep\n");
        assert!(proxy.wait_for_log(
            r#"added=["route new"] removed=["route old"] changed=[]"#,
            Duration::from_secs(1)
        ));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_right_after_startup_is_not_lost() {
    bounded(async {
        // Each proxy gets its edit as soon as it is listening. The race this guards
        // against is lost only some of the time, so try it on several proxies at once.
        let proxies: Vec<TestProxy> = (0..12)
            .map(|_| {
                let proxy = TestProxy::start(&answering("v1", 2));
                std::fs::write(proxy.config_path(), answering("v2", 2)).expect("edit");
                proxy
            })
            .collect();
        let deadline = Instant::now() + RELOAD_DEADLINE;
        let mut lost = Vec::new();
        for proxy in &proxies {
            let left = deadline.saturating_duration_since(Instant::now());
            if !proxy.wait_for_generation(2, left).await {
                lost.push(proxy.config_path().display().to_string());
            }
        }
        let http = Http::new();
        let mut serving_v1 = 0;
        for proxy in &proxies {
            if http.get(&proxy.url("/")).await.text() == "v1\n" {
                serving_v1 += 1;
            }
        }
        assert!(
            lost.is_empty(),
            "{} of {} proxies never applied an edit made right after they started (still \
             serving v1: {serving_v1}): {lost:?}",
            lost.len(),
            proxies.len()
        );
    })
    .await;
}

/// Upstream `app` (timeout as given) behind route `/app/`, and route `/two` answering `two`.
fn upstream_and_route(up: SocketAddr, timeout: &str, two: &str) -> String {
    config(&format!(
        "{}routes:\n  - name: app\n    match: {{ path_prefix: /app/ }}\n    upstream: app\n  \
         - name: two\n    match: {{ path: /two }}\n    respond: {{ status: 200, body: \"{two}\\n\" }}\n",
        common::upstream_app(up, timeout)
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_survive_a_reload_that_does_not_change_the_upstream() {
    bounded(async {
        let up = common::MockUpstream::start();
        let proxy = TestProxy::start(&upstream_and_route(up.addr(), "5s", "v1"));
        let http = Http::new();
        assert_eq!(http.get(&proxy.url("/app/a")).await.code(), 200);

        reload_until_two(
            &proxy,
            upstream_and_route(up.addr(), "5s", "v2"),
            "v2\n",
            "route two changed",
        )
        .await;
        assert_eq!(http.get(&proxy.url("/app/b")).await.code(), 200);

        // A changed upstream gets a new pool: a new connection.
        reload_until_two(
            &proxy,
            upstream_and_route(up.addr(), "6s", "v3"),
            "v3\n",
            "route two changed again",
        )
        .await;
        assert_eq!(http.get(&proxy.url("/app/c")).await.code(), 200);

        let seen = up.seen();
        assert_eq!(seen.len(), 3);
        assert_eq!(
            seen[0].peer, seen[1].peer,
            "the unchanged upstream's warm connection was dropped by the reload"
        );
        assert_ne!(
            seen[1].peer, seen[2].peer,
            "a changed upstream kept its old pool"
        );
    })
    .await;
}

/// A reload that takes seconds to build (thousands of routes) leaves the admin listener
/// answering: `/healthz` within a second throughout, so a liveness probe never fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_answered_during_a_long_reload() {
    bounded(async {
        let proxy = TestProxy::start(&config(
            "admin: { address: 127.0.0.1:0 }\nroutes:\n  - name: all\n    respond: { status: 200 }\n",
        ));
        let mut big = String::from("admin: { address: 127.0.0.1:0 }\nroutes:\n");
        for i in 0..5000 {
            use std::fmt::Write as _;
            let _ = write!(
                big,
                "  - name: r{i}\n    match: {{ path: /r{i} }}\n    respond: {{ status: 200 }}\n    limits: [{{ name: l{i}, rate: 10/s, key: [ip] }}]\n"
            );
        }
        let healthz = format!("http://{}/healthz", proxy.admin_addr());
        let http = Http::new();
        assert_eq!(http.get(&healthz).await.code(), 200);
        std::fs::write(proxy.config_path(), config(&big)).unwrap();
        proxy.reload();
        let (mut slowest, mut probes) = (Duration::ZERO, 0);
        while proxy.generation() < 2 {
            let asked = Instant::now();
            let r = tokio::time::timeout(Duration::from_secs(5), http.get(&healthz)).await;
            let took = asked.elapsed();
            assert!(r.is_ok_and(|r| r.code() == 200), "no answer in {took:?}");
            slowest = slowest.max(took);
            probes += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!("{probes} probes during the reload, the slowest {slowest:?}");
        assert!(slowest < Duration::from_secs(1), "a probe took {slowest:?}");
    })
    .await;
}
