//! Envoy's rate limit service end to end: a tonic client calling `ShouldRateLimit` on the
//! service in process, with envoyproxy/ratelimit's README examples as its configuration
//! (`tests/fixtures/rls/`): their matching, block lists, shadow mode, `replaces`, wildcards;
//! all or nothing across descriptors; `hits_addend`; the `RateLimit` headers; a config with
//! `rls` and no listeners; reload; metrics.

use crate::common;
use crate::common::rls::{code, header, name, request, Rls};

use common::TestProxy;

fn fixtures() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/rls").to_owned()
}

/// A pure rate limit service (no listeners, no routes) over the README examples.
async fn service() -> (TestProxy, Rls) {
    let yaml = format!(
        "admin: {{ address: 127.0.0.1:0 }}\nrls:\n  address: 127.0.0.1:0\n  config: {}\n",
        fixtures()
    );
    let proxy = TestProxy::inline(&yaml).await;
    let rls = Rls::to(proxy.rls_addr());
    (proxy, rls)
}

#[tokio::test]
async fn the_readme_examples_answer_as_envoyproxy_ratelimit_does() {
    let (_proxy, rls) = service().await;
    // Example 2: five marketing messages a day to a number, then over; another type of
    // message to the same number counts in its own 100.
    let marketing = [("message_type", "marketing"), ("to_number", "2061234567")];
    assert_eq!(
        rls.codes("messaging", &marketing, 6).await,
        ["OK", "OK", "OK", "OK", "OK", "OVER_LIMIT"]
    );
    let r = rls
        .call("messaging", &[&[("to_number", "2061234567")]], 0)
        .await;
    assert_eq!(code(&r), "OK");
    let s = &r.statuses[0];
    let limit = s.current_limit.as_ref().expect("the limit");
    assert_eq!(
        (limit.requests_per_unit, limit.unit, s.limit_remaining),
        (100, 4, 99)
    );
    // Another number has its own five.
    let other = [("message_type", "marketing"), ("to_number", "2060000000")];
    assert_eq!(rls.codes("messaging", &other, 1).await, ["OK"]);
    // A message type with no rule of its own is not limited at all.
    let r = rls
        .call(
            "messaging",
            &[&[("message_type", "transactional"), ("to_number", "1")]],
            0,
        )
        .await;
    assert_eq!(
        (code(&r), r.statuses[0].current_limit.is_none()),
        ("OK", true)
    );
    // Example 3: ten a second per address; the blocked address is always over, at 0.
    // (Windows are aligned to the second: a try that crosses one is tried again.)
    for attempt in 0.. {
        let ip = format!("10.1.2.{attempt}");
        let second = jiff::Timestamp::now().as_second();
        let codes = rls
            .codes("edge_proxy_per_ip", &[("remote_address", &ip)], 11)
            .await;
        if jiff::Timestamp::now().as_second() != second && attempt < 5 {
            continue;
        }
        assert_eq!(
            codes.iter().filter(|c| **c == "OK").count(),
            10,
            "{codes:?}"
        );
        break;
    }
    let ip = [("remote_address", "10.1.2.3")];
    let blocked = rls
        .call("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.5")]], 0)
        .await;
    assert_eq!(code(&blocked), "OVER_LIMIT");
    assert_eq!(
        blocked.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit),
        Some(0)
    );
    // Example 1: an unknown database is not limited; a known one counts.
    let r = rls
        .call(
            "mongo_cps",
            &[&[("database", "users")], &[("database", "logs")]],
            0,
        )
        .await;
    assert_eq!(
        r.statuses.iter().map(|s| name(s.code)).collect::<Vec<_>>(),
        ["OK", "OK"]
    );
    assert_eq!(r.statuses[0].limit_remaining, 499);
    assert!(r.statuses[1].current_limit.is_none());
    // An unknown domain limits nothing.
    assert_eq!(rls.codes("nowhere", &ip, 1).await, ["OK"]);
}

