//! What the fuzzers found, kept as tests, and a replay of the committed seed corpus through the
//! very same harness functions the cargo-fuzz targets call (`fuzz/src/lib.rs`, included below),
//! so the harnesses compile and behave on stable `cargo test` without nightly or cargo-fuzz.
//!
//! A crash found by `scripts/fuzz.sh` becomes a test here: the minimised input as a byte
//! literal, run through the target's harness function. Until the bug is fixed the test is
//! `#[ignore = "bug: ..."]`; the fix removes the `ignore`. See docs/fuzzing.md.

#[allow(dead_code)]
#[path = "../../fuzz/src/lib.rs"]
mod harness;

use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// Every seed of one target's committed corpus, by file name, in name order.
fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no seeds in {}", dir.display());
    paths
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The seed corpus through the harnesses

#[test]
fn config_seeds_are_all_exercised_and_judged_as_expected() {
    for (name, data) in seeds("config") {
        let compiled = harness::config(&data);
        let want = !name.starts_with("invalid_");
        assert_eq!(compiled, Some(want), "config seed {name}");
    }
}

#[test]
fn the_special_file_guard_skips_only_what_it_must() {
    let dev = "listeners:\n  - address: 127.0.0.1:1\n    tls: { cert: /dev/zero, key: k }\n";
    assert!(harness::names_special_file(dev));
    let escaped =
        "listeners:\n  - address: 127.0.0.1:1\n    tls: { cert: \"/d\\x65v/zero\", key: k }\n";
    assert!(harness::names_special_file(escaped));
    // Without a `tls` key nothing is read, so development notes in comments are fine.
    assert!(!harness::names_special_file(
        "# a development config\nroutes: []\n"
    ));
}

#[test]
fn value_seeds() {
    for (name, data) in seeds("values") {
        let [duration, size, rate] = harness::values(&data);
        let text = String::from_utf8(data).unwrap();
        let want = match name.as_str() {
            "1000001_s" | "1_0s" | "10_fortnight" | "18446744073709551615GiB" | "1e-300_s" => {
                [false; 3]
            }
            "250ms" | "1.5s" | "1d" => [true, false, false],
            "64KiB" | "10MiB" | "2MB" => [false, true, false],
            _ => [false, false, true],
        };
        assert_eq!([duration, size, rate], want, "values seed {name}: {text:?}");
    }
}

#[test]
fn forwarded_for_seeds() {
    for (name, data) in seeds("forwarded_for") {
        // [X-Forwarded-For answer, Forwarded answer]
        let want = match name.as_str() {
            "all_trusted" => ["10.9.9.9", "10.0.0.1"],
            "chain_two_lines" => ["198.51.100.7", "10.0.0.1"],
            "garbage_stops" => ["10.2.2.2", "10.0.0.1"],
            "empty_line" => ["10.0.0.1", "10.0.0.1"],
            "forwarded_chain" => ["6.6.6.6", "2001:db8::1"],
            "forwarded_header" => ["198.51.100.1", "192.0.2.60"],
            "forwarded_obfuscated" => ["10.0.0.1", "10.0.0.7"],
            "ipv6_chain" => ["2001:db8::5", "::1"],
            "mapped_peer_ports" => ["192.0.2.1", "10.0.0.1"],
            "untrusted_peer" => ["203.0.113.9", "203.0.113.9"],
            other => panic!("forwarded_for seed {other} has no expectation here"),
        };
        let want = want.map(|ip| ip.parse::<IpAddr>().unwrap());
        assert_eq!(
            harness::forwarded_for(&data),
            Some(want),
            "forwarded_for seed {name}"
        );
    }
}

#[test]
fn identity_seeds_give_distinct_identities() {
    let mut ids = Vec::new();
    for (name, data) in seeds("identity") {
        let id = harness::identity(&data);
        assert!(
            !ids.contains(&id),
            "identity seed {name} repeats an identity"
        );
        ids.push(id);
    }
}

#[test]
fn request_head_seeds_get_the_documented_answers() {
    for (name, data) in seeds("request_head") {
        let ex = harness::request_head(&data);
        assert!(!ex.timed_out, "request_head seed {name} timed out: {ex:?}");
        let want: &[u16] = match name.as_str() {
            "absolute_form" => &[201, 400],
            "api_exempt_head" => &[201, 201],
            "api_key_host" | "expect_continue" => &[201],
            // Content-Length with chunked is read as chunked, then the connection closes; the
            // client-written X-Forwarded-For entries left of the trusted one are not believed.
            "cl_and_te" | "xff_spoof" => &[200],
            "chunked_upstream" | "post_upstream_refused" => &[502],
            "connect" => &[405],
            // A broken chunk is the client's fault, found while the body is buffered.
            "bad_chunk_size" | "dup_content_length" | "garbage_line" | "no_host_dup_host"
            | "obs_fold" => &[400],
            "h2_prior_knowledge" => &[],
            "http10_keepalive" => &[204, 404],
            "path_variants" => &[200, 200, 400],
            "pipelined_limited" => &[200, 200, 429],
            "te_gzip" => &[501],
            "tenant_twice" => &[204, 429],
            "unicode_path" => &[404],
            "upgrade_h2c_ws" => &[201, 502],
            other => panic!("request_head seed {other} has no expectation here"),
        };
        assert_eq!(ex.statuses, want, "request_head seed {name}");
        if name == "h2_prior_knowledge" {
            assert!(ex.http2 && !ex.raw.is_empty(), "no HTTP/2 answer: {ex:?}");
        }
    }
}

