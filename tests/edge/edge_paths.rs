//! Requests that would escape their route's limit by spelling: method case, a
//! trailing slash, path parameters, `..;/`, a raw backslash, overlong UTF-8, double encoding,
//! and path case on a route for a case-insensitive backend. Each is refused before anything
//! reaches the backend, or meets the route (and the limit) the backend will serve it under;
//! the raw backend shows what it received.

use crate::shared as edge;

use common::TestProxy;
use edge::{ok_answer, yaml, Raw, RawBackend, CATCH_ALL, WAIT};

use crate::common;

/// `/login` (POST only) and `/api/login` limited to one request per client address, `/admin/`
/// answered by the proxy itself (a deny rule), everything else forwarded unlimited.
const ROUTES: &str = "  - name: login
    match: { path: /login, methods: [POST] }
    upstream: app
    limits:
      - { name: login, rate: 1/min, burst: 1, key: [ip] }
  - name: api-login
    match: { path: /api/login }
    upstream: app
    limits:
      - { name: api-login, rate: 1/min, burst: 1, key: [ip] }
  - name: admin
    match: { path_prefix: /admin/ }
    respond: { status: 403, body: \"no\\n\" }
  - name: all
    upstream: app
";

async fn send(proxy: &TestProxy, from: &str, request_line: &str) -> edge::Resp {
    let mut c = Raw::open_from(proxy.addr(), from).await;
    c.send(format!("{request_line}\r\nHost: a\r\nContent-Length: 0\r\n\r\n").as_bytes())
        .await;
    c.response().await
}

/// Refused with 400, the connection closed, and nothing forwarded.
async fn refused(proxy: &TestProxy, backend: &RawBackend, request_line: &str) {
    let before = backend.requests().len();
    let mut c = Raw::open(proxy.addr()).await;
    c.send(format!("{request_line}\r\nHost: a\r\n\r\n").as_bytes())
        .await;
    let r = c.response().await;
    assert_eq!(r.status, 400, "{request_line} -> {r:?}");
    assert!(c.closed_clean(WAIT).await, "{request_line}: still open");
    assert_eq!(
        backend.requests().len(),
        before,
        "{request_line} reached the backend"
    );
}

/// The request lines the backend received, sorted (connections from the pool are reused in
/// no particular order).
fn request_lines(backend: &RawBackend) -> Vec<String> {
    let mut lines: Vec<String> = backend
        .requests()
        .iter()
        .map(|r| {
            let text = String::from_utf8_lossy(r).into_owned();
            text.split("\r\n").next().unwrap_or_default().to_owned()
        })
        .collect();
    lines.sort();
    lines
}

fn sorted(lines: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut lines: Vec<String> = lines.into_iter().collect();
    lines.sort();
    lines
}

#[tokio::test]
async fn methods_in_lower_case_are_refused_and_upper_case_meets_the_limit() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", ROUTES));
    for line in [
        "post /login HTTP/1.1",
        "Post /login HTTP/1.1",
        "get / HTTP/1.1",
    ] {
        refused(&proxy, &backend, line).await;
    }
    assert_eq!(
        send(&proxy, "127.0.0.5", "POST /login HTTP/1.1")
            .await
            .status,
        200
    );
    assert_eq!(
        send(&proxy, "127.0.0.5", "POST /login HTTP/1.1")
            .await
            .status,
        429
    );
    assert_eq!(request_lines(&backend), ["POST /login HTTP/1.1"]);
}

#[tokio::test]
async fn a_trailing_slash_meets_the_exact_paths_limit() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", ROUTES));
    for (i, (first, second)) in [("/login", "/login/"), ("/login/", "/login")]
        .into_iter()
        .enumerate()
    {
        let ip = format!("127.0.0.{}", 10 + i);
        let r = send(&proxy, &ip, &format!("POST {first} HTTP/1.1")).await;
        assert_eq!(r.status, 200, "{first}");
        let r = send(&proxy, &ip, &format!("POST {second} HTTP/1.1")).await;
        assert_eq!(r.status, 429, "{second} after {first}");
    }
    // Forwarded as sent: the slash is the backend's to judge.
    assert_eq!(
        request_lines(&backend),
        ["POST /login HTTP/1.1", "POST /login/ HTTP/1.1"]
    );
    // `path_prefix: /admin/` covers `/admin` too (a deny rule must).
    for path in ["/admin", "/admin/", "/admin/x", "//admin"] {
        let r = send(&proxy, "127.0.0.1", &format!("GET {path} HTTP/1.1")).await;
        assert_eq!(r.status, 403, "{path}");
    }
    assert_eq!(backend.requests().len(), 2);
}

