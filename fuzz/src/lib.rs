//! The fuzz harnesses of tollgate, one function per cargo-fuzz target.
//!
//! Each `fuzz_targets/<name>.rs` is one line calling the function of the same name here, and
//! `tests/edge/fuzz_regressions.rs` includes this file (`#[path]`) to replay the committed seeds and
//! every crash found so far through exactly the same code on stable `cargo test`. So this file
//! may only use crates that are also dependencies of tollgate itself.
//!
//! Besides "does not panic", each harness checks properties the docs promise (see
//! docs/fuzzing.md): a bug shows up as a panic with a message saying which property broke.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use ipnet::IpNet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use tollgate::config::{self, values};
use tollgate::identity::{
    self, Alternative, ClientId, Exemption, ForwardedHeader, KeySpec, RequestView, Source,
};
use tollgate::proxy::{self, ClientConn};
use tollgate::state::State;

// ---------------------------------------------------------------------------------------------
// config: YAML text -> parse + validate + compile
// ---------------------------------------------------------------------------------------------

/// `config::parse` on arbitrary text. A config that compiles must compile again the same way,
/// and each of its listeners' connection settings must serve an HTTP/1.1 and an
/// HTTP/2 connection; a rejected one must say why, with positions inside the text. Returns
/// whether it compiled, `None` when the input was skipped (not UTF-8, or naming a special
/// file).
pub fn config(data: &[u8]) -> Option<bool> {
    let text = std::str::from_utf8(data).ok()?;
    if names_special_file(text) {
        return None;
    }
    Some(match config::parse(text) {
        Ok(settings) => {
            assert_eq!(settings.source, text, "the settings keep their source text");
            if let Err(problems) = config::parse(text) {
                panic!("a config that compiled fails the second time: {problems:?}");
            }
            for listener in &settings.listeners {
                open_connections(&listener.settings);
            }
            true
        }
        Err(problems) => {
            assert!(!problems.is_empty(), "a rejected config has no problem");
            // Upper bound for a 1-based line: YAML counts \n, \r\n and \r as breaks.
            let lines = text.matches(['\n', '\r']).count() + 2;
            for p in &problems {
                assert!(!p.message.is_empty(), "empty message for {p:?}");
                if let Some((line, col)) = p.at {
                    assert!(
                        (1..=lines).contains(&line) && col >= 1,
                        "problem position {line}:{col} outside a {lines}-line text: {p:?}"
                    );
                }
            }
            let shown = config::ConfigError {
                file: "fuzz.yaml".into(),
                problems,
            }
            .to_string();
            assert!(shown.starts_with("fuzz.yaml: "));
            false
        }
    })
}

/// Serve one HTTP/1.1 and one HTTP/2 connection with a listener's settings. Neither carries a
/// request that reaches a route (the HTTP/1.1 one has no Host: 400; the HTTP/2 one only
/// settles its settings and pings), so whatever upstreams the config names are never dialled.
fn open_connections(settings: &tollgate::server::ListenerSettings) {
    const H1: &[u8] = b"GET / HTTP/1.1\r\n\r\n";
    const H2: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\
        \x00\x00\x00\x04\x00\x00\x00\x00\x00\
        \x00\x00\x08\x06\x00\x00\x00\x00\x00ping-me!";
    static STATE: LazyLock<Arc<State>> = LazyLock::new(|| {
        let settings = config::parse(PIPELINE_CONFIG).expect("the pipeline config compiles");
        Arc::new(State::build(settings, 1).expect("the pipeline state builds"))
    });
    let pipeline = Pipeline::with(STATE.clone(), settings);
    let h1 = pipeline.serve(H1);
    assert!(
        h1.timed_out || h1.statuses == [400],
        "a request without Host got {:?} with listener settings {settings:?}",
        h1.statuses
    );
    pipeline.serve(H2);
}

/// TLS certificate, key and CA paths in a config are read at compile time. A path to a device
/// or a kernel file (`/dev/zero`, `/dev/stdin`, `/proc/kcore`) would hang or exhaust memory:
/// that is the operator's file, not attacker input, so such configs are skipped. The check is on
/// decoded strings, so YAML escapes (`"\x2fdev"`) cannot hide a path.
pub fn names_special_file(text: &str) -> bool {
    const SPECIAL: [&str; 4] = ["dev", "proc", "sys", "fd"];
    let special = |s: &str| SPECIAL.iter().any(|w| s.contains(w));
    // Only double-quoted escapes can spell a string the raw text does not contain, and files
    // are only read under a `tls` key.
    let escapes = text.contains('\\');
    if !escapes {
        return text.contains("tls") && special(text);
    }
    match serde_saphyr::from_str::<serde_json::Value>(text) {
        Ok(v) => any_string(&v, &special),
        // Not YAML: `parse` rejects it before reading any file.
        Err(_) => false,
    }
}

