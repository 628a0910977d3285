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
