//! Forwarding: X-Forwarded-* and the client address behind trusted proxies, hop-by-hop headers
//! both ways, 50 MB streamed each way, 404/502/504, HTTP/2 prior knowledge, keep-alive.
//!
//! The proxies are served in-process (`TestProxy`); the streaming tests, which judge the proxy
//! by its peak memory, run the binary (`BinaryProxy`), the only one with a peak RSS of its own.

use crate::common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::client::{drain, request, upload};
use common::{config, refused_addr, upstream_app, BinaryProxy, Http, MockUpstream, Raw, TestProxy};
use http::Version;

/// `/limited/` counts per client address (burst 2, nothing refills during a test), `/dead/`
/// goes to a refused address, everything else to `up` unlimited (timeout 500 ms).
fn proxy(up: &MockUpstream, trusted: &str) -> TestProxy {
    TestProxy::start(&proxy_config(up, trusted))
}

/// The config of `proxy`.
fn proxy_config(up: &MockUpstream, trusted: &str) -> String {
    config(&format!(
        "trusted_proxies: {trusted}
{}  dead:
    targets: [{}]
    connect_timeout: 1s
routes:
  - name: limited
    match: {{ path_prefix: /limited/ }}
    upstream: app
    limits:
      - {{ name: per-ip, rate: 1/min, burst: 2, key: [ip] }}
  - name: dead
    match: {{ path_prefix: /dead/ }}
    upstream: dead
  - name: app
    match: {{ path_prefix: /app/ }}
    upstream: app
    max_body: 64MiB
",
        upstream_app(up.addr(), "500ms"),
        refused_addr()
    ))
}

#[tokio::test]
async fn an_untrusted_peer_cannot_spoof_forwarded_headers() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[127.0.0.1/32]");
    let spoofer = Http::from_ip("127.0.0.2");
    let url = proxy.url("/limited/x");
    let mut statuses = Vec::new();
    for fake in ["203.0.113.1", "203.0.113.2", "203.0.113.3"] {
        let headers = [
            ("host", "shop.test"),
            ("x-forwarded-for", fake),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "evil.test"),
        ];
        statuses.push(spoofer.get_with(&url, &headers).await.code());
    }
    assert_eq!(
        statuses,
        [200, 200, 429],
        "counted by the peer, not by its claims"
    );
    let seen = up.seen();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        assert_eq!(
            s.header("x-forwarded-for"),
            "127.0.0.2",
            "replaced, not appended"
        );
        assert_eq!(s.header("x-forwarded-proto"), "http");
        assert_eq!(s.header("x-forwarded-host"), "shop.test");
        assert_eq!(s.header("host"), "shop.test", "Host is preserved");
        assert_eq!(s.uri.path(), "/limited/x");
    }
    // The peer's own bucket is spent; another peer (127.0.0.1) still has its own.
    assert_eq!(Http::new().get(&url).await.code(), 200);
}

#[tokio::test]
async fn behind_a_trusted_proxy_the_right_most_untrusted_address_is_the_client() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[127.0.0.1/32]");
    let edge = Http::new(); // 127.0.0.1: a trusted proxy
    let url = proxy.url("/limited/x");
    let status = |xff: &'static [&'static str]| {
        let (edge, url) = (edge.clone(), url.clone());
        async move {
            let headers: Vec<(&str, &str)> = xff.iter().map(|v| ("x-forwarded-for", *v)).collect();
            edge.get_with(&url, &headers).await.code()
        }
    };
    assert_eq!(status(&["198.51.100.1"]).await, 200);
    assert_eq!(status(&["198.51.100.1"]).await, 200);
    assert_eq!(status(&["198.51.100.1"]).await, 429);
    // Another client behind the same proxy has its own bucket.
    assert_eq!(status(&["198.51.100.2"]).await, 200);
    // The client writes the left-most entries: they never change the bucket.
    assert_eq!(status(&["6.6.6.6, 198.51.100.1"]).await, 429);
    // Trusted hops on the right are skipped.
    assert_eq!(status(&["198.51.100.1, 127.0.0.1"]).await, 429);
    assert_eq!(status(&["6.6.6.6, 198.51.100.2"]).await, 200);
    // Several header lines are one list.
    assert_eq!(status(&["6.6.6.6", "198.51.100.2"]).await, 429);
    // No header: the trusted peer itself is the client.
    assert_eq!(status(&[]).await, 200);

    let seen = up.seen();
    assert_eq!(seen.len(), 5);
    assert_eq!(seen[0].header("x-forwarded-for"), "198.51.100.1, 127.0.0.1");
    assert_eq!(
        seen[3].header("x-forwarded-for"),
        "6.6.6.6, 198.51.100.2, 127.0.0.1"
    );
    assert_eq!(seen[4].header("x-forwarded-for"), "127.0.0.1");

    // A trusted proxy's X-Forwarded-Proto and -Host are kept; Host is passed on unchanged.
    let headers = [
        ("host", "internal.test"),
        ("x-forwarded-proto", "https"),
        ("x-forwarded-host", "public.test"),
    ];
    assert_eq!(
        edge.get_with(&proxy.url("/app/x"), &headers).await.code(),
        200
    );
    let s = up.last();
    assert_eq!(s.header("x-forwarded-proto"), "https");
    assert_eq!(s.header("x-forwarded-host"), "public.test");
    assert_eq!(s.header("host"), "internal.test");
}

