//! `tollgate simulate` against a real proxy's JSON access log: the live proxy serves requests
//! from several API keys and addresses, then its log replayed through the same config gives
//! exactly the live 429s, a stricter config more, and a config keyed on a source the log does
//! not hold is reported as not replayable; lines that are not access lines are counted.

use crate::common;

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{config, upstream_app, BinaryProxy, Http, MockUpstream};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

/// Two routes: `api` keyed by API key, else address (`per_key`: the YAML of its limit), and
/// `ip` keyed by address. 5/min: no token comes back during a test.
fn routes(upstream: &MockUpstream, per_key: &str) -> String {
    config(&format!(
        "{}routes:\n  - name: api\n    match: {{ path_prefix: /api/ }}\n    upstream: app\n    limits:\n{per_key}  - name: ip\n    match: {{ path_prefix: /ip/ }}\n    upstream: app\n    limits:\n      - {{ name: per-ip, rate: 5/min, burst: 2, key: [ip] }}\n",
        upstream_app(upstream.addr(), "5s")
    ))
}

const PER_KEY: &str =
    "      - { name: per-key, rate: 5/min, burst: 3, key: [header:X-API-Key, ip] }\n";

/// `yaml` without its top-level `listeners` block: a candidate config.
fn without_listeners(yaml: &str) -> String {
    let mut inside = false;
    let mut out = String::new();
    for line in yaml.lines() {
        if !line.starts_with(' ') && !line.starts_with('-') {
            inside = line.starts_with("listeners:");
        }
        if !inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(!out.contains("listeners"), "{out}");
    out
}

/// Write `yaml` to a file in `dir`.
fn write_config(dir: &Path, name: &str, yaml: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, yaml).unwrap();
    path
}

/// `tollgate simulate --config CONFIG --log LOG ARGS...`, its stdout; `stdin` is piped in.
/// It must succeed.
fn simulate(config: &Path, log: &str, args: &[&str], stdin: Option<&[u8]>) -> String {
    let (ok, stdout, stderr) = simulate_any(config, log, args, stdin);
    assert!(ok, "simulate failed: {stderr}");
    stdout
}

/// `simulate`, succeeding or not: whether it did, its stdout and its stderr.
fn simulate_any(
    config: &Path,
    log: &str,
    args: &[&str],
    stdin: Option<&[u8]>,
) -> (bool, String, String) {
    let mut child = Command::new(BIN)
        .args(["simulate", "--config"])
        .arg(config)
        .args(["--log", log])
        .args(args)
        .env_remove("TOLLGATE_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tollgate simulate");
    let mut input = child.stdin.take().unwrap();
    if let Some(bytes) = stdin {
        input.write_all(bytes).unwrap();
    }
    drop(input);
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn report(config: &Path, log: &Path) -> Value {
    let out = simulate(config, log.to_str().unwrap(), &["--format", "json"], None);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn route<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("no route {name} in {report:#}"))
}

/// The traffic: (client address, API key, path, requests).
const TRAFFIC: &[(&str, Option<&str>, &str, usize)] = &[
    ("127.0.0.1", Some("key-alpha-secret"), "/api/a", 6),
    ("127.0.0.2", Some("key-beta-secret"), "/api/b", 2),
    // The same key from another address: the same bucket.
    ("127.0.0.3", Some("key-alpha-secret"), "/api/c", 1),
    ("127.0.0.2", None, "/api/d", 5),
    ("127.0.0.3", None, "/api/e", 4),
    ("127.0.0.1", None, "/ip/x", 4),
    ("127.0.0.4", None, "/ip/y", 1),
];

