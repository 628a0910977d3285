//! Proxy-owned headers and client-supplied identity at the edge: a `Connection`
//! line never takes away Host, the framing or the forwarding headers tollgate sets, and the
//! client-IP and URL-override headers of untrusted peers (`strip_untrusted_headers`) never
//! reach the backend. A raw backend records the exact head that reached it.

use crate::shared as edge;

use std::fmt::Write as _;

use common::TestProxy;
use edge::{ok_answer, yaml, Raw, RawBackend, BUFFERED_AND_STREAMED, CATCH_ALL};

use crate::common;

/// The header lines of a request head, names lower-cased, in order.
fn lines(head: &str) -> Vec<(String, String)> {
    head.split("\r\n")
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect()
}

fn values<'a>(lines: &'a [(String, String)], name: &str) -> Vec<&'a str> {
    lines
        .iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .collect()
}

#[tokio::test]
async fn connection_cannot_name_away_host_framing_or_forwarding_headers() {
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(backend.addr, "", BUFFERED_AND_STREAMED));
    for path in ["/buffered", "/streamed"] {
        let mut c = Raw::open(proxy.addr()).await;
        c.send(
            format!(
                "POST {path} HTTP/1.1\r\nHost: known.example\r\nConnection: keep-alive, host, \
                 content-length, x-forwarded-for, x-real-ip, x-forwarded-proto, \
                 x-forwarded-host, forwarded, x-secret\r\nX-Secret: 1\r\nX-Kept: 1\r\n\
                 Content-Length: 5\r\n\r\nhello"
            )
            .as_bytes(),
        )
        .await;
        let r = c.response().await;
        assert_eq!(r.status, 200, "{path}: {r:?}");
        let request = backend.requests().pop().unwrap();
        let head = backend.last_head();
        let got = lines(&head);
        assert_eq!(values(&got, "host"), ["known.example"], "{path}: {head:?}");
        assert_eq!(values(&got, "content-length"), ["5"], "{path}: {head:?}");
        assert!(
            request.ends_with(b"\r\n\r\nhello"),
            "{path}: the body framed"
        );
        assert_eq!(values(&got, "x-forwarded-for"), ["127.0.0.1"], "{path}");
        assert_eq!(values(&got, "x-real-ip"), ["127.0.0.1"], "{path}");
        assert_eq!(values(&got, "x-forwarded-proto"), ["http"], "{path}");
        assert_eq!(
            values(&got, "x-forwarded-host"),
            ["known.example"],
            "{path}"
        );
        // What a Connection line may name is still removed, and Connection itself.
        assert!(values(&got, "x-secret").is_empty(), "{path}: {head:?}");
        assert!(values(&got, "connection").is_empty(), "{path}: {head:?}");
        assert_eq!(values(&got, "x-kept"), ["1"]);
    }
}

/// Behind a trusted proxy, a client's `Connection: X-Forwarded-For` must not erase the chain
/// the trusted proxy appended to (the backend would see only that proxy's address).
#[tokio::test]
async fn a_trusted_proxys_chain_survives_a_connection_line_naming_it() {
    let backend = RawBackend::start(ok_answer).await;
    let top = "trusted_proxies: [127.0.0.1/32]\n";
    let proxy = TestProxy::start(&yaml(backend.addr, top, CATCH_ALL));
    let mut c = Raw::open(proxy.addr()).await;
    c.send(
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: X-Forwarded-For, X-Forwarded-Proto\r\n\
          X-Forwarded-For: 203.0.113.7\r\nX-Forwarded-Proto: https\r\n\r\n",
    )
    .await;
    assert_eq!(c.response().await.status, 200);
    let got = lines(&backend.last_head());
    assert_eq!(values(&got, "x-forwarded-for"), ["203.0.113.7, 127.0.0.1"]);
    assert_eq!(values(&got, "x-real-ip"), ["203.0.113.7"]);
    assert_eq!(values(&got, "x-forwarded-proto"), ["https"]);
}

/// The default list, and what an untrusted client gets through of it: nothing.
const CLIENT_IP_HEADERS: [&str; 11] = [
    "True-Client-IP",
    "X-Client-IP",
    "CF-Connecting-IP",
    "X-Cluster-Client-IP",
    "Fastly-Client-IP",
    "Client-IP",
    "X-Originating-IP",
    "X-Remote-IP",
    "X-Remote-Addr",
    "X-Original-URL",
    "X-Rewrite-URL",
];