#[tokio::test]
async fn hop_by_hop_request_headers_do_not_reach_the_upstream() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[]");
    let mut conn = Raw::open(proxy.addr()).await;
    let res = conn
        .roundtrip(&[
            "GET /app/hop-request?a=1&b=%20x HTTP/1.1",
            "Host: shop.test",
            "Connection: close, X-Custom",
            "X-Custom: secret",
            "Keep-Alive: timeout=5",
            "TE: trailers",
            "Upgrade: websocket",
            "Proxy-Authorization: Basic dTpw",
            "Proxy-Connection: keep-alive",
            "X-Kept: yes",
        ])
        .await;
    assert_eq!(res.status, 200, "{res:?}");
    let s = up.last();
    for h in [
        "connection",
        "x-custom",
        "keep-alive",
        "te",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
    ] {
        assert!(
            !s.headers.contains_key(h),
            "`{h}` reached the upstream: {:?}",
            s.headers
        );
    }
    assert_eq!(s.header("x-kept"), "yes");
    assert_eq!(
        s.uri.to_string(),
        "/app/hop-request?a=1&b=%20x",
        "path and query as sent"
    );
    assert_eq!(s.header("host"), "shop.test");
    // `Connection: close` was honoured on the client's hop.
    assert!(conn.is_closed().await);
}

#[tokio::test]
async fn hop_by_hop_response_headers_do_not_reach_the_client() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[]");
    let mut conn = Raw::open(proxy.addr()).await;
    for _ in 0..2 {
        let res = conn
            .roundtrip(&["GET /app/hop HTTP/1.1", "Host: shop.test"])
            .await;
        assert_eq!(res.status, 200);
        for h in [
            "connection",
            "x-up-secret",
            "keep-alive",
            "proxy-authenticate",
            "upgrade",
            "trailer",
        ] {
            assert!(res.header(h).is_none(), "`{h}` reached the client: {res:?}");
        }
        assert_eq!(res.header("x-up-kept"), Some("yes"));
        assert_eq!(res.body, b"hop\n");
    }
}

const FIFTY_MB: u64 = 50 * 1024 * 1024;

/// The proxy must stream: what its peak memory grows by during the transfer stays under half
/// the size of the body (a streamed download grows it by 12-14 MiB, an upload by 6 MiB). It is
/// measured as growth over the peak before the transfer, not as an absolute peak: the process's
/// own footprint (a debug build's, the allocator's) moves between machines and builds, and a
/// 40 MiB bound on the whole peak left only 2 MiB of room.
fn assert_streamed(proxy: &BinaryProxy, before_kib: u64, what: &str) {
    let peak = proxy.peak_rss_kib();
    let grown = peak.saturating_sub(before_kib);
    eprintln!(
        "{what}: proxy peak RSS {} MiB, {} MiB over the {} MiB before",
        peak / 1024,
        grown / 1024,
        before_kib / 1024
    );
    assert!(
        grown < 25 * 1024,
        "the proxy's peak RSS grew by {} MiB during a 50 MiB {what}: it buffers the body",
        grown / 1024
    );
}

#[tokio::test]
async fn a_50_mb_upload_is_streamed_through() {
    let up = MockUpstream::start();
    let proxy = BinaryProxy::start(&proxy_config(&up, "[]"));
    let before = proxy.peak_rss_kib();
    let started = Instant::now();
    let r = Http::new()
        .send(upload(&proxy.url("/app/upload"), FIFTY_MB))
        .await;
    let took = started.elapsed();
    assert_eq!(r.code(), 200);
    assert_eq!(r.text(), FIFTY_MB.to_string(), "bytes the upstream counted");
    assert_eq!(up.last().body_len, FIFTY_MB);
    eprintln!(
        "upload: 50 MiB in {:.2} s ({:.0} MiB/s)",
        took.as_secs_f64(),
        50.0 / took.as_secs_f64()
    );
    assert_streamed(&proxy, before, "upload");
}