/// Serve `TRAFFIC` through a proxy running `yaml` with a JSON access log in `dir`; the 429s
/// per route (api, ip), and the log once the proxy has exited (every line written).
async fn live(yaml: &str, dir: &Path) -> ((usize, usize), std::path::PathBuf) {
    let log = dir.join("access.log");
    let mut proxy = BinaryProxy::start_with(
        yaml,
        &[
            "--access-log",
            log.to_str().unwrap(),
            "--access-log-format",
            "json",
        ],
        &[],
    );
    let (mut api, mut ip) = (0, 0);
    for &(from, key, path, n) in TRAFFIC {
        let http = Http::from_ip(from);
        let headers: Vec<(&str, &str)> = key.map(|k| ("x-api-key", k)).into_iter().collect();
        for code in http.statuses(n, &proxy.url(path), &headers).await {
            assert!(code == 200 || code == 429, "{code}");
            if code == 429 {
                *if path.starts_with("/api/") {
                    &mut api
                } else {
                    &mut ip
                } += 1;
            }
        }
    }
    proxy.terminate();
    assert!(proxy.wait_exit(Duration::from_secs(10)).is_some());
    ((api, ip), log)
}

#[tokio::test]
async fn the_same_config_replays_the_live_429s_exactly_and_a_stricter_one_more() {
    let upstream = MockUpstream::start();
    let dir = tempfile::tempdir().unwrap();
    let yaml = routes(&upstream, PER_KEY);
    let ((api_429, ip_429), log) = live(&yaml, dir.path()).await;
    // alpha: 7 requests, burst 3; no key from .2: 5; from .3: 4. /ip/ from .1: 4, burst 2.
    assert_eq!((api_429, ip_429), (4 + 2 + 1, 2));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains("secret"), "no API key in the log");
    assert!(
        text.contains("\"tollgate.keys\":{\"header:x-api-key\":"),
        "{text}"
    );

    let same = report(&write_config(dir.path(), "same.yaml", &yaml), &log);
    let api = route(&same, "api");
    assert_eq!(api["requests"], 18, "{same:#}");
    assert_eq!(api["rejected"], api_429);
    assert_eq!(api["admitted"], 18 - api_429);
    assert_eq!(api["live"]["rejected"], api_429);
    let per_key = &api["limits"][0];
    assert_eq!(per_key["rejected"], api_429);
    assert_eq!(per_key["live_rejected"], api_429);
    assert_eq!(route(&same, "ip")["rejected"], ip_429);
    assert_eq!(same["lines"]["replayed"], 23);
    // The same routes as a candidate config (no listeners, the file `candidate:` names)
    // replay as well: the incident runbook replays the candidate itself.
    let candidate = write_config(dir.path(), "candidate.yaml", &without_listeners(&yaml));
    let as_candidate = report(&candidate, &log);
    assert_eq!(route(&as_candidate, "api")["rejected"], api_429);
    assert_eq!(as_candidate["lines"]["replayed"], 23);
    // The key rejected most: alpha's digest (4), then the address .2 (2), then .3 (1).
    let top = per_key["most_rejected"].as_array().unwrap();
    assert_eq!(top.len(), 3, "{top:?}");
    assert!(top[0]["identity"]
        .as_str()
        .unwrap()
        .starts_with("header:x-api-key="));
    assert_eq!(top[0]["rejected"], 4);
    assert_eq!(top[1]["identity"], "ip=127.0.0.2");

    // Burst 2, and beta exempt by its key's value: alpha 5, .2 3, .3 2 rejected.
    let strict = "      - { name: per-key, rate: 5/min, burst: 2, key: [header:X-API-Key, ip], exempt: [\"header:X-API-Key=key-beta-secret\"] }\n";
    let strict = report(
        &write_config(dir.path(), "strict.yaml", &routes(&upstream, strict)),
        &log,
    );
    let api = route(&strict, "api");
    assert_eq!(api["rejected"], 10, "{strict:#}");
    assert!(api["rejected"].as_u64().unwrap() > api_429 as u64);
    assert_eq!(api["limits"][0]["exempt"], 2);
}

