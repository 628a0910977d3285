//! Host and `:authority` at the edge: malformed values are refused before anything
//! reaches the backend, every spelling of a host meets that host's routes and limits, and the
//! backend receives the canonical spelling. HTTP/1.1 on raw sockets, HTTP/2 as raw frames; a
//! raw backend records the exact bytes that reached it.

use crate::shared as edge;

use common::TestProxy;
use edge::{
    h2_exchange, h2_reset, h2_status, hpack_literal, ok_answer, yaml, Raw, RawBackend, CATCH_ALL,
    HPACK_GET_ROOT, WAIT,
};

use crate::common;

/// `known.example` limited to one request per client address; everything else unlimited.
const KNOWN: &str = "  - name: known
    match: { host: known.example }
    upstream: app
    limits:
      - { name: known, rate: 1/min, burst: 1, key: [ip] }
  - name: all
    upstream: app
";

async fn get(proxy: &TestProxy, from: &str, host: &str) -> edge::Resp {
    let mut c = Raw::open_from(proxy.addr(), from).await;
    c.send(format!("GET /x HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await;
    c.response().await
}

#[tokio::test]
async fn malformed_hosts_are_400_closed_and_never_forwarded() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", CATCH_ALL));
    for host in [
        "a b",
        "a@b",
        "user:pass@known.example",
        "a:notaport",
        "a:99999",
        "a:0",
        "a:",
        "a/b",
        "a\\b",
        "[::1",
        "[::1]x",
        "a,b",
        "known.example, evil.example",
        ".a",
        "a..b",
        "a%2eb",
        "[fe80::1%25eth0]",
    ] {
        let mut c = Raw::open(proxy.addr()).await;
        c.send(format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .await;
        let r = c.response().await;
        assert_eq!(r.status, 400, "Host: {host} -> {r:?}");
        assert!(c.closed_clean(WAIT).await, "Host: {host}: still open");
    }
    // Absolute-form: the authority is held to the same rules, userinfo included.
    for (target, host) in [
        ("http://u@known.example/", "known.example"),
        ("http://known.example:99999/", "known.example:99999"),
    ] {
        let mut c = Raw::open(proxy.addr()).await;
        c.send(format!("GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .await;
        assert_eq!(c.response().await.status, 400, "{target}");
    }
    assert!(
        backend.requests().is_empty(),
        "forwarded: {:?}",
        backend.requests()
    );
}

#[tokio::test]
async fn every_spelling_of_a_host_meets_its_route_and_limit() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", KNOWN));
    let spellings = [
        "known.example",
        "known.example.",
        "KNOWN.Example",
        "Known.Example.:80",
    ];
    for (i, first) in spellings.iter().enumerate() {
        let ip = format!("127.0.0.{}", 20 + i);
        let r = get(&proxy, &ip, first).await;
        assert_eq!(r.status, 200, "{first}: {r:?}");
        for second in spellings {
            let r = get(&proxy, &ip, second).await;
            assert_eq!(
                r.status, 429,
                "{second} after {first}: another bucket? {r:?}"
            );
        }
    }
    // What went upstream: the canonical spelling, as Host and X-Forwarded-Host.
    let heads: Vec<String> = backend
        .requests()
        .iter()
        .map(|r| String::from_utf8_lossy(r).to_ascii_lowercase())
        .collect();
    assert_eq!(heads.len(), spellings.len(), "{heads:?}");
    // In any order: pooled connections are reused in no particular one.
    let mut hosts: Vec<&str> = heads
        .iter()
        .map(|h| {
            let host = h.split("\r\n").find_map(|l| l.strip_prefix("host: "));
            let forwarded = h
                .split("\r\n")
                .find_map(|l| l.strip_prefix("x-forwarded-host: "));
            assert_eq!(host, forwarded, "{h:?}");
            host.unwrap_or_default()
        })
        .collect();
    hosts.sort_unstable();
    assert_eq!(
        hosts,
        [
            "known.example",
            "known.example",
            "known.example",
            "known.example:80"
        ]
    );
    // Exact bytes: the spelling sent is rewritten, not appended to.
    assert!(
        !heads.iter().any(|h| h.contains("known.example.")),
        "{heads:?}"
    );
}

#[tokio::test]
async fn absolute_form_and_host_agree_in_any_spelling_and_go_upstream_canonical() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", KNOWN));
    let mut c = Raw::open(proxy.addr()).await;
    c.send(b"GET http://Known.Example/x?q=1 HTTP/1.1\r\nHost: known.example.\r\n\r\n")
        .await;
    let r = c.response().await;
    assert_eq!(r.status, 200, "{r:?}");
    let head = backend.last_head();
    assert!(
        head.starts_with("GET /x?q=1 HTTP/1.1\r\n"),
        "origin-form upstream: {head:?}"
    );
    assert!(head.contains("\r\nhost: known.example\r\n"), "{head:?}");
    // Another host in the target than in Host is still refused.
    let mut c = Raw::open(proxy.addr()).await;
    c.send(b"GET http://other.example/x HTTP/1.1\r\nHost: known.example\r\n\r\n")
        .await;
    assert_eq!(c.response().await.status, 400);
    assert_eq!(backend.requests().len(), 1);
}

#[tokio::test]
async fn http2_needs_an_authority_or_a_host_and_no_userinfo() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", KNOWN));
    // Neither `:authority` nor Host: 400 (the upstream's own address used to be sent).
    let frames = h2_exchange(proxy.addr(), &HPACK_GET_ROOT).await;
    assert_eq!(h2_status(&frames), Some(400), "{:02x?}", &frames);
    // `:authority` (static index 1) with userinfo, or malformed: 400 (or the stream reset by
    // h2 itself, for what is not an authority at all).
    for authority in [
        "u@known.example",
        "known.example:99999",
        "a,b",
        "a:x",
        "a b",
    ] {
        let mut block = HPACK_GET_ROOT.to_vec();
        block.extend(hpack_literal(1, authority));
        let frames = h2_exchange(proxy.addr(), &block).await;
        let refused = h2_status(&frames) == Some(400) || h2_reset(&frames);
        assert!(refused, ":authority {authority}: {:02x?}", &frames);
    }
    // A Host header (static index 38 is past the 4-bit prefix: a literal name instead).
    let mut block = HPACK_GET_ROOT.to_vec();
    block.extend_from_slice(&[0x00, 4]);
    block.extend_from_slice(b"host");
    block.extend_from_slice(&[u8::try_from("a@b".len()).unwrap()]);
    block.extend_from_slice(b"a@b");
    let frames = h2_exchange(proxy.addr(), &block).await;
    assert_eq!(h2_status(&frames), Some(400), "Host: a@b over HTTP/2");
    assert!(backend.requests().is_empty(), "{:?}", backend.requests());
    // A trailing dot and upper case in `:authority` meet the route and its limit, and the
    // backend gets the canonical Host.
    let mut block = HPACK_GET_ROOT.to_vec();
    block.extend(hpack_literal(1, "KNOWN.example."));
    let frames = h2_exchange(proxy.addr(), &block).await;
    assert_eq!(h2_status(&frames), Some(200), "{:02x?}", &frames);
    let head = backend.last_head();
    assert!(head.contains("\r\nhost: known.example\r\n"), "{head:?}");
    let mut block = HPACK_GET_ROOT.to_vec();
    block.extend(hpack_literal(1, "known.example"));
    let frames = h2_exchange(proxy.addr(), &block).await;
    // 429 is not in HPACK's static table: "some other status".
    assert_eq!(h2_status(&frames), Some(0), "the limit of known.example");
    assert_eq!(backend.requests().len(), 1);
}

#[tokio::test]
async fn http10_without_host_still_goes_through_with_the_targets_host() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", KNOWN));
    let mut c = Raw::open(proxy.addr()).await;
    c.send(b"GET /x HTTP/1.0\r\n\r\n").await;
    assert_eq!(c.response().await.status, 200);
    let head = backend.last_head();
    assert!(
        head.contains(&format!("\r\nhost: {}\r\n", backend.addr)),
        "{head:?}"
    );
}