#[test]
fn canonical_seeds_get_the_documented_spellings() {
    let path = |routed: &str, forward: &str| Some((routed.to_owned(), forward.to_owned()));
    for (name, data) in seeds("canonical") {
        let got = harness::canonical(&data);
        let (host, want_path) = match name.as_str() {
            "host_trailing_dot" => (Some("known.example:80"), path("/a/b/c", "/a/b;x=1/c")),
            "host_comma_list" => (None, path("/", "/")),
            "host_userinfo" | "host_space" => (None, path("/x", "/x")),
            "host_ipv6" => (Some("[::1]:8080"), path("/x/", "/x/")),
            "host_port_range" => (None, path("/admin", "/admin")),
            "path_tomcat" | "path_backslash" | "path_overlong" | "path_double_encoded" => {
                (Some("h"), None)
            }
            "path_parameters" => (Some("h"), path("/api/login", "/api;x=y/login;jsessionid=1")),
            "path_utf8" => (Some("h"), path("/caf%C3%A9/", "/caf%C3%A9/")),
            "path_trailing_slash" => (Some("h"), path("/admin/", "/admin/")),
            other => panic!("canonical seed {other} has no expectation here"),
        };
        let want = harness::Canonical {
            host: host.map(str::to_owned),
            path: want_path,
        };
        assert_eq!(got, want, "canonical seed {name}");
    }
}

/// The response checker itself: it must refuse what a broken server could write.
#[test]
#[should_panic(expected = "invalid status line")]
fn the_response_checker_refuses_a_bad_status_line() {
    let _ = harness::check_http1_responses(b"HTTP/1.1 99 Odd\r\n\r\n", false);
}

#[test]
#[should_panic(expected = "cut short")]
fn the_response_checker_refuses_a_truncated_body() {
    let _ =
        harness::check_http1_responses(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", false);
}

#[test]
fn the_response_checker_reads_chunked_head_and_interim_responses() {
    let raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
                3\r\nabc\r\n0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n\
                HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\nno";
    assert_eq!(
        harness::check_http1_responses(raw, false),
        [100, 200, 200, 429]
    );
}

// ---------------------------------------------------------------------------------------------
// Regressions: one test per bug the fuzzers (or their harness invariants) found

/// forwarded_for, found in seconds (crash-50e6fa10): `identity::client_ip_from` reads the
/// chain with `HeaderValue::to_str` and silently drops every line that is not visible ASCII,
/// instead of stopping the walk there. One obs-text byte (0x80-0xFF, which hyper accepts in a
/// header value) from the client hides the whole line, including the address the trusted proxy
/// appended to it, and the walk goes on into older, client-written lines.
#[test]
fn an_obs_text_byte_in_a_forwarding_line_stops_the_walk() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    // The fuzzer's input, minimised (cargo fuzz tmin): peer ::2, trusted ::/1, the lines `::`
    // and 0xD9. The 0xD9 line should stop the walk at the peer; it is skipped and `::` wins.
    assert_eq!(
        harness::forwarded_for(b"::2\n::/1\n::\n\xd9"),
        Some([ip("::2"), ip("::2")])
    );
    // A proxy (10.0.0.1) that joins the client's lines and appends the address it saw (as
    // nginx's $proxy_add_x_forwarded_for does): one line. Today the answer is the proxy
    // itself, so the client lands in the proxy's bucket and any exemption of its network.
    assert_eq!(
        harness::forwarded_for(b"10.0.0.1\n10.0.0.0/8\n\x80, 203.0.113.7"),
        Some([ip("203.0.113.7"), ip("10.0.0.1")])
    );
    // The client sends two lines and the proxy appends to the last: today that line is
    // skipped and the client's first line is believed, so the client picks its identity.
    assert_eq!(
        harness::forwarded_for(b"10.0.0.1\n10.0.0.0/8\n198.51.100.66\n\x80, 203.0.113.7"),
        Some([ip("203.0.113.7"), ip("10.0.0.1")])
    );
    // The same through `Forwarded`.
    assert_eq!(
        harness::forwarded_for(
            b"10.0.0.1\n10.0.0.0/8\nforwarded:for=198.51.100.66\nforwarded:for=\x80, for=203.0.113.7"
        ),
        Some([ip("10.0.0.1"), ip("203.0.113.7")])
    );
}