#[tokio::test]
async fn what_the_log_does_not_hold_is_reported_and_bad_lines_are_counted() {
    let upstream = MockUpstream::start();
    let dir = tempfile::tempdir().unwrap();
    let ((api_429, _), log) = live(&routes(&upstream, PER_KEY), dir.path()).await;

    // A key the live route's limits did not read, and a concurrency limit.
    let tenant = "      - { name: per-tenant, rate: 5/min, burst: 1, key: [header:X-Tenant] }\n      - { name: in-flight, concurrency: 2, key: [ip] }\n";
    let config = write_config(dir.path(), "tenant.yaml", &routes(&upstream, tenant));
    let r = report(&config, &log);
    let api = route(&r, "api");
    assert_eq!(api["not_replayed"], 18, "{r:#}");
    assert_eq!(api["requests"], 0);
    assert_eq!(api["limits"][0]["unlogged_sources"]["header:x-tenant"], 18);
    assert_eq!(api["limits"][1]["replayed"], false);
    let text = simulate(&config, log.to_str().unwrap(), &[], None);
    assert!(text.contains("cannot replay:"), "{text}");
    assert!(
        text.contains("`header:x-tenant` is not in the logged sources of 18 lines"),
        "{text}"
    );
    assert!(
        text.contains("limit in-flight: a concurrency limit"),
        "{text}"
    );

    // Bad lines among good ones, read from stdin: counted, never fatal.
    let mut bytes = std::fs::read(&log).unwrap();
    bytes.extend_from_slice(b"garbage\n\xff\xfe\x00\n{\"timestamp\":\"2026\n");
    bytes.extend_from_slice(b"{\"target\":\"tollgate\",\"message\":\"listening\"}\n\n");
    bytes.extend_from_slice(b"{\"timestamp\":\"2026-12-01T00:00:00Z\",\"target\":\"tollgate::access\",\"http.request.method\":\"GET\",\"duration_ms\":1}\n");
    bytes.extend_from_slice(b"{\"timestamp\":\"2026-12-01T00:00:00Z\",\"target\":\"tollgate::access\",\"http.request.method\":\"GET\",\"url.path\":\"/api/x\",\"duration_ms\":\"slow\"}\n");
    // Refused live by an operator's ban: not a line the replay could decide, said so.
    bytes.extend_from_slice(b"{\"timestamp\":\"2026-12-01T00:00:00Z\",\"target\":\"tollgate::access\",\"http.request.method\":\"GET\",\"url.path\":\"/api/x\",\"duration_ms\":1,\"tollgate.route\":\"api\",\"tollgate.outcome\":\"operator-ban\"}\n");
    let same = write_config(dir.path(), "same.yaml", &routes(&upstream, PER_KEY));
    let out = simulate(&same, "-", &["--format", "json"], Some(&bytes));
    let r: Value = serde_json::from_str(&out).unwrap();
    let skipped = &r["lines"]["skipped"];
    assert_eq!(
        (
            &skipped["not_json"],
            &skipped["not_access"],
            &skipped["malformed"]
        ),
        (&Value::from(3), &Value::from(1), &Value::from(2)),
        "{r:#}"
    );
    assert_eq!(r["lines"]["read"], 23 + 7);
    assert_eq!(r["lines"]["operator_banned"], 1, "{r:#}");
    assert_eq!(route(&r, "api")["rejected"], api_429);
}

/// A text access log replays nothing: the command says it is not JSON, names the flag that
/// makes a JSON one, and fails.
#[test]
fn a_text_log_is_refused_with_the_flag_to_use() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("text.log");
    std::fs::write(
        &log,
        "2026-12-07T11:08:52.090260Z  INFO tollgate::access: method=GET path=/ host=localhost:8000 status=200\n",
    )
    .unwrap();
    let config = common::proxy::repo_root().join("config/tollgate.yaml");
    let (ok, out, stderr) = simulate_any(&config, log.to_str().unwrap(), &[], None);
    assert!(!ok, "{out}");
    assert!(out.contains("1 not JSON"), "{out}");
    assert!(stderr.contains("--access-log-format json"), "{stderr}");
}