/// A literal HPACK field with a new name, not indexed.
fn literal(name: &str, value: &str) -> Vec<u8> {
    let mut out = vec![0x00, u8::try_from(name.len()).unwrap()];
    out.extend_from_slice(name.as_bytes());
    out.push(u8::try_from(value.len()).unwrap());
    out.extend_from_slice(value.as_bytes());
    out
}

#[tokio::test]
async fn an_http2_field_value_with_surrounding_whitespace_is_malformed() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", KNOWN));
    let request = |value: &str| {
        let mut block = HPACK_GET_ROOT.to_vec();
        block.extend(hpack_literal(1, "known.example"));
        block.extend(literal("x-api-key", value));
        block
    };
    // RFC 9113 8.2.1: a value may not start or end with whitespace. An identity read from it
    // would be another bucket than the trimmed key the backend sees.
    for value in [" abc", "abc ", "\tabc", "abc\t"] {
        let frames = h2_exchange(proxy.addr(), &request(value)).await;
        let refused = h2_status(&frames) == Some(400) || h2_reset(&frames);
        assert!(refused, "{value:?}: {:02x?}", &frames);
    }
    assert!(backend.requests().is_empty(), "nothing forwarded");
    let frames = h2_exchange(proxy.addr(), &request("a b")).await;
    assert_eq!(h2_status(&frames), Some(200), "inner whitespace is fine");
}