/// Whether `f` holds for any string (key or value) in `v`.
fn any_string(v: &serde_json::Value, f: &dyn Fn(&str) -> bool) -> bool {
    use serde_json::Value;
    match v {
        Value::String(s) => f(s),
        Value::Array(items) => items.iter().any(|i| any_string(i, f)),
        Value::Object(m) => m.iter().any(|(k, v)| f(k) || any_string(v, f)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

// ---------------------------------------------------------------------------------------------
// values: rate and duration syntax
// ---------------------------------------------------------------------------------------------

/// `values::duration`, `values::size` and `values::rate` on arbitrary text. Whatever they accept must be usable
/// by the limiter: a rate is positive, at most 1 000 000/s, and its token interval is finite.
/// Returns which of duration, size and rate accepted the text.
pub fn values(data: &[u8]) -> [bool; 3] {
    let Ok(text) = std::str::from_utf8(data) else {
        return [false; 3];
    };
    let duration = values::duration(text);
    if let Ok(d) = duration {
        // `Duration` cannot be negative or NaN; re-parsing its own rendering must not fail.
        let again = values::duration(&format!("{}ms", d.as_secs_f64() * 1000.0));
        assert!(
            again.is_ok() || d.as_secs_f64() * 1000.0 > 1e15,
            "duration({text:?}) = {d:?} but {d:?} written in ms does not parse: {again:?}"
        );
    }
    let size = values::size(text);
    if let Ok(n) = size {
        let digits: String = text
            .trim()
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        assert!(
            n == 0 || !digits.trim_start_matches('0').is_empty(),
            "size({text:?}) = {n} from a zero count"
        );
    }
    let rate = values::rate(text);
    if let Ok(r) = rate {
        let per_sec = r.per_sec();
        assert!(
            r.count.is_finite() && r.count > 0.0,
            "rate({text:?}): count {}",
            r.count
        );
        assert!(!r.per.is_zero(), "rate({text:?}): zero period");
        assert!(
            per_sec > 0.0 && per_sec <= 1e6,
            "rate({text:?}) accepted with {per_sec}/s, outside (0, 1e6]"
        );
        let rate = tollgate::limiter::Rate { per_sec, burst: 1 };
        assert!(
            rate.token_us().is_finite(),
            "rate({text:?}) accepted, but one token takes {} us: the limiter cannot count it",
            rate.token_us()
        );
    }
    [duration.is_ok(), size.is_ok(), rate.is_ok()]
}

// ---------------------------------------------------------------------------------------------
// forwarded_for: the X-Forwarded-For and Forwarded walk
// ---------------------------------------------------------------------------------------------

/// `identity::client_ip_from` on an arbitrary peer, trust list and forwarding headers, read as
/// `X-Forwarded-For` and as RFC 7239 `Forwarded` chains.
///
/// Input: line 1 is the peer address, line 2 comma-separated trusted networks, every further
/// line one `X-Forwarded-For` header, or a `Forwarded` header when it starts with `forwarded:`
/// (bytes that are not a valid header value are skipped, as hyper would refuse them). Each
/// answer is compared with the rule as documented, applied to the raw header bytes: the
/// right-most entry, across all lines of the header, that is not a trusted proxy; the walk
/// stops at the first entry that is not an address, because what is left of it is
/// client-written. Returns the `X-Forwarded-For` and the `Forwarded` answers.
pub fn forwarded_for(data: &[u8]) -> Option<[IpAddr; 2]> {
    let mut lines = data.split(|&b| b == b'\n');
    let peer = lines.next().and_then(parse_ip)?;
    let trusted: Vec<IpNet> = lines
        .next()
        .unwrap_or_default()
        .split(|&b| b == b',')
        .filter_map(|n| std::str::from_utf8(n).ok())
        .filter_map(|n| IpNet::from_str(n.trim()).ok())
        .collect();
    let mut headers = HeaderMap::new();
    let (mut xff, mut fwd): (Vec<&[u8]>, Vec<&[u8]>) = (Vec::new(), Vec::new());
    for line in lines {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let (name, value, raw) = match line.strip_prefix(b"forwarded:") {
            Some(v) => ("forwarded", v, &mut fwd),
            None => ("x-forwarded-for", line, &mut xff),
        };
        let Ok(value) = HeaderValue::from_bytes(value) else {
            continue;
        };
        raw.push(value_bytes(line, name));
        headers.append(name, value);
    }
    let mut answers = [peer; 2];
    for (i, (header, raw)) in [
        (ForwardedHeader::XForwardedFor, &xff),
        (ForwardedHeader::Forwarded, &fwd),
    ]
    .into_iter()
    .enumerate()
    {
        let got = identity::client_ip_from(peer, &headers, &trusted, header);
        assert_eq!(
            got,
            got.to_canonical(),
            "client_ip returned a mapped address"
        );
        let want = documented_client_ip(peer, raw, &trusted, header);
        assert_eq!(
            got,
            want,
            "client_ip_from(peer {peer}, trusted {trusted:?}, {header:?} lines {:?})",
            raw.iter()
                .map(|l| String::from_utf8_lossy(l))
                .collect::<Vec<_>>()
        );
        answers[i] = got;
    }
    Some(answers)
}

fn value_bytes<'a>(line: &'a [u8], name: &str) -> &'a [u8] {
    if name == "forwarded" {
        &line[b"forwarded:".len()..]
    } else {
        line
    }
}

/// The documented rule, on raw header bytes: every entry of every line, right to left.
fn documented_client_ip(
    peer: IpAddr,
    lines: &[&[u8]],
    trusted: &[IpNet],
    header: ForwardedHeader,
) -> IpAddr {
    let peer = peer.to_canonical();
    let is_trusted = |ip: &IpAddr| trusted.iter().any(|n| n.contains(ip));
    if !is_trusted(&peer) {
        return peer;
    }
    let mut client = peer;
    for entry in lines.iter().rev().flat_map(|l| l.rsplit(|&b| b == b',')) {
        // A header value is visible ASCII, spaces and tabs; an entry with any other byte
        // (obs-text) is not an address.
        let text = std::str::from_utf8(entry).ok().filter(|e| e.is_ascii());
        let hop = text.and_then(|e| match header {
            ForwardedHeader::XForwardedFor => parse_entry(e),
            ForwardedHeader::Forwarded => forwarded_node(e).and_then(parse_entry),
        });
        let Some(ip) = hop else {
            break;
        };
        client = ip;
        if !is_trusted(&ip) {
            break;
        }
    }
    client
}

/// The `for=` node of one RFC 7239 element: unquoted, brackets and port removed.
fn forwarded_node(element: &str) -> Option<&str> {
    element.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        if !k.trim().eq_ignore_ascii_case("for") {
            return None;
        }
        let v = v.trim().trim_matches('"');
        Some(match v.strip_prefix('[') {
            Some(rest) => rest.split(']').next().unwrap_or(rest),
            None => v,
        })
    })
}

