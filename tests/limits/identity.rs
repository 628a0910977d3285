//! Who a limit counts: alternatives in order, `+` joins, every key source, and the one shared
//! `anonymous` bucket for requests that carry none of the alternatives. Different client
//! addresses are real TCP peers (127.0.0.2, 127.0.0.3: Linux routes all of 127/8 to loopback).
//! The proxy is served in-process (`TestProxy`).

use crate::common;

use common::{config, Http, TestProxy};

/// A proxy whose routes answer 200 themselves; `routes` is the YAML list under `routes:`.
fn answering(routes: &str) -> TestProxy {
    TestProxy::start(&config(&format!("routes:\n{routes}")))
}

/// A route `name` on `/name/` answering 200, with one limit of burst `burst` and `key`.
fn route(name: &str, burst: u32, key: &str) -> String {
    format!(
        "  - name: {name}\n    match: {{ path_prefix: /{name}/ }}\n    respond: {{ status: 200 }}\n    \
         limits:\n      - {{ name: {name}-limit, rate: 1/min, burst: {burst}, key: {key} }}\n"
    )
}

#[tokio::test]
async fn the_first_present_alternative_is_the_identity() {
    let proxy = answering(&route("api", 2, "[header:X-API-Key, ip]"));
    let url = proxy.url("/api/");
    let (a, b) = (Http::new(), Http::from_ip("127.0.0.2"));
    let key_a = [("x-api-key", "key-a")];
    let key_b = [("x-api-key", "key-b")];
    assert_eq!(a.statuses(3, &url, &key_a).await, [200, 200, 429]);
    assert_eq!(a.statuses(3, &url, &key_b).await, [200, 200, 429]);
    // Without a key, the address is the identity: 127.0.0.1 has not spent anything yet.
    assert_eq!(a.statuses(3, &url, &[]).await, [200, 200, 429]);
    assert_eq!(b.statuses(2, &url, &[]).await, [200, 200]);
    // With a key, the address does not matter: key-a is spent wherever it comes from.
    assert_eq!(b.statuses(1, &url, &key_a).await, [429]);
    // An empty key identifies nobody: the next alternative (the address) applies.
    assert_eq!(b.statuses(1, &url, &[("x-api-key", "")]).await, [429]);
}

#[tokio::test]
async fn joined_sources_are_one_identity_present_only_when_every_part_is() {
    let proxy = answering(&route("tenant", 1, "[header:X-Tenant+ip]"));
    let url = proxy.url("/tenant/");
    let (one, two, three) = (
        Http::new(),
        Http::from_ip("127.0.0.2"),
        Http::from_ip("127.0.0.3"),
    );
    let acme = [("x-tenant", "acme")];
    assert_eq!(one.statuses(2, &url, &acme).await, [200, 429]);
    assert_eq!(two.statuses(2, &url, &acme).await, [200, 429]);
    assert_eq!(
        one.statuses(1, &url, &[("x-tenant", "globex")]).await,
        [200]
    );
    // No tenant: the only alternative is missing, so both addresses share `anonymous`.
    assert_eq!(one.statuses(1, &url, &[]).await, [200]);
    assert_eq!(three.statuses(1, &url, &[]).await, [429]);
}

#[tokio::test]
async fn query_cookie_and_bearer_identities() {
    let proxy = answering(&format!(
        "{}{}{}",
        route("query", 1, "[query:user]"),
        route("cookie", 1, "[cookie:session]"),
        route("bearer", 1, "[bearer]"),
    ));
    let http = Http::new();
    let q = |s: &str| proxy.url(&format!("/query/?{s}"));
    assert_eq!(http.get(&q("user=alice")).await.code(), 200);
    assert_eq!(http.get(&q("user=alice")).await.code(), 429);
    assert_eq!(http.get(&q("page=2&user=bob")).await.code(), 200);
    // Percent-decoded: `%61lice` is alice.
    assert_eq!(http.get(&q("user=%61lice&page=3")).await.code(), 429);

    let c = proxy.url("/cookie/");
    let cookie = |v: &'static str| [("cookie", v)];
    assert_eq!(http.get_with(&c, &cookie("session=s1")).await.code(), 200);
    assert_eq!(
        http.get_with(&c, &cookie("theme=dark; session=s1"))
            .await
            .code(),
        429
    );
    assert_eq!(
        http.get_with(&c, &cookie("session=s2; theme=dark"))
            .await
            .code(),
        200
    );

    let b = proxy.url("/bearer/");
    let auth = |v: &'static str| [("authorization", v)];
    assert_eq!(http.get_with(&b, &auth("Bearer tok-1")).await.code(), 200);
    assert_eq!(http.get_with(&b, &auth("bearer tok-1")).await.code(), 429);
    assert_eq!(http.get_with(&b, &auth("Bearer tok-2")).await.code(), 200);
    // Basic credentials are not a bearer token: anonymous, shared with no header at all.
    assert_eq!(http.get_with(&b, &auth("Basic dTpw")).await.code(), 200);
    assert_eq!(http.get(&b).await.code(), 429);
}

#[tokio::test]
async fn host_method_and_path_identities() {
    let proxy = answering(&format!(
        "{}{}",
        route("host", 1, "[host]"),
        route("mp", 1, "[method+path]"),
    ));
    let http = Http::new();
    let h = proxy.url("/host/");
    assert_eq!(http.get_with(&h, &[("host", "a.test")]).await.code(), 200);
    // The port is not part of the host, and case does not matter.
    assert_eq!(
        http.get_with(&h, &[("host", "A.test:8080")]).await.code(),
        429
    );
    assert_eq!(http.get_with(&h, &[("host", "b.test")]).await.code(), 200);

    let get = |path: &str| common::client::request("GET", &proxy.url(path), &[]);
    let post = |path: &str| common::client::request("POST", &proxy.url(path), &[]);
    assert_eq!(http.send(get("/mp/a")).await.code(), 200);
    assert_eq!(http.send(get("/mp/a")).await.code(), 429);
    assert_eq!(http.send(post("/mp/a")).await.code(), 200);
    assert_eq!(http.send(get("/mp/b")).await.code(), 200);
}

#[tokio::test]
async fn a_global_key_is_one_bucket_for_everyone() {
    let proxy = answering(&route("all", 2, "[global]"));
    let url = proxy.url("/all/");
    assert_eq!(Http::new().get(&url).await.code(), 200);
    let keyed = [("x-api-key", "k")];
    assert_eq!(
        Http::from_ip("127.0.0.2")
            .get_with(&url, &keyed)
            .await
            .code(),
        200
    );
    assert_eq!(Http::from_ip("127.0.0.3").get(&url).await.code(), 429);
}

#[tokio::test]
async fn requests_lacking_every_alternative_share_one_anonymous_bucket_per_limit() {
    let proxy = answering(&format!(
        "{}{}",
        route("anon", 2, "[header:X-API-Key, query:key]"),
        route("other", 1, "[header:X-API-Key]"),
    ));
    let url = proxy.url("/anon/");
    assert_eq!(Http::new().get(&url).await.code(), 200);
    assert_eq!(Http::from_ip("127.0.0.2").get(&url).await.code(), 200);
    assert_eq!(Http::from_ip("127.0.0.3").get(&url).await.code(), 429);
    // Either alternative leaves the anonymous bucket.
    let http = Http::new();
    assert_eq!(http.get_with(&url, &[("x-api-key", "k")]).await.code(), 200);
    assert_eq!(http.get(&proxy.url("/anon/?key=k")).await.code(), 200);
    // Another limit has an anonymous bucket of its own.
    assert_eq!(http.get(&proxy.url("/other/")).await.code(), 200);
}
