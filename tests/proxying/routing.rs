//! Routing through the real proxy: first match in file order on host (exact or `*.suffix`, port
//! ignored, from `Host` or HTTP/2's `:authority`), exact path, prefix, methods, header values;
//! `respond` routes with their status, body and headers; round robin over upstream targets.
//! The proxy is served in-process (`TestProxy`).

use crate::common;

use common::client::{h2c_to, request};
use common::{config, Http, MockUpstream, TestProxy};

/// Every route answers with its own name, so a response tells which route matched.
const ROUTES: &str = "routes:
  - name: login
    match: { path: /login, methods: [POST] }
    respond: { status: 200, body: login }
  - name: tenant
    match: { path_prefix: /v1/, headers: { X-Tenant: acme } }
    respond: { status: 200, body: tenant }
  - name: api
    match: { host: api.example.com, path_prefix: /v1/ }
    respond: { status: 200, body: api }
  - name: wildcard
    match: { host: \"*.example.com\" }
    respond: { status: 201, body: wildcard, headers: { X-Route: wildcard, Content-Type: text/x-route } }
  - name: fallback
    match: { path_prefix: /public/ }
    respond: { status: 200, body: fallback }
";

async fn route_of(http: &Http, method: &str, url: &str, headers: &[(&str, &str)]) -> String {
    let r = http.send(request(method, url, headers)).await;
    match r.code() {
        404 => "404".to_owned(),
        _ => r.text().to_owned(),
    }
}

#[tokio::test]
async fn the_first_matching_route_in_file_order_answers() {
    let proxy = TestProxy::start(&config(ROUTES));
    let http = Http::new();
    let url = |p: &str| proxy.url(p);
    let api = [("host", "api.example.com")];
    assert_eq!(route_of(&http, "POST", &url("/login"), &[]).await, "login");
    assert_eq!(route_of(&http, "GET", &url("/login"), &[]).await, "404");
    // A method in lower case is refused (400), not routed as another method.
    assert_eq!(
        http.send(request("post", &url("/login"), &[])).await.code(),
        400
    );
    // Both `tenant` and `api` match; `tenant` comes first.
    let both = [("host", "api.example.com"), ("x-tenant", "acme")];
    assert_eq!(route_of(&http, "GET", &url("/v1/a"), &both).await, "tenant");
    let other_tenant = [("host", "api.example.com"), ("x-tenant", "globex")];
    assert_eq!(
        route_of(&http, "GET", &url("/v1/a"), &other_tenant).await,
        "api"
    );
    assert_eq!(route_of(&http, "GET", &url("/v1/a"), &api).await, "api");
    // Host matching ignores the port and case.
    let with_port = [("host", "API.Example.com:8443")];
    assert_eq!(
        route_of(&http, "GET", &url("/v1/a"), &with_port).await,
        "api"
    );
    // `*.example.com` is any subdomain, not the apex and not a look-alike.
    let sub = [("host", "www.example.com")];
    assert_eq!(
        route_of(&http, "GET", &url("/v1/a"), &sub).await,
        "wildcard"
    );
    let apex = [("host", "example.com")];
    assert_eq!(route_of(&http, "GET", &url("/x"), &apex).await, "404");
    let lookalike = [("host", "evil-example.com")];
    assert_eq!(route_of(&http, "GET", &url("/x"), &lookalike).await, "404");
    assert_eq!(
        route_of(&http, "GET", &url("/public/x"), &lookalike).await,
        "fallback"
    );
}

#[tokio::test]
async fn respond_routes_send_their_status_headers_and_body() {
    let proxy = TestProxy::start(&config(ROUTES));
    let r = Http::new()
        .get_with(&proxy.url("/"), &[("host", "www.example.com")])
        .await;
    assert_eq!(r.code(), 201);
    assert_eq!(r.text(), "wildcard");
    assert_eq!(r.header("x-route"), "wildcard");
    assert_eq!(r.header("content-type"), "text/x-route");
    let r = Http::new().get(&proxy.url("/public/")).await;
    assert_eq!(r.header("content-type"), "text/plain; charset=utf-8");
}

#[tokio::test]
async fn http2_authority_is_the_host_routes_match() {
    let proxy = TestProxy::start(&config(ROUTES));
    for (authority, expected) in [
        ("api.example.com", "api"),
        ("api.example.com:8443", "api"),
        ("www.example.com", "wildcard"),
        ("example.com", "404"),
    ] {
        let url = format!("http://{authority}/v1/a");
        let r = h2c_to(proxy.addr(), request("GET", &url, &[])).await;
        assert_eq!(r.version, http::Version::HTTP_2);
        let got = if r.code() == 404 { "404" } else { r.text() };
        assert_eq!(got, expected, ":authority {authority}");
    }
}

#[tokio::test]
async fn targets_of_an_upstream_take_turns() {
    let (a, b) = (MockUpstream::start(), MockUpstream::start());
    let proxy = TestProxy::start(&config(&format!(
        "upstreams:\n  app:\n    targets: [{}, {}]\nroutes:\n  - name: r\n    upstream: app\n",
        a.addr(),
        b.addr()
    )));
    let http = Http::new();
    for _ in 0..6 {
        assert_eq!(http.get(&proxy.url("/rr")).await.code(), 200);
    }
    assert_eq!((a.count(), b.count()), (3, 3));
}