fn parse_entry(entry: &str) -> Option<IpAddr> {
    let s = entry.trim_matches([' ', '\t']);
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    s.parse::<SocketAddr>().ok().map(|a| a.ip().to_canonical())
}

fn parse_ip(b: &[u8]) -> Option<IpAddr> {
    std::str::from_utf8(b).ok()?.trim().parse().ok()
}

// ---------------------------------------------------------------------------------------------
// identity: key sources, exemptions and the digest
// ---------------------------------------------------------------------------------------------

/// Key sources used when the input's own key line does not parse.
const DEFAULT_KEY: [&str; 6] = [
    "header:X-API-Key+query:key",
    "cookie:session",
    "bearer",
    "host+method+path",
    "query:k%20y",
    "ip",
];

/// `RequestView::resolve` and `is_exempt` on an arbitrary request.
///
/// Input lines: 1 the limit's `key` alternatives separated by `|` (as in a config's
/// `key: [...]`), 2 its `exempt` entries separated by `|`, 3 the method, 4 the request target
/// (URI), then `name: value` header lines (invalid names or values are skipped). Checks that
/// the identity is a pure function of the request, that the sources a config cannot name are
/// refused, and that the `global` key and the `/0` exemptions behave. The path is also run
/// through `guard::normalize_path`, which must give every path one spelling: normalising a
/// normalised path changes nothing. Returns the identity.
pub fn identity(data: &[u8]) -> ClientId {
    let mut lines = data.split(|&b| b == b'\n');
    let mut next = || lines.next().unwrap_or_default();
    let key_line = String::from_utf8_lossy(next()).into_owned();
    let exempt_line = String::from_utf8_lossy(next()).into_owned();
    let method = Method::from_bytes(next()).unwrap_or(Method::GET);
    let uri = Uri::try_from(next()).unwrap_or_else(|_| Uri::from_static("/"));
    let mut headers = HeaderMap::new();
    for line in lines {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        let value = value.strip_prefix(b" ").unwrap_or(value);
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            headers.append(n, v);
        }
    }

    let mut alternatives = Vec::new();
    for part in key_line.split('|') {
        if let Ok(alt) = Alternative::parse(part) {
            // What the parser accepted must print back to something it accepts the same way.
            let shown = alt
                .0
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("+");
            assert_eq!(
                Alternative::parse(&shown).as_ref(),
                Ok(&alt),
                "key `{part}` parsed to {alt:?}, shown as `{shown}`"
            );
            alternatives.push(alt);
        }
    }
    if alternatives.is_empty() {
        alternatives = DEFAULT_KEY
            .iter()
            .map(|k| Alternative::parse(k).expect("default keys parse"))
            .collect();
    }
    let exempt: Vec<Exemption> = exempt_line
        .split('|')
        .filter_map(|e| Exemption::parse(e).ok())
        .collect();

    let trusted: [IpNet; 2] = ["127.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()];
    let client_ip = identity::client_ip([127, 0, 0, 1].into(), &headers, &trusted);
    let view = RequestView {
        method: &method,
        uri: &uri,
        headers: &headers,
        client_ip,
        jwt: None,
    };
    let spec = KeySpec(alternatives);
    let id = view.resolve(&spec);
    assert_eq!(id, view.resolve(&spec), "resolve is not deterministic");
    assert_eq!(id.hex().len(), 32);
    assert_eq!(view.resolve(&KeySpec(vec![])), ClientId::anonymous());
    let global = KeySpec(vec![Alternative(vec![Source::Global])]);
    let same_global = RequestView {
        method: &Method::GET,
        uri: &Uri::from_static("/"),
        headers: &HeaderMap::new(),
        client_ip: [192, 0, 2, 1].into(),
        jwt: None,
    };
    assert_eq!(
        view.resolve(&global),
        same_global.resolve(&global),
        "`global` must be one bucket for every request"
    );
    let exempt_now = view.is_exempt(&exempt);
    assert_eq!(exempt_now, view.is_exempt(&exempt));
    assert!(!view.is_exempt(&[]));
    let everyone = if client_ip.is_ipv4() {
        "0.0.0.0/0"
    } else {
        "::/0"
    };
    assert!(view.is_exempt(&[Exemption::parse(everyone).unwrap()]));
    let _ = identity::host(&uri, &headers);
    if let Ok(clean) = tollgate::screen::normalize_path(uri.path()) {
        let again = tollgate::screen::normalize_path(&clean);
        assert_eq!(
            again.as_deref().ok(),
            Some(clean.as_str()),
            "normalize_path({:?}) = {clean:?} is not a fixed point",
            uri.path()
        );
    }
    id
}