/// The same bug end to end: every request names a fresh address in a first X-Forwarded-For
/// line and hides the proxy's line behind one 0x80 byte, and so gets a fresh bucket of the
/// per-IP limit (burst 2) on `/limited`.
#[test]
fn hidden_forwarding_lines_do_not_mint_fresh_buckets() {
    let mut data = Vec::new();
    for n in 1..=3 {
        data.extend_from_slice(
            format!("GET /limited HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 198.51.100.{n}\r\n")
                .as_bytes(),
        );
        data.extend_from_slice(b"X-Forwarded-For: \x80, 203.0.113.7\r\n\r\n");
    }
    assert_eq!(harness::request_head(&data).statuses, [200, 200, 429]);
}

/// identity (normalize_path invariant), found in seconds (crash-debbfa25): `guard::
/// normalize_path` copies each byte of the path as `bytes[i] as char`, so every non-ASCII
/// UTF-8 character (which `http::Uri` and hyper accept in a path) is re-encoded as Latin-1
/// mojibake: `/café/./menu` becomes `/cafÃ©/menu`, and normalising that again changes it again.
#[test]
fn normalising_keeps_non_ascii_paths_intact() {
    assert_eq!(
        tollgate::screen::normalize_path("/caf\u{e9}/./menu")
            .ok()
            .as_deref(),
        Some("/caf\u{e9}/menu")
    );
    // The fuzzer's input, minimised: the path `/ѝ` (U+045D) becomes `/Ñ\u{9d}`.
    harness::identity(b"\n\n\n/\xd1\x9d");
    harness::identity(b"ip\n\nGET\n/caf\xc3\xa9/./menu\n");
}

/// The same bug end to end: the backend receives a different path than the client sent.
#[test]
fn the_backend_receives_the_clients_non_ascii_path() {
    let backend = OneShotBackend::start();
    let config = format!(
        "listeners: [{{address: 127.0.0.1:0}}]\nupstreams: {{app: {{targets: [{}]}}}}\n\
         routes: [{{name: all, upstream: app}}]\n",
        backend.addr
    );
    let ex = harness::serve_bytes(
        &config,
        b"GET /caf\xc3\xa9/./menu HTTP/1.1\r\nHost: a\r\n\r\n",
    );
    assert_eq!(ex.statuses, [200]);
    assert_eq!(
        String::from_utf8_lossy(&backend.request_line()),
        "GET /caf\u{e9}/menu HTTP/1.1"
    );
}

/// values, from the invariant "an accepted rate can be counted": `values::rate` accepts any
/// positive count, so `1e-320/s` (or `1e-300/100000000000000d`) passes, `Rate::token_us()` is
/// `1e6 / per_sec` = infinity, and `limiter::step` then admits every request: the limit is off.
#[test]
fn a_vanishing_rate_is_refused_not_unlimited() {
    harness::values(b"1e-320/s");
    let config = "listeners: [{address: 127.0.0.1:0}]\nroutes:\n  - name: r\n    respond: {}\n    \
                  limits: [{name: l, rate: 1e-320/s, burst: 1, key: [global]}]\n";
    let three = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n".repeat(3);
    match tollgate::config::parse(config) {
        Err(problems) => assert!(!problems.is_empty()),
        Ok(_) => assert_eq!(
            harness::serve_bytes(config, &three).statuses,
            [200, 429, 429]
        ),
    }
}

/// config, from the listener invariant (every compiled listener serves an HTTP/2 connection):
/// `http2.connection_window` above 2^31-1 bytes compiled (clamped to u32::MAX), then h2's
/// `set_target_window_size` asserted `size <= MAX_WINDOW_SIZE` in every HTTP/2 connection task;
/// `stream_window` above 2^31-1 was sent as SETTINGS_INITIAL_WINDOW_SIZE, a value clients must
/// treat as a connection error. Found on 413c528; fixed since (`Sizes::window` bounds both).
#[test]
fn http2_windows_beyond_the_protocol_limit_are_refused() {
    for window in ["connection_window: 2048MiB", "stream_window: 3GiB"] {
        let config = format!(
            "listeners:\n  - address: 127.0.0.1:0\n    http2: {{ {window} }}\n\
             routes: [{{name: a, respond: {{}}}}]\n"
        );
        assert_eq!(harness::config(config.as_bytes()), Some(false), "{window}");
    }
}

/// An upstream that answers one request with an empty 200 and keeps its request line.
struct OneShotBackend {
    addr: std::net::SocketAddr,
    seen: std::thread::JoinHandle<Vec<u8>>,
}

impl OneShotBackend {
    fn start() -> Self {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap() == 1 {
                head.push(byte[0]);
            }
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                .unwrap();
            head.split(|&b| b == b'\r')
                .next()
                .unwrap_or_default()
                .to_vec()
        });
        Self { addr, seen }
    }

    fn request_line(self) -> Vec<u8> {
        self.seen.join().unwrap()
    }
}