#[tokio::test]
async fn shadow_unlimited_replaces_and_wildcards() {
    let (_proxy, rls) = service().await;
    // Shadow mode: counted, never over.
    let shadow = [("key", "value"), ("subkey", "subvalue")];
    assert_eq!(rls.codes("example4", &shadow, 5).await, ["OK"; 5]);
    assert_eq!(rls.codes("example4", &[("ldap", "x")], 3).await, ["OK"; 3]);
    // `foo` replaces `bkthomps` (1 a minute) when both apply: foo's 3 count, bkthomps' not.
    let both: [&[(&str, &str)]; 2] = [
        &[("source_cluster", "proxy"), ("destination_cluster", "bar")],
        &[("foo", "x")],
    ];
    let mut codes = Vec::new();
    for _ in 0..4 {
        codes.push(code(&rls.call("replaces", &both, 0).await));
    }
    assert_eq!(codes, ["OK", "OK", "OK", "OVER_LIMIT"]);
    // Alone, bkthomps still limits: its one a minute was never taken.
    let alone = [("source_cluster", "proxy"), ("destination_cluster", "bar")];
    assert_eq!(rls.codes("replaces", &alone, 2).await, ["OK", "OVER_LIMIT"]);
    // A value ending in `*` matches the values it starts.
    assert_eq!(
        rls.codes("replaces", &[("path", "/foo/bar")], 3).await,
        ["OK", "OK", "OVER_LIMIT"]
    );
    assert_eq!(
        rls.codes("replaces", &[("path", "/other")], 3).await,
        ["OK"; 3]
    );
}

/// A call one descriptor refuses takes nothing from the others (envoyproxy/ratelimit debits
/// them all); `hits_addend` counts that many; Envoy is told the `RateLimit` headers.
#[tokio::test]
async fn a_refused_call_takes_nothing_and_hits_count_as_asked() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("api.yaml"),
        "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: { unit: hour, requests_per_unit: 10 }\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 1, name: per-user }\n",
    )
    .unwrap();
    let yaml = format!(
        "rls: {{ address: 127.0.0.1:0, config: {} }}\n",
        dir.path().display()
    );
    let proxy = TestProxy::inline(&yaml).await;
    let rls = Rls::to(proxy.rls_addr());
    let both: [&[(&str, &str)]; 2] = [&[("tenant", "acme")], &[("user", "ann")]];
    let first = rls.call("api", &both, 0).await;
    assert_eq!(code(&first), "OK");
    let policy = header(&first, "ratelimit-policy").expect("RateLimit-Policy");
    assert!(
        policy.contains("q=1") && policy.contains("w=3600"),
        "{policy}"
    );
    assert!(header(&first, "ratelimit")
        .expect("RateLimit")
        .contains("r=0"));
    for _ in 0..4 {
        let r = rls.call("api", &both, 0).await;
        assert_eq!(
            r.statuses.iter().map(|s| name(s.code)).collect::<Vec<_>>(),
            ["OK", "OVER_LIMIT"]
        );
        assert!(header(&r, "retry-after").is_some());
    }
    // The tenant alone: only the first call took from its 10.
    let r = rls.call("api", &[&[("tenant", "acme")]], 0).await;
    assert_eq!(r.statuses[0].limit_remaining, 8);
    // hits_addend: 4 at a time, 8 left... 4 and 4 pass, the next is over.
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(code(&rls.call("api", &[&[("tenant", "acme")]], 4).await));
    }
    assert_eq!(codes, ["OK", "OK", "OVER_LIMIT"]);
    // A descriptor's own hits_addend wins over the call's.
    let mut req = request("api", &[&[("tenant", "globex")]], 1);
    req.descriptors[0].hits_addend = Some(10);
    let r = rls.try_call(req).await.unwrap();
    assert_eq!((code(&r), r.statuses[0].limit_remaining), ("OK", 0));
    // Malformed calls are refused as the reference refuses them.
    let empty = rls
        .try_call(request("", &[&[("tenant", "a")]], 0))
        .await
        .unwrap_err();
    assert_eq!(empty.code(), tonic::Code::InvalidArgument);
    let none = rls.try_call(request("api", &[], 0)).await.unwrap_err();
    assert_eq!(none.code(), tonic::Code::InvalidArgument);
}