// ---------------------------------------------------------------------------------------------
// canonical: Host and path canonicalisation
// ---------------------------------------------------------------------------------------------

/// What `canonical` made of one input.
#[derive(Debug, PartialEq, Eq)]
pub struct Canonical {
    /// The Host in canonical form, or `None`: refused.
    pub host: Option<String>,
    /// The path as routed and as forwarded, or `None`: refused, or not an origin-form target.
    pub path: Option<(String, String)>,
}

/// `screen::parse_host` and `screen::screen` on an arbitrary Host value (line 1) and request
/// target (line 2), raw bytes.
///
/// The Host is judged against the documented rule, written here a second time: an IPv6
/// literal, or a name of non-empty labels of letters, digits, `-` and `_` (one trailing dot
/// dropped, at most 253 characters), then optionally `:` and a port of 1-5 digits in 1-65535.
/// An accepted host has one canonical spelling (lower case, no trailing dot, RFC 5952
/// address, plain port) that is itself accepted, canonical and the same host; screening puts
/// it in place of the Host header and of an HTTP/2 `:authority`, and the host routes read is
/// its name. A refused one is a 400 either way.
///
/// An origin-form target is refused exactly when the documented refusals say so (a raw `\`,
/// a malformed escape, an encoded `/`, `\` or NUL, a double encoding, escapes that are not
/// UTF-8, a dot segment with parameters). An accepted one is forwarded normalised (a fixed
/// point of `normalize_path`) and routed without path parameters; the query is kept;
/// screening the routed or the forwarded form again routes the same way.
pub fn canonical(data: &[u8]) -> Canonical {
    let mut lines = data.split(|&b| b == b'\n');
    let mut next = || {
        let line = lines.next().unwrap_or_default();
        line.strip_suffix(b"\r").unwrap_or(line)
    };
    let host = next();
    let target = next();
    Canonical {
        host: canonical_host(host),
        path: canonical_path(target),
    }
}