#[tokio::test]
async fn a_50_mb_download_is_streamed_through() {
    let up = MockUpstream::start();
    let proxy = BinaryProxy::start(&proxy_config(&up, "[]"));
    let before = proxy.peak_rss_kib();
    let started = Instant::now();
    let url = proxy.url(&format!("/app/download/{FIFTY_MB}"));
    let mut res = Http::new().stream(request("GET", &url, &[])).await;
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.headers()["content-length"],
        FIFTY_MB.to_string().as_str()
    );
    let received = drain(res.body_mut()).await;
    let took = started.elapsed();
    assert_eq!(received, FIFTY_MB);
    eprintln!(
        "download: 50 MiB in {:.2} s ({:.0} MiB/s)",
        took.as_secs_f64(),
        50.0 / took.as_secs_f64()
    );
    assert_streamed(&proxy, before, "download");
}

#[tokio::test]
async fn no_matching_route_is_404() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[]");
    let http = Http::new();
    for _ in 0..2 {
        let r = http.get(&proxy.url("/nowhere")).await;
        assert_eq!(r.code(), 404);
        assert!(r.opt_header("ratelimit").is_none());
        assert_eq!(http.get(&proxy.url("/app/x")).await.code(), 200);
    }
    assert_eq!(up.count(), 2);
}

#[tokio::test]
async fn a_refused_upstream_is_502_and_the_proxy_keeps_serving() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[]");
    let http = Http::new();
    for _ in 0..3 {
        assert_eq!(http.get(&proxy.url("/dead/x")).await.code(), 502);
        assert_eq!(http.get(&proxy.url("/app/x")).await.code(), 200);
    }
}

/// A request the mock upstream answers after 5 s: 504 at the route's 500 ms timeout, no sooner.
async fn slow_request_is_504_at_the_timeout(http: &Http, proxy: &TestProxy) {
    let started = Instant::now();
    let r = http.get(&proxy.url("/app/slow/5000")).await;
    let took = started.elapsed();
    assert_eq!(r.code(), 504);
    assert!(
        took >= Duration::from_millis(480) && took < Duration::from_millis(2500),
        "504 after {took:?}, the timeout is 500 ms"
    );
}

#[tokio::test]
async fn a_slow_upstream_is_504_after_its_timeout() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[]");
    let http = Http::new();
    slow_request_is_504_at_the_timeout(&http, &proxy).await;
    assert_eq!(
        up.last().uri.path(),
        "/app/slow/5000",
        "the request did reach the upstream"
    );
    let r = http.get(&proxy.url("/app/x")).await;
    assert_eq!(r.code(), 200);
}

/// The upstream connection's task keeps the response-head deadline, and its timer is set for
/// the first request it saw: a slow request sent later on the same connection must still get
/// its whole timeout, counted from when it was sent, not from the earlier request.
#[tokio::test]
async fn a_slow_request_after_fast_ones_gets_its_whole_timeout() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[]");
    let http = Http::new();
    // Fast requests on one keep-alive connection: one upstream connection, its timer set.
    for _ in 0..3 {
        assert_eq!(http.get(&proxy.url("/app/x")).await.code(), 200);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    slow_request_is_504_at_the_timeout(&http, &proxy).await;
    // And the next request gets a fresh connection.
    assert_eq!(http.get(&proxy.url("/app/x")).await.code(), 200);
}

#[tokio::test]
async fn h2c_requests_are_forwarded_and_limited_like_http1() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[]");
    let h2 = Http::h2c();
    let url = proxy.url("/limited/h2");
    for left in ["1", "0"] {
        let r = h2.get(&url).await;
        assert_eq!(r.version, Version::HTTP_2);
        assert_eq!(r.code(), 200);
        assert_eq!(r.header("x-upstream"), "mock");
        assert_eq!(r.header("x-ratelimit-remaining"), left);
    }
    let r = h2.get(&url).await;
    assert_eq!((r.version, r.code()), (Version::HTTP_2, 429));
    assert_eq!(r.header("retry-after"), "60");
    assert_eq!(r.header("ratelimit"), r#""per-ip";r=0;t=120"#);
    // Same client address over HTTP/1.1: the same bucket.
    assert_eq!(Http::new().get(&url).await.code(), 429);

    // The upstream gets HTTP/1.1 with `:authority` as Host.
    let seen = up.seen();
    assert_eq!(seen.len(), 2);
    let authority = proxy.addr().to_string();
    for s in &seen {
        assert_eq!(s.version, Version::HTTP_11);
        assert_eq!(s.header("host"), authority);
        assert_eq!(s.header("x-forwarded-host"), authority);
        assert_eq!(s.header("x-forwarded-proto"), "http");
    }
}