/// An edit of a rule file reloads the rules (the buckets of unchanged rules kept); a broken
/// edit keeps the rules in force and is reported; a new file in the directory is a new domain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rule_files_reload_and_a_broken_one_keeps_the_old_rules() {
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("api.yaml");
    let rules = |n: u32| {
        format!("domain: api\ndescriptors:\n  - key: user\n    rate_limit: {{ unit: hour, requests_per_unit: 3 }}\n  - key: tenant\n    rate_limit: {{ unit: hour, requests_per_unit: {n} }}\n")
    };
    std::fs::write(&file, rules(1)).unwrap();
    let yaml = format!(
        "rls: {{ address: 127.0.0.1:0, config: {} }}\n",
        dir.path().display()
    );
    let proxy = TestProxy::start(&yaml);
    let rls = Rls::to(proxy.rls_addr());
    assert_eq!(rls.codes("api", &[("user", "u")], 1).await, ["OK"]);
    assert_eq!(
        rls.codes("api", &[("tenant", "t")], 2).await,
        ["OK", "OVER_LIMIT"]
    );
    // The tenant's limit raised: its new bucket starts afresh; the user's is kept (2 left).
    std::fs::write(&file, rules(5)).unwrap();
    assert!(
        proxy.wait_for_generation(2, Duration::from_secs(10)).await,
        "reloaded"
    );
    assert_eq!(rls.codes("api", &[("tenant", "t")], 1).await, ["OK"]);
    let r = rls.call("api", &[&[("user", "u")]], 0).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 1,
        "the user's count survived the reload"
    );
    // A broken edit: the rules in force stay; a fixed one and a new domain file load.
    std::fs::write(&file, "domain: api\ndescriptors:\n  - key: user\n    rate_limit: { unit: fortnight, requests_per_unit: 3 }\n").unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(proxy.generation(), 2, "not reloaded");
    assert_eq!(
        rls.codes("api", &[("user", "u")], 2).await,
        ["OK", "OVER_LIMIT"]
    );
    std::fs::write(&file, rules(5)).unwrap();
    std::fs::write(dir.path().join("other.yaml"), "domain: other\ndescriptors:\n  - key: k\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n").unwrap();
    assert!(
        proxy.wait_for_generation(3, Duration::from_secs(10)).await,
        "reloaded again"
    );
    assert_eq!(
        rls.codes("other", &[("k", "v")], 2).await,
        ["OK", "OVER_LIMIT"]
    );
}

/// `tollgate check` reads the rule files, each problem located in its file, and says what the
/// service serves.
#[test]
fn check_reads_the_rule_files_with_located_errors() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("ratelimit")).unwrap();
    std::fs::write(
        dir.path().join("rls.yaml"),
        "rls: { address: 127.0.0.1:8081, config: ratelimit }\n",
    )
    .unwrap();
    let rules = dir.path().join("ratelimit/api.yaml");
    std::fs::write(&rules, "domain: api\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 10 }\n    algorithm: token_bucket\n    burst: 20\n").unwrap();
    let config = dir.path().join("rls.yaml");
    let run = |config: &std::path::Path| {
        let out = common::check(config.to_str().unwrap());
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let (ok, out) = run(&config);
    assert!(ok, "{out}");
    assert!(
        out.contains("rls (envoy.service.ratelimit.v3): 127.0.0.1:8081"),
        "{out}"
    );
    assert!(out.contains("domain api: 1 rules, 1 with a limit"), "{out}");
    // `tollgate explain` explains a call from the config alone.
    let out = common::proxy::run_cli(&[
        "explain",
        "--config",
        config.to_str().unwrap(),
        "--domain",
        "api",
        "--descriptor",
        "user=ann",
        "--descriptor",
        "other=x",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("descriptor user=ann: limited by rls:api:user"),
        "{text}"
    );
    assert!(text.contains("descriptor other=x: not limited"), "{text}");
    assert!(
        text.contains("20 of 20"),
        "a token bucket of burst 20: {text}"
    );
    std::fs::write(&rules, "domain: api\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 10 }\n    algoritm: sliding\n").unwrap();
    let (ok, out) = run(&config);
    assert!(!ok);
    assert!(out.contains("api.yaml:5:"), "located: {out}");
    assert!(out.contains("did you mean `algorithm`?"), "{out}");
}

/// tollgate's `ban:` on a rule: a descriptor that keeps going over is refused for the ban's
/// length, which Envoy is told as the time to come back.
#[tokio::test]
async fn a_rule_with_a_ban_refuses_a_descriptor_that_keeps_going_over() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("login.yaml"),
        "domain: login\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n    ban: { after: 2, within: 1m, for: 10m, max: 1h }\n",
    )
    .unwrap();
    let yaml = format!(
        "rls: {{ address: 127.0.0.1:0, config: {} }}\n",
        dir.path().display()
    );
    let proxy = TestProxy::inline(&yaml).await;
    let rls = Rls::to(proxy.rls_addr());
    let user = [("user", "mallory")];
    assert_eq!(
        rls.codes("login", &user, 3).await,
        ["OK", "OVER_LIMIT", "OVER_LIMIT"]
    );
    let banned = rls.call("login", &[&user], 0).await;
    assert_eq!(code(&banned), "OVER_LIMIT");
    let retry: u64 = header(&banned, "retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!(
        (590..=600).contains(&retry),
        "the ban's 10 minutes: {retry}"
    );
    // Another user is not banned.
    assert_eq!(rls.codes("login", &[("user", "alice")], 1).await, ["OK"]);
}