fn canonical_host(raw: &[u8]) -> Option<String> {
    use tollgate::screen;
    let parsed = screen::parse_host(raw);
    let documented = documented_host(raw);
    assert_eq!(
        parsed.map(|p| p.canonical()),
        documented,
        "parse_host({:?}) against the documented rule",
        show(raw)
    );
    // Through screening, as an HTTP/1.1 Host header.
    if let Ok(value) = HeaderValue::from_bytes(raw) {
        let mut req = http::Request::builder()
            .uri("/")
            .header(http::header::HOST, value)
            .body(())
            .expect("a request");
        let screened = screen::screen(&mut req, 8192, true);
        assert_eq!(
            screened.is_ok(),
            parsed.is_some(),
            "screen(Host: {:?}) = {screened:?}",
            show(raw)
        );
        if let Some(p) = &parsed {
            assert_eq!(req.headers()[http::header::HOST], p.canonical());
            let host = identity::host(req.uri(), req.headers());
            let name = p.ip.map_or_else(
                || String::from_utf8_lossy(&p.name.to_ascii_lowercase()).into_owned(),
                |ip| ip.to_string(),
            );
            assert_eq!(host, Some(name.as_str()), "the host routes read");
        }
    }
    let parts = parsed?;
    let canonical = parts.canonical();
    let again = screen::parse_host(canonical.as_bytes())
        .unwrap_or_else(|| panic!("the canonical form {canonical:?} is refused"));
    assert!(again.canonical, "{canonical:?} is not canonical to itself");
    assert_eq!(again.canonical(), canonical);
    assert!(again.same_as(&parts), "{canonical:?} is another host");
    assert_eq!(
        parts.canonical,
        raw == canonical.as_bytes(),
        "the canonical flag"
    );
    // As HTTP/2's `:authority` (an absolute URI), where `Uri` takes the value at all.
    let mut absolute = b"http://".to_vec();
    absolute.extend_from_slice(raw);
    absolute.push(b'/');
    if let Ok(uri) = Uri::try_from(absolute) {
        if uri
            .authority()
            .is_some_and(|a| a.as_str().as_bytes() == raw)
        {
            let mut req = http::Request::builder()
                .version(http::Version::HTTP_2)
                .uri(uri)
                .body(())
                .expect("a request");
            screen::screen(&mut req, 8192, true).expect("a valid :authority");
            assert_eq!(
                req.uri().authority().map(http::uri::Authority::as_str),
                Some(&*canonical)
            );
        }
    }
    Some(canonical)
}

/// The documented Host rule, written independently of `parse_host`: the canonical form of
/// a valid value, `None` for an invalid one.
fn documented_host(raw: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(raw).ok().filter(|t| t.is_ascii())?;
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let close = rest.find(']')?;
        let ip: std::net::Ipv6Addr = rest[..close].parse().ok()?;
        let after = &rest[close + 1..];
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':')?),
        };
        (format!("[{ip}]"), port)
    } else {
        let (name, port) = match text.split_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (text, None),
        };
        let name = name.strip_suffix('.').unwrap_or(name);
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
            return None;
        }
        (name.to_ascii_lowercase(), port)
    };
    let Some(port) = port else {
        return Some(host);
    };
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u32 = port.parse().ok()?;
    (1..=65535).contains(&n).then(|| format!("{host}:{n}"))
}

fn canonical_path(target: &[u8]) -> Option<(String, String)> {
    use tollgate::screen::{self, ForwardPath};
    if !target.starts_with(b"/") {
        return None;
    }
    let uri = Uri::try_from(target).ok()?;
    let path = uri.path().to_owned();
    let refused = documented_refusal(&path);
    let screened_req = |uri: Uri| {
        let mut req = http::Request::builder()
            .uri(uri)
            .header(http::header::HOST, "a")
            .body(())
            .expect("a request");
        screen::screen(&mut req, usize::MAX, true).map(|()| req)
    };
    let screened = screened_req(uri.clone());
    assert_eq!(
        screened.is_err(),
        refused.is_some(),
        "screen({path:?}) = {:?}; the documented refusals: {refused:?}",
        screened.as_ref().map(|r| r.uri().clone())
    );
    let req = screened.ok()?;
    let routed = req.uri().path().to_owned();
    let forward_pq = req
        .extensions()
        .get::<ForwardPath>()
        .map_or_else(
            || req.uri().path_and_query().cloned(),
            |f| Some(f.0.clone()),
        )
        .expect("a path");
    let forward = forward_pq.path().to_owned();
    assert_eq!(forward_pq.query(), uri.query(), "the query goes on as sent");
    assert_eq!(
        req.uri().query(),
        uri.query(),
        "the query is routed as sent"
    );
    assert_eq!(
        screen::normalize_path(&path).ok().as_deref(),
        Some(forward.as_str()),
        "the upstream gets the normalised path"
    );
    assert_eq!(
        screen::normalize_path(&forward).ok().as_deref(),
        Some(forward.as_str()),
        "normalize_path({path:?}) = {forward:?} is not a fixed point"
    );
    assert_eq!(screen::route_form(&forward), routed.as_str());
    if !path.contains(';') {
        assert_eq!(routed, forward, "no parameters, one path");
        assert!(req.extensions().get::<ForwardPath>().is_none());
    }
    assert!(
        routed.starts_with('/') && !routed.contains("//"),
        "{routed:?}"
    );
    assert!(!routed.contains([';', '\\']), "{routed:?}");
    assert!(
        !routed.split('/').any(|s| s == "." || s == ".."),
        "a dot segment left in {routed:?}"
    );
    // One spelling: screening either form again routes the same way.
    for again in [&routed, &forward] {
        let uri = Uri::try_from(again.as_str()).expect("a screened path is a target");
        let req = screened_req(uri).unwrap_or_else(|e| panic!("{again:?} refused: {e:?}"));
        assert_eq!(req.uri().path(), routed, "screening {again:?} again");
    }
    Some((routed, forward))
}

