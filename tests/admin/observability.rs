//! The shipped monitoring against real components: the tollgate binary serving real traffic
//! (2xx, 429 from Redis limits, 5xx from a dead and from an erroring upstream, fail-open with
//! Redis stopped, a failed reload, a target failing its health check, a certificate close to
//! expiry), scraped by a real Prometheus server (which negotiates OpenMetrics), and every
//! expression of `deploy/grafana/tollgate-dashboard.json` and `deploy/prometheus/
//! tollgate-rules.yaml` queried through its HTTP API: each must return data, so a renamed
//! metric or label fails here. `promtool` lints the text format and unit-tests the alerts.
//!
//! Needs `prometheus`, `promtool` (Debian's `prometheus` package), `redis-server` and
//! `openssl`, as `scripts/test.sh` installs them.

use crate::common;
use crate::common::redis as redis_helpers;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::proxy::repo_root;
use common::{refused_addr, sample, BinaryProxy, Http, MockUpstream};
use redis_helpers::RedisServer;

/// How long Prometheus gets to have scraped enough for every expression.
const WAIT: Duration = Duration::from_secs(90);

/// A Prometheus server on a free loopback port, killed on drop.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scrape `targets` every second as job `tollgate`, with the shipped rules loaded.
    fn start(targets: &[SocketAddr]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let rules = repo_root().join("deploy/prometheus/tollgate-rules.yaml");
        let list: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files: [\"{}\"]\n\
             scrape_configs:\n  - job_name: tollgate\n    static_configs:\n      - targets: [{}]\n",
            rules.display(),
            list.join(", ")
        );
        let path = dir.path().join("prometheus.yml");
        std::fs::write(&path, config).expect("write prometheus.yml");
        let addr = refused_addr();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.path().join("prometheus.log")).expect("log file"),
            ))
            .spawn()
            .expect("run prometheus (Debian's `prometheus` package)");
        Self {
            child,
            addr,
            _dir: dir,
        }
    }

    /// Wait until Prometheus answers `/-/ready` (it loads the rules first: a broken rule file
    /// never gets there).
    async fn ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!("prometheus exited: {status}");
            }
            if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                let url = format!("http://{}/-/ready", self.addr);
                if Http::new().get(&url).await.code() == 200 {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "prometheus did not get ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The JSON answer of `/api/v1/{path}`.
    async fn api(&self, path: &str) -> Option<serde_json::Value> {
        let url = format!("http://{}/api/v1/{path}", self.addr);
        let r = tokio::time::timeout(Duration::from_secs(5), Http::new().get(&url))
            .await
            .ok()?;
        serde_json::from_str(r.text()).ok()
    }

    /// The instant vector `expr` evaluates to now.
    async fn query(&self, expr: &str) -> Vec<serde_json::Value> {
        let q = percent_encoding::utf8_percent_encode(expr, percent_encoding::NON_ALPHANUMERIC);
        let Some(answer) = self.api(&format!("query?query={q}")).await else {
            return Vec::new();
        };
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A self-signed certificate for `localhost` that expires in a day, made by openssl.
fn short_lived_cert(dir: &Path) -> (PathBuf, PathBuf) {
    let (cert, key) = (dir.join("short.crt"), dir.join("short.key"));
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args(["-nodes", "-days", "1", "-subj", "/CN=localhost"])
        .args(["-addext", "subjectAltName=DNS:localhost", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (cert, key)
}

/// The main proxy's config: every kind of answer the dashboard and the alerts look at.
fn main_config(redis: &RedisServer, app: SocketAddr, cert: &Path, key: &Path) -> String {
    let (dead, down) = (refused_addr(), refused_addr());
    format!(
        "listeners:
  - address: 127.0.0.1:0
  - address: 127.0.0.1:0
    tls: {{ cert: {cert}, key: {key} }}
admin:
  address: 127.0.0.1:0
limiter:
  backend: redis
  redis:
    url: \"{redis}\"
    timeout: 100ms
upstreams:
  app:
    targets: [{app}]
    connect_timeout: 1s
    timeout: 5s
  dead:
    targets: [{dead}]
    connect_timeout: 1s
    timeout: 5s
  pool:
    targets: [{app}, {down}]
    connect_timeout: 1s
    timeout: 5s
    health:
      check: {{ path: /healthz, interval: 200ms, timeout: 200ms, healthy_threshold: 1, unhealthy_threshold: 1 }}
routes:
  - name: limited
    match: {{ path_prefix: /limited }}
    respond: {{ status: 200, body: \"ok\\n\" }}
    limits:
      - {{ name: per-ip, rate: 1/min, burst: 2, key: [ip], on_failure: open }}
      - {{ name: dry-run, rate: 1/min, burst: 1, key: [ip], shadow: true }}
  - name: dead
    match: {{ path_prefix: /dead }}
    upstream: dead
  - name: pool
    match: {{ path_prefix: /pool }}
    upstream: pool
  - name: app
    match: {{ path_prefix: / }}
    upstream: app
",
        cert = cert.display(),
        key = key.display(),
        redis = redis.url(),
    )
}

/// Every PromQL expression shipped: the dashboard's (its variables set to match everything)
/// and the rules', each with where it comes from.
fn shipped_expressions() -> Vec<(String, String)> {
    let root = repo_root();
    let text = std::fs::read_to_string(root.join("deploy/grafana/tollgate-dashboard.json"))
        .expect("the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a target's expr");
            let expr = expr
                .replace("$__rate_interval", "1m")
                .replace("$job", ".+")
                .replace("$instance", ".+");
            out.push((format!("panel {:?}", panel["title"]), expr));
        }
    }
    let text = std::fs::read_to_string(root.join("deploy/prometheus/tollgate-rules.yaml"))
        .expect("the rules");
    let rules: serde_json::Value = serde_saphyr::from_str(&text).expect("rules YAML");
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            let name = rule["alert"].as_str().or(rule["record"].as_str());
            let expr = rule["expr"].as_str().expect("a rule's expr");
            out.push((format!("rule {name:?}"), expr.to_owned()));
        }
    }
    assert!(out.len() > 30, "{out:?}");
    out
}

/// Panels and alerts of events the scenario does not stage (overload, bans, a candidate,
/// retries, ejections, fallback overflows, dropped log lines): checked for syntax and for
/// metric names, not for data.
fn event_only(source: &str) -> bool {
    const EVENTS: &[&str] = &[
        "Overload: 503s and refused connections",
        "Bans: started, and requests refused by bans",
        "Candidate config: would limit per limit",
        "Upstream retries and ejections",
        "Local fallback buckets full (overflows)",
        "TollgateAccessLogDropping",
        "TollgateOverloaded",
        "TollgateConnectionsRefused",
        "TollgateCandidateReloadFailed",
    ];
    EVENTS.iter().any(|e| source.contains(e))
}

/// The `tollgate_*` metric names an expression reads (a histogram's by its family name).
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("tollgate_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].trim_end_matches("_bucket").to_owned());
        rest = &tail[end..];
    }
    names
}

/// Whether a query's result holds a sample that is a number (a quantile of no observations
/// is NaN: no data).
fn has_data(result: &[serde_json::Value]) -> bool {
    result.iter().any(|s| {
        s["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|v| !v.is_nan())
    })
}

/// The value of the counter `series` in a text scrape.
fn count(scrape: &str, series: &str) -> u64 {
    let v = sample::<f64>(scrape, series);
    assert!(v >= 0.0 && v.fract() == 0.0, "{series} = {v}");
    v as u64
}

/// Run `promtool` with `args`, `stdin` fed to it; its exit code and output.
fn promtool(args: &[&str], stdin: &str) -> (Option<i32>, String) {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(args)
        .current_dir(repo_root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool (Debian's `prometheus` package)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("feed promtool");
    let out = child.wait_with_output().expect("promtool output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// Requests of each kind once: 2xx, 5xx from a dead upstream and from an erroring one, a
/// request to the pool, and one on the Redis-limited route from `limited` (a client whose
/// bucket is not in the negative cache, so that Redis is asked).
async fn traffic(proxy: &BinaryProxy, limited: &Http) {
    let http = Http::new();
    for path in ["/", "/dead", "/status/500", "/pool"] {
        let _ = tokio::time::timeout(Duration::from_secs(5), http.get(&proxy.url(path))).await;
    }
    let url = proxy.url("/limited");
    let _ = tokio::time::timeout(Duration::from_secs(5), limited.get(&url)).await;
}

/// What the text scrape of the main proxy says after the Redis-up traffic.
fn check_scrape(scrape: &str, cert: &Path) {
    // Redis latency is observed for the checks that went to Redis only: every request on the
    // limited route was decided (9), some of them by the negative cache without Redis.
    let decided = count(scrape, "tollgate_limiter_backend_seconds_count");
    let cached = count(scrape, "tollgate_redis_negative_cache_hits_total");
    let round_trips = count(scrape, "tollgate_redis_check_duration_seconds_count");
    assert_eq!(decided, 9, "{scrape}");
    assert!(cached >= 1, "{scrape}");
    assert_eq!(round_trips, decided - cached, "{scrape}");
    // The certificate's notAfter, a day from now (openssl's -days 1).
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64();
    let expiry = sample::<f64>(
        scrape,
        &format!(
            "tollgate_tls_certificate_expiry_timestamp_seconds{{listener=\"127.0.0.1:0\",cert=\"{}\"}}",
            cert.display()
        ),
    );
    assert!((expiry - now - 86_400.0).abs() < 120.0, "{expiry} vs {now}");
    // Each attempt on the dead upstream's target counted against it.
    let dead = count(
        scrape,
        "tollgate_requests_total{route=\"dead\",code=\"502\",class=\"5xx\"}",
    );
    let attempts: u64 = scrape
        .lines()
        .filter(|l| {
            l.starts_with("tollgate_upstream_target_attempts_total{upstream=\"dead\"")
                && l.contains("result=\"unreachable\"")
        })
        .map(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum();
    assert_eq!((dead, attempts), (3, 3), "{scrape}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shipped_expression_returns_data_from_a_real_scrape() {
    let mut redis = RedisServer::start();
    let app = MockUpstream::start();
    let certs = tempfile::tempdir().expect("temp dir");
    let (cert, key) = short_lived_cert(certs.path());
    let proxy = BinaryProxy::start(&main_config(&redis, app.addr(), &cert, &key));
    // A second replica with another config: the fleet's "distinct configs" has two.
    let other = BinaryProxy::start(
        "listeners:\n  - address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\nroutes:\n  \
         - name: all\n    match: { path_prefix: / }\n    respond: { status: 200 }\n",
    );
    let http = Http::new();

    // Redis up: 2 admitted, then 429s, the later ones from the negative cache.
    let codes = http.statuses(6, &proxy.url("/limited"), &[]).await;
    assert_eq!(codes, [200, 200, 429, 429, 429, 429]);
    let fresh = Http::from_ip("127.0.0.2");
    for _ in 0..3 {
        traffic(&proxy, &http).await;
    }

    // The text format, as curl or promtool gets it, passes promtool's lint.
    let text = http
        .get(&format!("http://{}/metrics", proxy.admin_addr()))
        .await;
    assert_eq!(
        text.header("content-type"),
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let (code, lint) = promtool(&["check", "metrics"], text.text());
    assert_eq!((code, lint.as_str()), (Some(0), ""), "{}", text.text());
    check_scrape(text.text(), &cert);

    // A bad edit: the reload fails and the old config stays live.
    std::fs::write(proxy.config_path(), "listeners: [").expect("break the config");
    proxy.signal("HUP");
    assert!(
        proxy.wait_for_log("config reload failed", Duration::from_secs(10)),
        "{:#?}",
        proxy.logs()
    );

    // Redis stopped: checks time out, the breaker opens, the limit fails open (for a client
    // the negative cache does not already answer).
    redis.pause();
    let codes = fresh.statuses(5, &proxy.url("/limited"), &[]).await;
    assert!(codes.iter().all(|&c| c == 200), "fail-open: {codes:?}");

    let mut prometheus = Prometheus::start(&[proxy.admin_addr(), other.admin_addr()]);
    prometheus.ready().await;
    let expressions = shipped_expressions();
    let deadline = Instant::now() + WAIT;
    let mut missing: Vec<String>;
    loop {
        traffic(&proxy, &fresh).await;
        missing = Vec::new();
        for (source, expr) in &expressions {
            let result = prometheus.query(expr).await;
            if !has_data(&result) && !event_only(source) {
                missing.push(format!("{source}: {expr}\n  -> {result:?}"));
            }
        }
        if missing.is_empty() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        missing.is_empty(),
        "expressions without data after {WAIT:?}:\n{}",
        missing.join("\n")
    );
    // The expressions of events this scenario does not stage parse (the queries above
    // succeeded), and every metric they read is one tollgate exports.
    let reference = std::fs::read_to_string(repo_root().join("docs/metrics.md")).unwrap();
    for (source, expr) in expressions.iter().filter(|(s, _)| event_only(s)) {
        for name in metric_names(expr) {
            // A counter's family may be typed without its `_total`; a labelled family with no
            // series yet is not in the scrape, only in the reference.
            let family = name.trim_end_matches("_total");
            let typed = |n: &str| text.text().contains(&format!("# TYPE {n} "));
            assert!(
                typed(&name) || typed(family) || reference.contains(&format!("| `{name}` |")),
                "{source} reads {name}, which tollgate does not export"
            );
        }
    }

    // Prometheus negotiated OpenMetrics and its parser took every scrape.
    let targets = prometheus.api("targets").await.expect("targets");
    let active = targets["data"]["activeTargets"]
        .as_array()
        .expect("targets");
    assert_eq!(active.len(), 2, "{targets}");
    for t in active {
        assert_eq!(
            (&t["health"], &t["lastError"]),
            (&"up".into(), &"".into()),
            "{t}"
        );
    }
    let om = http
        .get_with(
            &format!("http://{}/metrics", proxy.admin_addr()),
            &[(
                "accept",
                "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                 version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
            )],
        )
        .await;
    assert_eq!(
        om.header("content-type"),
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    redis.resume();
    redis.kill();
}

#[test]
fn the_alert_rules_pass_their_unit_tests() {
    let (code, out) = promtool(
        &["check", "rules", "deploy/prometheus/tollgate-rules.yaml"],
        "",
    );
    assert_eq!(code, Some(0), "{out}");
    let (code, out) = promtool(
        &[
            "test",
            "rules",
            "deploy/prometheus/tollgate-rules.test.yaml",
        ],
        "",
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("SUCCESS"), "{out}");
}
