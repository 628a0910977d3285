//! The live dashboard end to end: real requests through an in-process proxy, then the page
//! rendered by headless Chromium against the admin listener, and its DOM read back.
//!
//! `screenshot` (ignored) writes docs/dashboard.png after five minutes of mixed traffic:
//! `cargo test --test admin -- --ignored dashboard:: screenshot`.

use crate::common;
use crate::common::redis as redis_helpers;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{config, Http, TestProxy};
use tollgate::identity::{Alternative, KeySpec, RequestView};

const TOKEN: &str = "dash-test-token-5e1f";

/// A proxy with the admin listener and API on, `rest` appended to the config.
fn proxy(rest: &str) -> (TestProxy, tempfile::TempPath) {
    let token = tempfile::NamedTempFile::new().expect("a token file");
    std::fs::write(token.path(), format!("{TOKEN}\n")).expect("write the token");
    let token = token.into_temp_path();
    let yaml = config(&format!(
        "admin:\n  address: 127.0.0.1:0\n  token_file: {}\n{rest}",
        token.display()
    ));
    (TestProxy::start(&yaml), token)
}

/// The digest tollgate counts a request with `X-API-Key: key` under, as the page shows it.
fn digest_prefix(key: &str) -> String {
    let mut headers = http::HeaderMap::new();
    headers.insert("x-api-key", key.parse().expect("a header value"));
    let view = RequestView {
        method: &http::Method::GET,
        uri: &"/".parse().expect("a URI"),
        headers: &headers,
        client_ip: "127.0.0.1".parse().expect("an address"),
        jwt: None,
    };
    let spec = KeySpec(vec![
        Alternative::parse("header:X-API-Key").expect("a key source")
    ]);
    view.resolve(&spec).hex()[..12].to_owned()
}

// === Chromium ===

/// The Chromium binary, or a failure that says how to get it: the suite installs it, so a
/// missing one is a broken setup, not a reason to pass.
fn chromium() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        for name in ["chromium", "chromium-browser"] {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!(
        "chromium is not installed: this test renders the dashboard with headless Chromium \
         (scripts/test.sh installs it; or `apt-get install chromium`)"
    );
}