async fn forwarded_head(
    proxy: &TestProxy,
    backend: &RawBackend,
    from: &str,
) -> Vec<(String, String)> {
    let mut req = String::from("GET /public HTTP/1.1\r\nHost: a\r\nX-Kept: 1\r\n");
    for name in CLIENT_IP_HEADERS {
        let value = if name.ends_with("URL") {
            "/admin"
        } else {
            "6.6.6.6"
        };
        let _ = write!(req, "{name}: {value}\r\n");
    }
    req.push_str("X-Custom-IP: 6.6.6.6\r\n\r\n");
    let mut c = Raw::open_from(proxy.addr(), from).await;
    c.send(req.as_bytes()).await;
    assert_eq!(c.response().await.status, 200);
    lines(&backend.last_head())
}

#[tokio::test]
async fn client_ip_and_url_override_headers_of_untrusted_peers_never_reach_the_backend() {
    let backend = RawBackend::start(ok_answer).await;
    // 127.0.0.2 is a trusted proxy; 127.0.0.1 is a client.
    let top = "trusted_proxies: [127.0.0.2/32]\n";
    let proxy = TestProxy::start(&yaml(backend.addr, top, CATCH_ALL));
    let got = forwarded_head(&proxy, &backend, "127.0.0.1").await;
    for name in CLIENT_IP_HEADERS {
        let lower = name.to_ascii_lowercase();
        assert!(
            values(&got, &lower).is_empty(),
            "{name} reached the backend: {got:?}"
        );
    }
    assert_eq!(values(&got, "x-kept"), ["1"]);
    assert_eq!(
        values(&got, "x-custom-ip"),
        ["6.6.6.6"],
        "not on the default list"
    );
    assert_eq!(values(&got, "x-real-ip"), ["127.0.0.1"]);
    // A trusted proxy (a CDN) sets them for real: they go on.
    let got = forwarded_head(&proxy, &backend, "127.0.0.2").await;
    for name in CLIENT_IP_HEADERS {
        let lower = name.to_ascii_lowercase();
        assert_eq!(
            values(&got, &lower).len(),
            1,
            "{name} from a trusted proxy: {got:?}"
        );
    }
}

#[tokio::test]
async fn strip_untrusted_headers_replaces_the_default_list() {
    let backend = RawBackend::start(ok_answer).await;
    let top = "strip_untrusted_headers: [X-Custom-IP, x-original-url]\n";
    let proxy = TestProxy::start(&yaml(backend.addr, top, CATCH_ALL));
    let got = forwarded_head(&proxy, &backend, "127.0.0.1").await;
    assert!(values(&got, "x-custom-ip").is_empty(), "{got:?}");
    assert!(values(&got, "x-original-url").is_empty(), "{got:?}");
    assert_eq!(
        values(&got, "true-client-ip"),
        ["6.6.6.6"],
        "the list replaces the default"
    );
    // An empty list strips nothing more.
    let backend = RawBackend::start(ok_answer).await;
    let proxy = TestProxy::start(&yaml(
        backend.addr,
        "strip_untrusted_headers: []\n",
        CATCH_ALL,
    ));
    let got = forwarded_head(&proxy, &backend, "127.0.0.1").await;
    assert_eq!(values(&got, "x-rewrite-url"), ["/admin"]);
}

#[test]
fn strip_untrusted_headers_is_validated_with_located_errors() {
    let text = "listeners:\n  - address: 127.0.0.1:0\nstrip_untrusted_headers:\n  - x-ok\n  \
                - \"bad name\"\n  - Host\n  - content-length\n  - X-Forwarded-For\n";
    let problems = tollgate::config::parse(text).expect_err("invalid names");
    let found: Vec<(String, String, Option<usize>)> = problems
        .iter()
        .map(|p| {
            (
                p.path.clone(),
                p.message.clone(),
                p.at.map(|(line, _)| line),
            )
        })
        .collect();
    let expect = [
        (
            "strip_untrusted_headers[1]",
            "`bad name` is not a valid header name",
            5,
        ),
        (
            "strip_untrusted_headers[2]",
            "`Host` cannot be listed: tollgate needs it or sets it itself",
            6,
        ),
        (
            "strip_untrusted_headers[3]",
            "`content-length` cannot be listed: tollgate needs it or sets it itself",
            7,
        ),
        (
            "strip_untrusted_headers[4]",
            "`X-Forwarded-For` cannot be listed: tollgate needs it or sets it itself",
            8,
        ),
    ];
    assert_eq!(found.len(), expect.len(), "{found:?}");
    for ((path, message, line), (want_path, want_message, want_line)) in found.iter().zip(expect) {
        assert_eq!(path, want_path);
        assert_eq!(message, want_message);
        assert_eq!(*line, Some(want_line), "{path}");
    }
    let wrong_type = "listeners:\n  - address: 127.0.0.1:0\nstrip_untrusted_headers: yes\n";
    let problems = tollgate::config::parse(wrong_type).expect_err("not a list");
    assert_eq!(problems[0].path, "strip_untrusted_headers");
}