/// Why the documented rules refuse `path`, if they do: written independently of
/// `normalize_path`.
fn documented_refusal(path: &str) -> Option<&'static str> {
    if path.contains('\\') {
        return Some("a raw backslash");
    }
    let bytes = path.as_bytes();
    let hex = |b: u8| char::from(b).to_digit(16);
    // Unreserved escapes decoded (the rest kept), and every escape decoded.
    let (mut unreserved, mut full) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            unreserved.push(bytes[i]);
            full.push(bytes[i]);
            i += 1;
            continue;
        }
        let (Some(hi), Some(lo)) = (
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) else {
            return Some("a malformed escape");
        };
        let byte = u8::try_from(hi * 16 + lo).expect("two hex digits");
        if matches!(byte, b'/' | b'\\' | 0) {
            return Some("an encoded /, \\ or NUL");
        }
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            unreserved.push(byte);
        } else {
            unreserved.extend_from_slice(&bytes[i..i + 3]);
        }
        full.push(byte);
        i += 3;
    }
    let double = unreserved.windows(5).any(|w| {
        w[0] == b'%' && w[1] == b'2' && w[2] == b'5' && hex(w[3]).is_some() && hex(w[4]).is_some()
    });
    if double {
        return Some("a double encoding");
    }
    if std::str::from_utf8(&full).is_err() {
        return Some("escapes that are not UTF-8");
    }
    let dotted = unreserved.split(|&b| b == b'/').any(|segment| {
        let bare = segment.split(|&b| b == b';').next().unwrap_or_default();
        segment.contains(&b';') && (bare == b"." || bare == b"..")
    });
    dotted.then_some("a dot segment with parameters")
}

// ---------------------------------------------------------------------------------------------
// request_head: the whole service on arbitrary bytes from a client
// ---------------------------------------------------------------------------------------------

/// The config the request pipeline is fuzzed with: limited `respond` routes, a route whose
/// upstream refuses connections, keyed limits with exemptions, and no catch-all (so 404s).
pub const PIPELINE_CONFIG: &str = r#"
listeners:
  - address: 127.0.0.1:8000
trusted_proxies: [127.0.0.0/8, "::1/128"]
limiter:
  local:
    max_buckets: 1000
upstreams:
  refused:
    targets: [127.0.0.1:1]
    connect_timeout: 1s
    timeout: 2s
routes:
  - name: limited
    match: { path_prefix: /limited }
    respond: { status: 200, body: "limited\n" }
    limits:
      - { name: per-ip, rate: 1/min, burst: 2, key: [ip] }
  - name: api
    match: { host: "*.example.com", path_prefix: /api/, methods: [GET, POST, HEAD, PUT] }
    respond: { status: 201, body: "api\n", headers: { X-Route: api } }
    limits:
      - name: per-key
        rate: 10/s
        burst: 3
        key: ["header:X-API-Key+query:key", "cookie:session", bearer, ip]
        exempt: ["header:X-API-Key=internal", 192.0.2.0/24]
      - { name: per-host, rate: 100/s, burst: 50, key: [host], shadow: true }
  - name: tenant
    match: { path: /tenant, headers: { X-Tenant: acme } }
    respond: { status: 204 }
    limits:
      - { name: per-tenant, rate: 1/h, burst: 1, key: ["header:X-Tenant+path"], cost: 1 }
  - name: upstream
    match: { path_prefix: /up }
    upstream: refused
    limits:
      - { name: up-global, rate: 1000/s, burst: 1000, key: [global] }
"#;