#[tokio::test]
async fn path_parameters_meet_the_limit_of_the_path_without_them() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", ROUTES));
    let spellings = [
        "/api/login",
        "/api;x=y/login",
        "/api/login;jsessionid=0123ABCD",
        "/api;a/login;b/",
    ];
    for (i, first) in spellings.iter().enumerate() {
        let ip = format!("127.0.0.{}", 30 + i);
        let r = send(&proxy, &ip, &format!("GET {first}?q=1 HTTP/1.1")).await;
        assert_eq!(r.status, 200, "{first}");
        for second in spellings {
            let r = send(&proxy, &ip, &format!("GET {second} HTTP/1.1")).await;
            assert_eq!(r.status, 429, "{second} after {first}: another bucket?");
        }
    }
    // The backend receives the parameters (URL sessions, matrix parameters).
    let want = sorted(spellings.iter().map(|s| format!("GET {s}?q=1 HTTP/1.1")));
    assert_eq!(request_lines(&backend), want);
    // `/admin;x/` is the deny rule's `/admin/`.
    let r = send(&proxy, "127.0.0.1", "GET /admin;x=1/ HTTP/1.1").await;
    assert_eq!(r.status, 403);
}

/// A segment's trailing dots are dropped for routing (IIS and Windows file names drop them):
/// `/api/login.` and `/api/login%2e` meet `/api/login`'s limit, and go upstream as sent.
#[tokio::test]
async fn trailing_dots_meet_the_limit_of_the_path_without_them() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", ROUTES));
    let r = send(&proxy, "127.0.0.40", "GET /api/login HTTP/1.1").await;
    assert_eq!(r.status, 200);
    for spelling in [
        "/api/login.",
        "/api/login%2e",
        "/api/login..",
        "/api./login",
    ] {
        let r = send(&proxy, "127.0.0.40", &format!("GET {spelling} HTTP/1.1")).await;
        assert_eq!(r.status, 429, "{spelling}: past the limit");
    }
    let r = send(&proxy, "127.0.0.41", "GET /api/login. HTTP/1.1").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        request_lines(&backend),
        ["GET /api/login HTTP/1.1", "GET /api/login. HTTP/1.1"]
    );
}

/// `path_extensions: true` on an exact path (for Spring MVC before 5.3, which serves
/// `/login.json` as `/login`): the extension meets the path's limit. Without it, the request
/// is another path (the catch-all's).
#[tokio::test]
async fn path_extensions_meet_the_limit_of_the_path() {
    let backend = RawBackend::start(ok_answer).await;
    let routes = ROUTES.replace(
        "    match: { path: /api/login }",
        "    match: { path: /api/login, path_extensions: true }",
    );
    let proxy = TestProxy::start(&yaml(backend.addr, "", &routes));
    assert_eq!(
        send(&proxy, "127.0.0.50", "GET /api/login HTTP/1.1")
            .await
            .status,
        200
    );
    for spelling in ["/api/login.json", "/api/login.xml", "/api/login.json/"] {
        let r = send(&proxy, "127.0.0.50", &format!("GET {spelling} HTTP/1.1")).await;
        assert_eq!(r.status, 429, "{spelling}: past the limit");
    }
    let proxy = TestProxy::start(&yaml(backend.addr, "", ROUTES));
    assert_eq!(
        send(&proxy, "127.0.0.51", "GET /api/login HTTP/1.1")
            .await
            .status,
        200
    );
    let r = send(&proxy, "127.0.0.51", "GET /api/login.json HTTP/1.1").await;
    assert_eq!(r.status, 200, "without the option, another path");
}

#[tokio::test]
async fn spellings_some_backend_reads_as_another_path_are_refused() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", ROUTES));
    for path in [
        // Tomcat: `..;` is `..` once the parameter is stripped.
        "/public/..;/admin/x",
        "/public/..;x=1/admin/",
        "/public/.;/admin/",
        // IIS and other Windows servers read `\\` as `/`.
        "/public\\..\\admin/",
        "/admin\\x",
        // Overlong UTF-8 for `/` and `.`, and bytes no UTF-8 has.
        "/public%C0%AF..%C0%AFadmin/",
        "/%c0%ae%c0%ae/admin/",
        "/x%FF",
        // Double encoding: `/`, `.`, `a` once decoded twice.
        "/public%252f..%252fadmin/",
        "/%252e%252e/admin/",
        "/%2561dmin/",
        // Encoded whitespace a backend may trim: `/api/login%20` is `/api/login` there.
        "/api/login%20",
        "/api/login%09",
        "/api/login%20/",
        "/admin%0D/x",
        // Unicode spaces, encoded: trimmed by the same backends.
        "/api/login%C2%A0",
        "/api/login%E3%80%80",
        // An NTFS stream: IIS serves `/api/login`.
        "/api/login::$DATA",
    ] {
        refused(&proxy, &backend, &format!("GET {path} HTTP/1.1")).await;
    }
    assert!(backend.requests().is_empty());
}