#[tokio::test]
async fn keep_alive_connections_are_reused_on_both_sides() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[]");
    let mut conn = Raw::open(proxy.addr()).await;
    for i in 0..5 {
        let res = conn
            .roundtrip(&[&format!("GET /app/ka/{i} HTTP/1.1"), "Host: shop.test"])
            .await;
        assert_eq!(res.status, 200);
        assert_eq!(res.body, b"ok\n");
        assert!(res.header("connection").is_none());
    }
    let seen = up.seen();
    assert_eq!(seen.len(), 5);
    let upstream_conns: HashSet<_> = seen.iter().map(|s| s.peer).collect();
    eprintln!(
        "keep-alive: 5 requests on one client connection, {} upstream connection(s)",
        upstream_conns.len()
    );
    // The pool hands an idle connection back as soon as the previous response ended; allow one
    // extra in case the next request overtakes that.
    assert!(
        upstream_conns.len() <= 2,
        "5 sequential requests used {} upstream connections: the pool is not reused",
        upstream_conns.len()
    );
}

/// A proxy with one worker (so the whole `max_idle` is one pool's) forwarding to `up` with
/// `keepalive: { max_idle: N }` (`None`: the default).
fn proxy_keeping(up: &MockUpstream, max_idle: Option<usize>) -> TestProxy {
    let max_idle = max_idle.map_or(String::new(), |n| format!("max_idle: {n}, "));
    let yaml = config(&format!(
        "{}    keepalive: {{ {max_idle}idle_timeout: 1m }}
routes:
  - name: app
    match: {{ path_prefix: / }}
    upstream: app
",
        upstream_app(up.addr(), "5s")
    ));
    TestProxy::start_with_workers(&yaml, 1)
}

/// `n` requests to `url` at once, each on a client connection of its own.
async fn all_at_once(n: usize, url: &str) {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let url = url.to_owned();
            tokio::spawn(async move { Http::new().get(&url).await.code() })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.expect("request task"), 200);
    }
}

#[tokio::test]
async fn the_pool_keeps_at_most_max_idle_connections_per_target() {
    for (max_idle, kept) in [(Some(3), 3), (None, 12)] {
        let up = MockUpstream::start();
        let proxy = proxy_keeping(&up, max_idle);
        // Twelve slow requests at once need twelve upstream connections ...
        all_at_once(12, &proxy.url("/slow/300")).await;
        let first: HashSet<_> = up.seen().iter().map(|s| s.peer).collect();
        assert_eq!(first.len(), 12);
        // ... and of those, the pool kept `max_idle` for the next burst.
        all_at_once(12, &proxy.url("/slow/300")).await;
        let second: HashSet<_> = up.seen()[12..].iter().map(|s| s.peer).collect();
        let reused = second.intersection(&first).count();
        eprintln!("max_idle {max_idle:?}: {reused} of 12 upstream connections reused");
        assert_eq!(reused, kept, "max_idle {max_idle:?}");
    }
}

#[tokio::test]
async fn max_idle_0_opens_a_connection_per_request() {
    let up = MockUpstream::start();
    let proxy = proxy_keeping(&up, Some(0));
    let mut conn = Raw::open(proxy.addr()).await;
    for i in 0..4 {
        let res = conn
            .roundtrip(&[&format!("GET /ka/{i} HTTP/1.1"), "Host: shop.test"])
            .await;
        assert_eq!(res.status, 200);
    }
    let peers: HashSet<_> = up.seen().iter().map(|s| s.peer).collect();
    assert_eq!(peers.len(), 4, "every request on a connection of its own");
}