/// How long one input may take in total (the connection normally ends within milliseconds:
/// the client half-closes after its bytes, and the refused upstream fails at once).
pub const PIPELINE_TIMEOUT: Duration = Duration::from_secs(3);

/// What the service answered to one input.
#[derive(Debug, Default)]
pub struct Exchange {
    /// The status of every HTTP/1 response read back, in order.
    pub statuses: Vec<u16>,
    /// Everything the service wrote.
    pub raw: Vec<u8>,
    /// The connection had not ended by `PIPELINE_TIMEOUT`.
    pub timed_out: bool,
    /// The client spoke HTTP/2 (prior knowledge); responses are frames and are not parsed.
    pub http2: bool,
}

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
});

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serve `data`, as the bytes a client sends on one connection before half-closing it, with
/// the production connection settings (`server::builder`) and `proxy::handle`, against
/// `PIPELINE_CONFIG` with empty buckets (so every input is reproducible on its own). Panics if the service
/// panics or writes anything that is not a sequence of well-formed HTTP/1 responses with valid
/// status codes.
pub fn request_head(data: &[u8]) -> Exchange {
    static PIPELINE: LazyLock<Mutex<Pipeline>> =
        LazyLock::new(|| Mutex::new(Pipeline::new(PIPELINE_CONFIG)));
    let pipeline = PIPELINE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    pipeline.forget_buckets();
    pipeline.serve(data)
}

/// `request_head` with another config, on a pipeline of its own (for regression tests).
pub fn serve_bytes(config_yaml: &str, data: &[u8]) -> Exchange {
    Pipeline::new(config_yaml).serve(data)
}

/// A compiled config, its shared state and the listener's connection settings. Compiling the
/// config costs more than serving most inputs, so `request_head` keeps one and empties its
/// buckets before each input instead: every input still starts from the same state.
struct Pipeline {
    state: Arc<State>,
    connections: hyper_util::server::conn::auto::Builder<hyper_util::rt::TokioExecutor>,
    max_uri_bytes: usize,
}

impl Pipeline {
    fn new(config_yaml: &str) -> Self {
        let settings = config::parse(config_yaml).expect("the pipeline config compiles");
        let listener = settings.listeners[0].settings.clone();
        let state = State::build(settings, 1).expect("the pipeline state builds");
        Self::with(Arc::new(state), &listener)
    }

    fn with(state: Arc<State>, settings: &tollgate::server::ListenerSettings) -> Self {
        let mut connections = tollgate::server::builder(settings);
        // The one departure from production: the client half-closes after its bytes, and
        // without half-close support hyper drops the responses still in flight at EOF (every
        // input would end after its first synchronous answer).
        connections.http1().half_close(true);
        Self {
            state,
            connections,
            max_uri_bytes: settings.max_uri_bytes,
        }
    }

    /// Empty every bucket of every limit (a sweep at the end of time drops them all).
    fn forget_buckets(&self) {
        for limit in self.state.runtime.load().limits() {
            limit.in_process().sweep(f64::INFINITY);
        }
    }

    fn serve(&self, data: &[u8]) -> Exchange {
        let conn = Arc::new(ClientConn::new(
            SocketAddr::from(([127, 0, 0, 1], 40_000)),
            false,
            self.max_uri_bytes,
            0,
        ));
        let state = self.state.clone();
        let (raw, timed_out) = RUNTIME.block_on(async move {
            let (mut client, server) = tokio::io::duplex(data.len() + (1 << 16));
            let service = service_fn(move |req| {
                let (state, conn) = (state.clone(), conn.clone());
                async move {
                    Ok::<_, Infallible>(proxy::handle(&state, &conn, Box::new(req)).await.response)
                }
            });
            let connection = self
                .connections
                .serve_connection_with_upgrades(TokioIo::new(server), service);
            let mut raw = Vec::new();
            let talk = async {
                client.write_all(data).await?;
                client.shutdown().await?;
                client.read_to_end(&mut raw).await
            };
            let both = async {
                // Either side may end with an error (a refused head, a reset): not a failure.
                let _ = tokio::join!(connection, talk);
            };
            let timed_out = tokio::time::timeout(PIPELINE_TIMEOUT, both).await.is_err();
            (raw, timed_out)
        });
        let http2 = data.starts_with(H2_PREFACE);
        let statuses = if http2 {
            check_h2_settings(&raw);
            Vec::new()
        } else {
            check_http1_responses(&raw, timed_out)
        };
        Exchange {
            statuses,
            raw,
            timed_out,
            http2,
        }
    }
}