/// A Chromium process, killed when dropped (on every path, a failed assertion included).
struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Browser {
    /// Headless Chromium opening `url` with `extra` flags, a profile of its own.
    fn open(url: &str, extra: &[&str]) -> Self {
        let profile = tempfile::tempdir().expect("a profile directory");
        let child = Command::new(chromium())
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
            ])
            .args([
                "--disable-extensions",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(extra)
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromium");
        Self {
            child,
            _profile: profile,
        }
    }

    /// Wait (at most `limit`) for Chromium to exit; its standard output.
    fn output(mut self, limit: Duration) -> String {
        let mut stdout = self.child.stdout.take().expect("piped stdout");
        let reader = std::thread::spawn(move || {
            let mut out = String::new();
            let _ = stdout.read_to_string(&mut out);
            out
        });
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("poll chromium") {
                assert!(status.success(), "chromium failed: {status}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "chromium did not finish in {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        reader.join().expect("read chromium's output")
    }
}

/// The page at `url` as Chromium rendered it after `budget_ms` of virtual time (every poll of
/// that span answered).
fn rendered(url: &str, budget_ms: u32) -> String {
    let budget = format!("--virtual-time-budget={budget_ms}");
    Browser::open(url, &["--dump-dom", &budget]).output(Duration::from_secs(15))
}

// === reading the DOM ===

/// Every start tag in `dom` holding all of `attrs` (`name="value"` pairs), with the text that
/// follows it up to the next tag.
fn elements<'a>(dom: &'a str, attrs: &[&str]) -> Vec<(&'a str, &'a str)> {
    let mut out = Vec::new();
    let mut rest = dom;
    while let Some(start) = rest.find('<') {
        let Some(end) = rest[start..].find('>') else {
            break;
        };
        let tag = &rest[start..start + end];
        let after = &rest[start + end + 1..];
        let text = &after[..after.find('<').unwrap_or(after.len())];
        if attrs.iter().all(|a| tag.contains(a)) {
            out.push((tag, text));
        }
        rest = after;
    }
    out
}

/// The text of the one count cell of `limit`'s row for `count` (`admitted`, `limited`).
fn count_cell(dom: &str, limit: &str, count: &str) -> String {
    let limit_attr = format!("data-limit=\"{limit}\"");
    let count_attr = format!("data-count=\"{count}\"");
    let cells = elements(dom, &[&limit_attr, &count_attr]);
    assert_eq!(cells.len(), 1, "one {count} cell for {limit} in:\n{dom}");
    cells[0].1.trim().to_owned()
}

/// The identities the most-limited list of `limit` shows, in order, with their counts.
fn most_limited(dom: &str, limit: &str) -> Vec<(String, String)> {
    let limit_attr = format!("data-limit=\"{limit}\"");
    let rows = elements(dom, &["<tr", "data-identity=", &limit_attr]);
    rows.iter()
        .map(|(tag, _)| {
            let id = tag.split("data-identity=\"").nth(1).unwrap_or_default();
            let id = id[..id.find('"').unwrap_or(id.len())].to_owned();
            // The row's cells: the prefix, then the count.
            let at = dom.find(*tag).unwrap_or_default();
            let cells = elements(&dom[at..], &["<td"]);
            let count = cells
                .get(1)
                .map(|(_, t)| t.trim().to_owned())
                .unwrap_or_default();
            (id, count)
        })
        .collect()
}

const LIMIT: &str = "routes:
  - name: api
    match: { path_prefix: / }
    respond: { status: 200, body: \"ok\\n\" }
    limits:
      - { name: per-key, rate: 1/min, burst: 3, key: [header:X-API-Key] }
      - { name: dry, rate: 1/min, burst: 2, key: [header:X-API-Key], shadow: true }
";

#[tokio::test]
async fn the_page_shows_live_counts_and_the_most_limited_identity() {
    let started = Instant::now();
    let (proxy, _token) = proxy(LIMIT);
    let http = Http::new();
    let url = proxy.url("/x");
    // alice: 3 admitted, 6 limited; bob: 3 admitted, 2 limited.
    let alice = http.statuses(9, &url, &[("X-API-Key", "alice")]).await;
    let bob = http.statuses(5, &url, &[("X-API-Key", "bob")]).await;
    assert_eq!(alice, [200, 200, 200, 429, 429, 429, 429, 429, 429]);
    assert_eq!(bob, [200, 200, 200, 429, 429]);

    // An operator's ban and override, through the admin API.
    let ban = post(
        &proxy,
        "/bans",
        r#"{"identity":"header:X-API-Key=mallory","ttl":"1h","reason":"INC-7 scraping"}"#,
    )
    .await;
    let raise = r#"{"limit":"per-key","identity":"header:X-API-Key=partner","rate":"100/s","burst":100,"ttl":"5m","reason":"launch week"}"#;
    let raise = post(&proxy, "/overrides", raise).await;
    let banned = http.statuses(2, &url, &[("X-API-Key", "mallory")]).await;
    assert_eq!(banned, [403, 403]);
    // The page reads the sampler's series of those refusals: wait until it has them.
    data_until(&http, &proxy, "the refusals sampled", |v| {
        v["series"]["operator_bans"][0]["window"]["refused"] == 2
    })
    .await;

    let page = format!("http://{}/dashboard#token={TOKEN}", proxy.admin_addr());
    let dom = tokio::task::spawn_blocking(move || rendered(&page, 5000))
        .await
        .expect("render");
    assert!(
        dom.contains("id=\"status\" class=\"live\""),
        "the page polled the API:\n{dom}"
    );
    assert_eq!(count_cell(&dom, "per-key", "admitted"), "6");
    assert_eq!(count_cell(&dom, "per-key", "limited"), "8");
    // The dry run rejected nothing, and the page shows what it would have rejected.
    let v = data(&http, &proxy).await;
    let would = &limit(&v, "dry")["total"]["shadow_limited"];
    assert!(would.as_u64().unwrap() > 0, "{v}");
    assert_eq!(
        count_cell(&dom, "dry", "limited"),
        format!("would limit {would}")
    );
    let top = most_limited(&dom, "per-key");
    assert_eq!(
        top,
        [
            (digest_prefix("alice"), "6".to_owned()),
            (digest_prefix("bob"), "2".to_owned())
        ],
        "the most-limited list, most first"
    );
    // The ban and the override in force, in their panels.
    let row = |attr: &str, id: &str| {
        let a = format!("{attr}=\"{id}\"");
        let at = dom
            .find(&a)
            .unwrap_or_else(|| panic!("a row {a} in:\n{dom}"));
        dom[at..at + dom[at..].find("</tr>").unwrap_or(0)].to_owned()
    };
    let shown = row("data-ban-id", ban["id"].as_str().expect("a ban ID"));
    assert!(
        shown.contains("INC-7 scraping") && shown.contains("all"),
        "{shown}"
    );
    let shown = row(
        "data-override-id",
        raise["id"].as_str().expect("an override ID"),
    );
    assert!(
        shown.contains("launch week") && shown.contains("100/s"),
        "{shown}"
    );
    assert!(
        dom.contains("data-operator-refused=\"2\""),
        "two refused by the ban:\n{dom}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// The rate limit service's rules are rows beside the routes' limits, their route
/// `rls:DOMAIN`, with the counts of the calls they decided.
#[tokio::test]
async fn the_page_shows_the_rate_limit_services_rules() {
    let rules = tempfile::tempdir().expect("a directory");
    std::fs::write(
        rules.path().join("api.yaml"),
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 2 }\n",
    )
    .expect("write the rules");
    let rest = format!(
        "{LIMIT}rls: {{ address: 127.0.0.1:0, config: {} }}\n",
        rules.path().display()
    );
    let (proxy, _token) = proxy(&rest);
    let rls = common::rls::Rls::to(proxy.rls_addr());
    let codes = rls.codes("api", &[("user", "ann")], 5).await;
    assert_eq!(
        codes,
        ["OK", "OK", "OVER_LIMIT", "OVER_LIMIT", "OVER_LIMIT"]
    );
    let http = Http::new();
    data_until(&http, &proxy, "the rule's calls sampled", |v| {
        limit(v, "rls:api:user")["window"]["limited"] == 3
    })
    .await;
    let v = data(&http, &proxy).await;
    assert_eq!(limit(&v, "rls:api:user")["route"], "rls:api");
    let page = format!("http://{}/dashboard#token={TOKEN}", proxy.admin_addr());
    let dom = tokio::task::spawn_blocking(move || rendered(&page, 5000))
        .await
        .expect("render");
    assert_eq!(count_cell(&dom, "rls:api:user", "admitted"), "2");
    assert_eq!(count_cell(&dom, "rls:api:user", "limited"), "3");
    assert!(
        dom.contains("rls:api"),
        "the domain shown as the route:\n{dom}"
    );
}

/// A limit whose cost the response settles shows its reserve, the units settled and who owes
/// what.
#[tokio::test]
async fn the_page_shows_settled_units_and_debts() {
    let app = common::MockUpstream::start();
    let rest = format!(
        "{}routes:\n  - name: llm\n    match: {{ path_prefix: / }}\n    upstream: app\n    limits:\n      - {{ name: tokens, rate: 1000/h, burst: 1000, key: [\"header:x-tenant\"], cost: {{ reserve: 100, from_response: x-cost }} }}\n",
        common::upstream_app(app.addr(), "5s")
    );
    let (proxy, _token) = proxy(&rest);
    let http = Http::new();
    for cost in ["10", "1500"] {
        let url = proxy.url(&format!("/cost/{cost}"));
        assert_eq!(
            http.get_with(&url, &[("x-tenant", "acme")]).await.code(),
            200
        );
    }
    let v = data(&http, &proxy).await;
    let settled = &limit(&v, "tokens")["settled"];
    assert_eq!(
        (
            settled["units"].as_u64(),
            settled["owing"].as_u64(),
            settled["owed"].as_u64()
        ),
        (Some(1510), Some(1), Some(510)),
        "{v}"
    );
    let page = format!("http://{}/dashboard#token={TOKEN}", proxy.admin_addr());
    let dom = tokio::task::spawn_blocking(move || rendered(&page, 5000))
        .await
        .expect("render");
    assert!(
        dom.contains("data-settled=\"1,510\""),
        "the units settled:\n{dom}"
    );
    assert!(dom.contains("1 owing 510"), "the debt shown:\n{dom}");
}

#[tokio::test]
async fn without_the_token_the_page_asks_for_it() {
    let (proxy, _token) = proxy(LIMIT);
    let admin = proxy.admin_addr();
    let dom = tokio::task::spawn_blocking(move || {
        let bad = rendered(&format!("http://{admin}/dashboard#token=wrong"), 3000);
        let none = rendered(&format!("http://{admin}/dashboard"), 3000);
        (bad, none)
    })
    .await
    .expect("render");
    for (what, dom) in [("a wrong token", &dom.0), ("no token", &dom.1)] {
        assert!(
            dom.contains("<form id=\"login\" class=\"card\">"),
            "with {what} the token form shows:\n{dom}"
        );
        assert!(
            dom.contains("<main id=\"app\" hidden"),
            "and no data:\n{dom}"
        );
    }
    assert!(dom.0.contains("The token was refused."), "{}", dom.0);
}

#[tokio::test]
async fn the_page_is_static_and_locked_down_and_its_data_needs_the_token() {
    let (proxy, _token) = proxy(LIMIT);
    let http = Http::new();
    let admin = proxy.admin_addr();
    let page = http.get(&format!("http://{admin}/dashboard")).await;
    assert_eq!(page.code(), 200);
    assert_eq!(page.header("content-type"), "text/html; charset=utf-8");
    assert_eq!(page.header("x-frame-options"), "DENY");
    assert_eq!(page.header("cache-control"), "no-store");
    let csp = page.header("content-security-policy");
    assert!(
        csp.contains("script-src 'self';") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    assert!(
        !page.text().contains("http://") && !page.text().contains("https://"),
        "no outside URL"
    );
    let script = http.get(&format!("http://{admin}/dashboard.js")).await;
    assert_eq!(script.code(), 200);
    assert!(
        !script.text().contains("https://"),
        "no outside URL in the script"
    );

    let data = format!("http://{admin}/api/v1/dashboard");
    assert_eq!(http.get(&data).await.code(), 401);
    let auth = format!("Bearer {TOKEN}");
    let reply = http.get_with(&data, &[("Authorization", &auth)]).await;
    assert_eq!(reply.code(), 200);
    let v: serde_json::Value = serde_json::from_str(reply.text()).expect("JSON");
    assert_eq!(v["limits"][0]["limit"], "per-key");
    assert_eq!(v["limits"][0]["rule"], "1/min, burst 3");
    assert_eq!(v["points"], 120);
    assert_eq!(
        v["limits"][0]["rate"]["admitted"].as_array().map(Vec::len),
        Some(120)
    );
    assert_eq!(v["limiter"]["backend"], "local");
    assert_eq!(v["generation"], 1);
}

/// `POST /api/v1{path}` with the token and `body`: the created entry, as JSON.
async fn post(proxy: &TestProxy, path: &str, body: &str) -> serde_json::Value {
    use http_body_util::BodyExt;
    let req = http::Request::post(format!("http://{}/api/v1{path}", proxy.admin_addr()))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(
            http_body_util::Full::new(bytes::Bytes::from(body.to_owned()))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("a request");
    let reply = Http::new().send(req).await;
    assert_eq!(reply.code(), 201, "{}", reply.text());
    serde_json::from_str(reply.text()).expect("JSON")
}

/// `GET /api/v1/dashboard` with the token, as JSON.
async fn data(http: &Http, proxy: &TestProxy) -> serde_json::Value {
    let url = format!("http://{}/api/v1/dashboard?step=1", proxy.admin_addr());
    let auth = format!("Bearer {TOKEN}");
    let reply = http.get_with(&url, &[("Authorization", &auth)]).await;
    assert_eq!(reply.code(), 200, "{}", reply.text());
    serde_json::from_str(reply.text()).expect("JSON")
}

/// Poll the dashboard data until `ok` holds of it; fail after 5 s.
async fn data_until(
    http: &Http,
    proxy: &TestProxy,
    what: &str,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let v = data(http, proxy).await;
        if ok(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{what} within 5 s: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The limit named `name` in the data.
fn limit<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["limits"]
        .as_array()
        .and_then(|a| a.iter().find(|l| l["limit"] == name))
        .unwrap_or_else(|| panic!("no limit {name} in {v}"))
}

#[tokio::test]
async fn the_sampled_series_survive_a_reload() {
    let (proxy, token) = proxy(LIMIT);
    let http = Http::new();
    let url = proxy.url("/x");
    let statuses = http.statuses(5, &url, &[("X-API-Key", "carol")]).await;
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    // The sampler's window catches up with the live totals within a second or two.
    let v = data_until(&http, &proxy, "the window counts every decision", |v| {
        limit(v, "per-key")["window"]["limited"] == 2
            && limit(v, "per-key")["window"]["admitted"] == 3
    })
    .await;
    let rates = limit(&v, "per-key")["rate"]["limited"]
        .as_array()
        .expect("rates")
        .clone();
    assert_eq!(rates.len(), 600);
    let sum: f64 = rates.iter().filter_map(serde_json::Value::as_f64).sum();
    assert!(
        (sum - 2.0).abs() < 1e-9,
        "one-second steps add up to the count: {sum}"
    );

    // A reload adds a limit: the old series goes on, the new one starts at zero.
    let added = LIMIT.to_owned()
        + "      - { name: everyone, rate: 1000/s, burst: 1000, key: [global] }
";
    let yaml = config(&format!(
        "admin:\n  address: 127.0.0.1:0\n  token_file: {}\n{added}",
        token.display()
    ));
    std::fs::write(proxy.config_path(), yaml).expect("rewrite the config");
    proxy.reload();
    assert!(
        proxy.wait_for_generation(2, Duration::from_secs(5)).await,
        "reloaded"
    );
    let v = data_until(&http, &proxy, "the new limit is sampled", |v| {
        v["generation"] == 2 && limit(v, "everyone")["window"]["admitted"] == 0
    })
    .await;
    assert_eq!(limit(&v, "per-key")["window"]["limited"], 2, "{v}");
    assert_eq!(limit(&v, "per-key")["total"]["admitted"], 3);
    assert_eq!(v["config"]["reloads"]["ok"], 1);
    assert_eq!(limit(&v, "per-key")["most_limited"][0]["count"], 2);
}

#[tokio::test]
async fn the_limiter_panel_follows_redis() {
    let mut redis = redis_helpers::RedisServer::start();
    let rest = format!(
        "limiter:\n  backend: redis\n  redis:\n    url: \"{}\"\n    timeout: 200ms\n\
         routes:\n  - name: api\n    respond: {{ status: 200 }}\n    limits:\n      \
         - {{ name: per-ip, rate: 100/s, burst: 100, key: [ip], on_failure: open }}\n",
        redis.url()
    );
    let (proxy, _token) = proxy(&rest);
    let http = Http::new();
    let url = proxy.url("/");
    assert_eq!(http.statuses(3, &url, &[]).await, [200, 200, 200]);
    let v = data_until(&http, &proxy, "three calls sampled", |v| {
        v["limiter"]["window"]["calls"].as_u64() >= Some(3)
    })
    .await;
    let l = &v["limiter"];
    assert_eq!(
        (&l["backend"], &l["mode"]),
        (&"redis".into(), &"single".into()),
        "{l}"
    );
    assert_eq!(l["breaker_open"], false);
    assert_eq!(l["total"]["errors"], 0);

    // Redis gone: checks fail (open: still 200) and, three failures on, the breaker opens.
    redis.kill();
    assert_eq!(http.statuses(4, &url, &[]).await, [200, 200, 200, 200]);
    let v = data_until(&http, &proxy, "the failures sampled", |v| {
        v["limiter"]["window"]["errors"].as_u64() >= Some(3)
    })
    .await;
    assert_eq!(v["limiter"]["breaker_open"], true, "{}", v["limiter"]);
    assert_eq!(limit(&v, "per-ip")["total"]["without_backend"], 4);
}

#[tokio::test]
async fn a_candidate_configs_decisions_are_sampled_by_its_limit() {
    let dir = tempfile::tempdir().expect("a directory");
    let candidate = dir.path().join("candidate.yaml");
    let strict = "routes:\n  - name: api\n    match: { path_prefix: / }\n    respond: { status: 200 }\n    \
                  limits:\n      - { name: strict, rate: 1/min, burst: 1, key: [header:X-API-Key] }\n";
    std::fs::write(&candidate, strict).expect("write the candidate");
    let (proxy, _token) = proxy(&format!("candidate: {}\n{LIMIT}", candidate.display()));
    let http = Http::new();
    let statuses = http
        .statuses(3, &proxy.url("/x"), &[("X-API-Key", "dave")])
        .await;
    assert_eq!(statuses, [200, 200, 200], "a candidate never enforces");
    let v = data_until(&http, &proxy, "the candidate's decisions sampled", |v| {
        let c = &v["series"]["candidates"][0];
        c["limit"] == "strict" && c["window"]["admitted"] == 1 && c["window"]["limited"] == 2
    })
    .await;
    assert_eq!(v["series"]["candidates"][0]["route"], "api");
    // The page shows the same numbers in its candidate panel.
    let page = format!("http://{}/dashboard#token={TOKEN}", proxy.admin_addr());
    let dom = tokio::task::spawn_blocking(move || rendered(&page, 5000))
        .await
        .expect("render");
    let cell = |count: &str| {
        let attrs = [
            "data-candidate-limit=\"strict\"".to_owned(),
            format!("data-count=\"{count}\""),
        ];
        let cells = elements(&dom, &[&attrs[0], &attrs[1]]);
        assert_eq!(
            cells.len(),
            1,
            "one {count} cell of the candidate in:\n{dom}"
        );
        cells[0].1.trim().to_owned()
    };
    assert_eq!(
        (cell("admitted"), cell("limited")),
        ("1".into(), "2".into())
    );
}

// === the screenshot in docs ===

/// Mixed traffic for `DASHBOARD_TRAFFIC_SECS` (default 300) seconds, and docs/dashboard.png
/// taken near its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes docs/dashboard.png after minutes of traffic"]
async fn screenshot() {
    let app = common::MockUpstream::start();
    let rest = format!(
        "trusted_proxies: [127.0.0.1/32]\n{}{SCREENSHOT_ROUTES}",
        common::upstream_app(app.addr(), "5s")
    );
    let (proxy, _token) = proxy(&rest);
    let secs = std::env::var("DASHBOARD_TRAFFIC_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300u64)
        .max(20);
    let span = Duration::from_secs(secs);
    let ban = r#"{"identity":"header:X-API-Key=key-scraper","ttl":"2h","routes":["search"],"reason":"INC-1042 scraping"}"#;
    post(&proxy, "/bans", ban).await;
    let raise = r#"{"limit":"api-per-key","identity":"header:X-API-Key=key-batch","rate":"40/s","burst":80,"ttl":"1h","reason":"nightly export"}"#;
    post(&proxy, "/overrides", raise).await;
    let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/dashboard.png");
    let page = format!("http://{}/dashboard#token={TOKEN}", proxy.admin_addr());
    let shot = format!("--screenshot={}", out.display());
    // Taken while the traffic still runs, so the rates "now" are not zeros.
    let take = async {
        tokio::time::sleep(span.saturating_sub(Duration::from_secs(8))).await;
        tokio::task::spawn_blocking(move || {
            Browser::open(
                &page,
                &[
                    &shot,
                    "--window-size=1280,900",
                    "--virtual-time-budget=4000",
                ],
            )
            .output(Duration::from_secs(30))
        })
        .await
        .expect("screenshot")
    };
    tokio::join!(traffic::run(&proxy, span), take);
    assert!(out.is_file(), "{} written", out.display());
}

const SCREENSHOT_ROUTES: &str = "routes:
  - name: login
    match: { path: /login }
    upstream: app
    limits:
      - name: login-per-ip
        rate: 10/min
        burst: 5
        key: [ip]
        ban: { after: 5, within: 1m, for: 1m, max: 10m }
  - name: search
    match: { path_prefix: /v1/search }
    upstream: app
    limits:
      - { name: search-per-key, rate: 4/s, burst: 8, key: [header:X-API-Key, ip] }
      - { name: search-strict, rate: 2/s, burst: 4, key: [header:X-API-Key, ip], shadow: true }
  - name: api
    match: { path_prefix: /v1/ }
    upstream: app
    limits:
      - { name: api-per-key, rate: 10/s, burst: 20, key: [header:X-API-Key, ip] }
      - { name: api-global, rate: 120/s, burst: 200, key: [global] }
";

mod traffic {
    //! Clients at their own rates: steady API keys, a scraper flooding from a third of the way
    //! in, a batch job and a retry loop later, a credential stuffer on /login from a few
    //! addresses.

    use std::time::Duration;

    use super::common::{Http, TestProxy};

    /// One client: `path` with `header` at `per_sec`, from `from` to `to` (fractions of `span`).
    struct Client {
        path: String,
        header: (&'static str, String),
        per_sec: f64,
        from: f64,
        to: f64,
    }

    fn key(path: &str, key: &str, per_sec: f64, from: f64, to: f64) -> Client {
        let header = ("X-API-Key", key.to_owned());
        let path = path.to_owned();
        Client {
            path,
            header,
            per_sec,
            from,
            to,
        }
    }

    pub async fn run(proxy: &TestProxy, span: Duration) {
        let mut clients = Vec::new();
        for i in 0..10 {
            let rate = 2.0 + f64::from(i) * 0.8;
            clients.push(key("/v1/orders", &format!("key-{i}"), rate, 0.0, 1.0));
            clients.push(key(
                "/v1/search?q=x",
                &format!("key-{i}"),
                rate / 2.0,
                0.0,
                1.0,
            ));
        }
        clients.push(key("/v1/orders", "key-scraper", 45.0, 0.3, 0.75));
        clients.push(key("/v1/search?q=all", "key-scraper", 12.0, 0.45, 1.0));
        clients.push(key("/v1/orders", "key-batch", 14.0, 0.6, 1.0));
        clients.push(key("/v1/orders", "key-retry-loop", 28.0, 0.8, 1.0));
        for (ip, per_sec) in [
            ("198.51.100.7", 2.0),
            ("203.0.113.44", 1.1),
            ("192.0.2.90", 0.6),
        ] {
            let header = ("X-Forwarded-For", ip.to_owned());
            let path = "/login".to_owned();
            clients.push(Client {
                path,
                header,
                per_sec,
                from: 0.15,
                to: 1.0,
            });
        }
        let tasks: Vec<_> = clients
            .into_iter()
            .map(|c| tokio::spawn(send(proxy.url(&c.path), c, span)))
            .collect();
        for t in tasks {
            let _ = t.await;
        }
    }

    async fn send(url: String, c: Client, span: Duration) {
        let http = Http::new();
        let began = tokio::time::Instant::now();
        let total = span.as_secs_f64();
        loop {
            let t = began.elapsed().as_secs_f64();
            if t >= total {
                return;
            }
            // A slow swell, so rates move the way real traffic does.
            let swell = 1.0 + 0.5 * (t / 37.0).sin();
            let on = t >= c.from * total && t < c.to * total;
            if on {
                let _ = http.get_with(&url, &[(c.header.0, &c.header.1)]).await;
            }
            let gap = if on { 1.0 / (c.per_sec * swell) } else { 0.5 };
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        }
    }
}