#[tokio::test]
async fn upstream_requests_are_origin_form_and_a_closed_connection_is_not_reused() {
    let up = MockUpstream::start();
    let proxy = proxy(&up, "[]");
    let http = Http::new();
    // The upstream ends the connection after each /close: the next request must get a new one.
    for path in ["/app/close", "/app/a", "/app/close", "/app/b", "/app/c"] {
        let r = http.get(&proxy.url(path)).await;
        assert_eq!(r.code(), 200, "{path}");
    }
    let seen = up.seen();
    assert_eq!(seen.len(), 5);
    for s in &seen {
        assert!(
            s.uri.authority().is_none(),
            "absolute-form upstream: {}",
            s.uri
        );
    }
    assert_ne!(
        seen[0].peer, seen[1].peer,
        "reused a connection the upstream closed"
    );
    assert_ne!(
        seen[2].peer, seen[3].peer,
        "reused a connection the upstream closed"
    );
}

/// A raw upstream that answers `200 ok` (3 bytes) as soon as a request head has arrived,
/// without reading any body. With `keep_alive`, it answers every head on a connection (bytes in
/// between, such as an unread body, are skipped); without, it closes each connection after its
/// first answer, without saying so. Returns its address and the count of heads answered.
async fn raw_upstream(
    keep_alive: bool,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = answered.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                loop {
                    let mut head = Vec::new();
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n";
                    if sock.write_all(answer).await.is_err() || !keep_alive {
                        return;
                    }
                }
            });
        }
    });
    (addr, answered)
}

/// An upstream that answers one request per connection and then closes it, without saying so
/// (no `Connection: close`): the pooled connection dies right after its response.
#[tokio::test]
async fn an_upstream_that_silently_closes_each_connection_costs_no_502() {
    let (addr, served) = raw_upstream(false).await;
    let proxy = TestProxy::start(&config(&format!(
        "{}routes:\n  - name: app\n    match: {{ path_prefix: / }}\n    upstream: app\n",
        upstream_app(addr, "2s")
    )));
    let http = Http::new();
    for i in 0..20 {
        let r = http.get(&proxy.url(&format!("/r/{i}"))).await;
        assert_eq!(r.code(), 200, "request {i}");
        if i % 2 == 0 {
            // Give the close time to arrive for half of them; the others race it.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), 20);
}

/// An upstream that answers before it has read the request body (as an early `413` or `401`
/// would): the connection still carries the rest of an upload, so it must not be handed to the
/// next request, which would wait behind that upload. One worker, so both requests share a
/// pool.
#[tokio::test]
async fn a_connection_still_uploading_is_not_reused() {
    let (addr, _) = raw_upstream(true).await;
    let proxy = TestProxy::start_with_workers(
        &config(&format!(
            "{}routes:\n  - name: app\n    match: {{ path_prefix: / }}\n    upstream: app\n    \
             buffering: {{ request: false }}\n",
            upstream_app(addr, "2s")
        )),
        1,
    );
    // An upload that stalls after 10 of its 1000 bytes.
    let mut uploader = Raw::open(proxy.addr()).await;
    uploader
        .send(b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n0123456789")
        .await;
    let res = uploader.response().await;
    assert_eq!(res.status, 200);
    // The next request must get a connection of its own, not wait behind the upload.
    let started = Instant::now();
    let r = Http::new().get(&proxy.url("/next")).await;
    assert_eq!(r.code(), 200);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the next request waited {:?} behind a stalled upload",
        started.elapsed()
    );
}

/// `X_Forwarded_For` and friends would reach a CGI-style backend as `HTTP_X_FORWARDED_FOR`:
/// headers with `_` in their names are dropped by default, and passed with
/// `underscores_in_headers: true`.
#[tokio::test]
async fn headers_with_underscores_are_dropped_unless_allowed() {
    let up = MockUpstream::start();
    let route = "routes:\n  - name: app\n    match: { path_prefix: / }\n    upstream: app\n";
    let sent = [
        ("x_forwarded_for", "203.0.113.9"),
        ("x_real_ip", "203.0.113.9"),
        ("legacy_token", "t"),
        ("x-kept", "yes"),
    ];
    for (allow, extra) in [(false, ""), (true, "underscores_in_headers: true\n")] {
        let proxy = TestProxy::start(&config(&format!(
            "{extra}{}{route}",
            upstream_app(up.addr(), "2s")
        )));
        let r = Http::new().get_with(&proxy.url("/u"), &sent).await;
        assert_eq!(r.code(), 200);
        let seen = up.seen().pop().expect("a request upstream");
        assert_eq!(seen.header("x-kept"), "yes");
        for (name, _) in &sent[..3] {
            assert_eq!(
                seen.headers.contains_key(*name),
                allow,
                "{name} with underscores_in_headers: {allow}"
            );
        }
        assert_eq!(seen.header("x-forwarded-for"), "127.0.0.1");
    }
}