/// Operators' bans and overrides from the admin API name descriptors as they name requests:
/// an entry's key as a header (`header:user=bob`), `remote_address` as the address; a ban's
/// route is `rls:DOMAIN`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_ban_and_override_descriptors() {
    use http_body_util::BodyExt;
    use serde_json::json;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("api.yaml"),
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 2 }\n  - key: remote_address\n    rate_limit: { unit: hour, requests_per_unit: 100 }\n",
    )
    .unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let yaml = format!(
        "admin: {{ address: 127.0.0.1:0, token_file: {} }}\nrls: {{ address: 127.0.0.1:0, config: {} }}\n",
        token.display(),
        dir.path().display()
    );
    let proxy = TestProxy::start(&yaml);
    let rls = Rls::to(proxy.rls_addr());
    let admin = proxy.admin_addr();
    let post = |path: &str, body: serde_json::Value| {
        let url = format!("http://{admin}/api/v1{path}");
        async move { post_json(&url, &body.to_string()).await }
    };
    let (by_header, text) = post(
        "/bans",
        json!({"identity": "header:user=bob", "routes": ["rls:api"], "ttl": "10m"}),
    )
    .await;
    assert_eq!(by_header, 201, "{text}");
    let r = rls.call("api", &[&[("user", "bob")]], 0).await;
    assert_eq!(code(&r), "OVER_LIMIT");
    let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert!((590..=600).contains(&retry), "{retry}");
    assert_eq!(rls.codes("api", &[("user", "ann")], 1).await, ["OK"]);
    let (by_address, text) = post("/bans", json!({"identity": "198.51.100.7", "ttl": "10m"})).await;
    assert_eq!(by_address, 201, "{text}");
    assert_eq!(
        rls.codes("api", &[("remote_address", "198.51.100.7")], 1)
            .await,
        ["OVER_LIMIT"]
    );
    assert_eq!(
        rls.codes("api", &[("remote_address", "198.51.100.8")], 1)
            .await,
        ["OK"]
    );
    // An override raises one user's window: five, from zero; the others keep two.
    let (raised, text) = post("/overrides", json!({"limit": "rls:api:user", "identity": "header:user=vip", "quota": "5/1h", "ttl": "10m"})).await;
    assert_eq!(raised, 201, "{text}");
    assert_eq!(
        rls.codes("api", &[("user", "vip")], 6).await,
        ["OK", "OK", "OK", "OK", "OK", "OVER_LIMIT"]
    );
    assert_eq!(
        rls.codes("api", &[("user", "ann")], 2).await,
        ["OK", "OVER_LIMIT"]
    );
    // The admin API explains a call as the service would decide it, counting nothing.
    let get = |q: &str| {
        let url = format!("http://{admin}/api/v1/explain?{q}");
        async move {
            let req = http::Request::get(url)
                .header("authorization", "Bearer s3cret")
                .body(
                    http_body_util::Empty::new()
                        .map_err(|never| match never {})
                        .boxed(),
                )
                .unwrap();
            let r = common::Http::new().send(req).await;
            (
                r.code(),
                serde_json::from_str::<serde_json::Value>(r.text()).unwrap_or_default(),
            )
        }
    };
    let (status, e) = get("domain=api&descriptor=user%3Dann").await;
    assert_eq!(status, 200, "{e}");
    assert_eq!(e["decision"]["outcome"], "limited", "{e}");
    assert_eq!(e["limits"][0]["name"], "rls:api:user");
    assert_eq!(e["limits"][0]["now"]["remaining"], 0);
    assert_eq!(e["descriptors"][0]["applies"], "limited");
    let (_, e) = get("domain=api&descriptor=user%3Dvip").await;
    assert!(
        e["limits"][0]["override"].is_object(),
        "the override shown: {e}"
    );
    let (_, e) = get("domain=api&descriptor=user%3Dbob").await;
    assert_eq!(e["decision"]["outcome"], "operator_ban", "{e}");
    let (_, e) = get("domain=api&descriptor=other%3Dx").await;
    assert_eq!(
        (
            e["decision"]["outcome"].as_str(),
            e["descriptors"][0]["applies"].as_str()
        ),
        (Some("admitted"), Some("not limited"))
    );
    assert_eq!(
        rls.codes("api", &[("user", "ann")], 1).await,
        ["OVER_LIMIT"],
        "explain took nothing"
    );
    // An unknown domain is not a route a ban can name.
    let (unknown_domain, _) = post(
        "/bans",
        json!({"identity": "1.2.3.4", "routes": ["rls:nowhere"], "ttl": "10m"}),
    )
    .await;
    assert_eq!(unknown_domain, 400);
}