#[tokio::test]
async fn a_case_insensitive_route_meets_every_case_of_its_path() {
    let backend = RawBackend::start(ok_answer).await;
    let routes = "  - name: iis-admin
    match: { path_prefix: /Admin/, path_case: insensitive }
    upstream: app
    limits:
      - { name: per-page, rate: 1/min, burst: 1, key: [ip, path] }
  - name: cased
    match: { path: /Cased }
    respond: { status: 204 }
  - name: all
    upstream: app
";
    let proxy = TestProxy::start(&yaml(backend.addr, "", routes));
    let spellings = ["/admin/page.aspx", "/ADMIN/Page.aspx", "/Admin/PAGE.ASPX/"];
    for (i, first) in spellings.iter().enumerate() {
        let ip = format!("127.0.0.{}", 40 + i);
        let r = send(&proxy, &ip, &format!("GET {first} HTTP/1.1")).await;
        assert_eq!(r.status, 200, "{first}");
        for second in spellings {
            let r = send(&proxy, &ip, &format!("GET {second} HTTP/1.1")).await;
            // Keyed by path: one bucket for every case of it.
            assert_eq!(r.status, 429, "{second} after {first}");
        }
    }
    // The backend gets the path as sent; routes without the option keep their case.
    let want = sorted(spellings.iter().map(|s| format!("GET {s} HTTP/1.1")));
    assert_eq!(request_lines(&backend), want);
    assert_eq!(
        send(&proxy, "127.0.0.1", "GET /Cased HTTP/1.1")
            .await
            .status,
        204
    );
    assert_eq!(
        send(&proxy, "127.0.0.1", "GET /cased HTTP/1.1")
            .await
            .status,
        200
    );
}

#[test]
fn route_paths_and_path_case_are_validated() {
    let config = |matcher: &str| {
        format!(
            "listeners:\n  - address: 127.0.0.1:0\nroutes:\n  - name: r\n    match: {matcher}\n    \
             respond: {{ status: 200 }}\n"
        )
    };
    for (matcher, path, message) in [
        (
            "{ path: /a, path_case: upper }",
            "routes[0].match.path_case",
            "`upper` is not sensitive or insensitive",
        ),
        (
            "{ path_case: insensitive }",
            "routes[0].match.path_case",
            "only applies with `path` or `path_prefix`",
        ),
        (
            "{ path: \"/api;v=1/login\" }",
            "routes[0].match.path",
            "`/api;v=1/login` could never match: request paths are matched in normal form, as \
             `/api/login`",
        ),
        (
            "{ path_prefix: \"//api/\" }",
            "routes[0].match.path_prefix",
            "`//api/` could never match: request paths are matched in normal form, as `/api/`",
        ),
        (
            "{ path: \"/a%2fb\" }",
            "routes[0].match.path",
            "`/a%2fb` could never match: requests spelled so are refused with 400",
        ),
    ] {
        let problems = tollgate::config::parse(&config(matcher)).expect_err(matcher);
        assert_eq!(problems.len(), 1, "{matcher}: {problems:?}");
        assert_eq!(problems[0].path, path, "{matcher}");
        assert_eq!(problems[0].message, message, "{matcher}");
        assert!(problems[0].at.is_some(), "{matcher}: located");
    }
    for ok in [
        "{ path: /login/, path_case: sensitive }",
        "{ path_prefix: /Admin/, path_case: insensitive }",
    ] {
        assert!(tollgate::config::parse(&config(ok)).is_ok(), "{ok}");
    }
    let _ = CATCH_ALL;
}

#[tokio::test]
async fn the_asterisk_target_is_for_options_only_and_never_forwarded() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", ROUTES));
    // Not `/*` under another name: any other method with `*` is malformed.
    for method in ["GET", "POST", "DELETE"] {
        refused(&proxy, &backend, &format!("{method} * HTTP/1.1")).await;
    }
    // `OPTIONS *` asks about the server: tollgate answers it, as Apache httpd does.
    let r = send(&proxy, "127.0.0.1", "OPTIONS * HTTP/1.1").await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        r.header("allow").is_some_and(|a| a.contains("OPTIONS")),
        "{r:?}"
    );
    assert!(backend.requests().is_empty(), "nothing forwarded");
}