/// Walk the HTTP/1 responses in `raw`, checking each status line and head, and skipping each
/// body by its framing. A response cut short is only allowed when the connection timed out.
pub fn check_http1_responses(raw: &[u8], timed_out: bool) -> Vec<u16> {
    let mut statuses = Vec::new();
    let mut rest = raw;
    while !rest.is_empty() {
        let Some(end) = find(rest, b"\r\n\r\n") else {
            assert!(timed_out, "a response head is cut short: {:?}", show(rest));
            break;
        };
        let head = &rest[..end];
        rest = &rest[end + 4..];
        let mut lines = head
            .split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
        let status_line = lines.next().unwrap_or_default();
        let status = parse_status_line(status_line).unwrap_or_else(|| {
            panic!(
                "invalid status line {:?} in {:?}",
                show(status_line),
                show(raw)
            )
        });
        statuses.push(status);
        let mut length = None;
        let mut chunked = false;
        for line in lines {
            let colon = line
                .iter()
                .position(|&b| b == b':')
                .unwrap_or_else(|| panic!("header line without a colon: {:?}", show(line)));
            let (name, value) = (&line[..colon], trim(&line[colon + 1..]));
            assert!(
                HeaderName::from_bytes(name).is_ok() && HeaderValue::from_bytes(value).is_ok(),
                "invalid response header {:?}",
                show(line)
            );
            if name.eq_ignore_ascii_case(b"content-length") {
                let n = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse::<usize>().ok());
                length = Some(n.unwrap_or_else(|| panic!("bad Content-Length {:?}", show(value))));
            } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
                chunked = value.eq_ignore_ascii_case(b"chunked");
            }
        }
        if (100..200).contains(&status) || status == 204 || status == 304 {
            continue;
        }
        if chunked {
            match skip_chunked(rest) {
                Some(after) => rest = after,
                None => {
                    assert!(timed_out, "a chunked body is cut short: {:?}", show(rest));
                    break;
                }
            }
        } else if let Some(n) = length {
            // A response to HEAD carries the length of the body it does not send. None of the
            // bodies this service writes starts with `HTTP/1.`, so that tells the two apart.
            if rest.starts_with(b"HTTP/1.") || rest.is_empty() {
                continue;
            }
            assert!(
                rest.len() >= n || timed_out,
                "a body of {n} bytes is cut short: {:?}",
                show(rest)
            );
            rest = &rest[n.min(rest.len())..];
        } else {
            // Delimited by the end of the connection.
            break;
        }
    }
    statuses
}

/// The server's first frame is its SETTINGS, and each value must be one RFC 9113 6.5.2 allows
/// (a client must treat anything else as a connection error).
pub fn check_h2_settings(raw: &[u8]) {
    if raw.len() < 9 {
        return;
    }
    let len = usize::from(raw[0]) << 16 | usize::from(raw[1]) << 8 | usize::from(raw[2]);
    assert_eq!(
        raw[3], 4,
        "the server's first HTTP/2 frame is not SETTINGS: {raw:02x?}"
    );
    let Some(payload) = raw.get(9..9 + len) else {
        return;
    };
    assert_eq!(len % 6, 0, "SETTINGS payload of {len} bytes");
    for entry in payload.chunks_exact(6) {
        let id = u16::from_be_bytes([entry[0], entry[1]]);
        let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
        let ok = match id {
            0x2 => value <= 1,
            0x4 => value < (1 << 31),
            0x5 => (1 << 14..1 << 24).contains(&value),
            _ => true,
        };
        assert!(
            ok,
            "the server sent SETTINGS {id:#x} = {value}, which RFC 9113 forbids"
        );
    }
}

fn parse_status_line(line: &[u8]) -> Option<u16> {
    let rest = line
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| line.strip_prefix(b"HTTP/1.0 "))?;
    let code = rest.get(..3)?;
    if rest.len() > 3 && rest[3] != b' ' {
        return None;
    }
    let status = StatusCode::from_bytes(code).ok()?;
    (100..600)
        .contains(&status.as_u16())
        .then_some(status.as_u16())
}

fn skip_chunked(mut rest: &[u8]) -> Option<&[u8]> {
    loop {
        let eol = find(rest, b"\r\n")?;
        let size_field = std::str::from_utf8(&rest[..eol]).ok()?;
        let size = usize::from_str_radix(size_field.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[eol + 2..];
        if size == 0 {
            // Trailers (none expected), then the empty line.
            let end = find(rest, b"\r\n")?;
            return Some(&rest[end + 2..]);
        }
        rest = rest.get(size..)?.strip_prefix(b"\r\n")?;
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &b[start..end]
}

fn show(b: &[u8]) -> String {
    let cut = &b[..b.len().min(300)];
    String::from_utf8_lossy(cut).into_owned()
}