/// POST `body` as JSON with the test token: the status and the body.
async fn post_json(url: &str, body: &str) -> (u16, String) {
    use http_body_util::BodyExt;
    let req = http::Request::post(url)
        .header("authorization", "Bearer s3cret")
        .header("content-type", "application/json")
        .body(
            http_body_util::Full::new(bytes::Bytes::from(body.to_owned()))
                .map_err(|never| match never {})
                .boxed(),
        )
        .unwrap();
    let r = common::Http::new().send(req).await;
    (r.code(), r.text().to_owned())
}

/// A descriptor's own `limit` (Envoy's `limit` override, from dynamic metadata) is counted as
/// the reference counts it: a fixed window of its numbers, whatever the config's rule says.
#[tokio::test]
async fn a_descriptors_own_limit_is_counted_at_its_numbers() {
    use tollgate::rls::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    let (_proxy, rls) = service().await;
    let call = |key: &str, value: &str| {
        let mut req = request("mongo_cps", &[&[(key, value)]], 0);
        req.descriptors[0].limit = Some(RateLimitOverride {
            requests_per_unit: 2,
            unit: 3,
        });
        req
    };
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(code(&rls.try_call(call("tenant", "t1")).await.unwrap()));
    }
    assert_eq!(
        codes,
        ["OK", "OK", "OVER_LIMIT"],
        "an unconfigured key, limited by its own numbers"
    );
    let r = rls.try_call(call("database", "users")).await.unwrap();
    let limit = r.statuses[0]
        .current_limit
        .as_ref()
        .expect("the override's numbers");
    assert_eq!(
        (
            limit.requests_per_unit,
            limit.unit,
            r.statuses[0].limit_remaining
        ),
        (2, 3, 1),
        "over the config's 500/s"
    );
}

/// With `telemetry.traces`, a call is a SERVER span of Envoy's trace (its `traceparent` in the
/// call's metadata), with `rpc.*`, the domain and one event per descriptor limit, exported to a
/// real OTLP receiver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_a_span_of_envoys_trace() {
    let receiver = crate::common::otlp::Receiver::start("ok");
    let yaml = format!(
        "rls:\n  address: 127.0.0.1:0\n  config: {}\ntelemetry:\n  traces: {{ endpoint: \"{}\" }}\n",
        fixtures(),
        receiver.http_url()
    );
    let proxy = TestProxy::start(&yaml);
    let rls = Rls::to(proxy.rls_addr());
    let mut call = tonic::Request::new(request(
        "messaging",
        &[&[("message_type", "marketing"), ("to_number", "2069999999")]],
        0,
    ));
    let parent = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    call.metadata_mut()
        .insert("traceparent", parent.parse().unwrap());
    let answer = rls.try_call(call).await.expect("an answer");
    assert_eq!(code(&answer), "OK");
    let spans = receiver.trace(
        "5bf92f3577b34da6a3ce929d0e0e4736",
        1,
        std::time::Duration::from_secs(10),
    );
    assert_eq!(spans.len(), 1, "{spans:#?}");
    let s = &spans[0];
    assert_eq!(s["kind"], 2);
    assert_eq!(s["parent_span_id"], "00f067aa0ba902b7");
    assert_eq!(
        s["name"],
        "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    );
    let a = &s["attributes"];
    assert_eq!(a["rpc.system"], "grpc");
    assert_eq!(a["tollgate.rls.domain"], "messaging");
    assert_eq!(a["tollgate.outcome"], "ok");
    let event = &s["events"][0]["attributes"];
    assert_eq!(event["tollgate.limit.outcome"], "admitted");
    assert_eq!(event["tollgate.limit.remaining"], 4, "5 a day, one taken");
}
