//! Every class of config error, one fixture each in `tests/fixtures/invalid/`, with the exact
//! message `tollgate check` prints: the file, line and column, the field path, and every
//! problem of the file at once. A changed message fails here on purpose: users read it.

use crate::common;

use std::collections::BTreeSet;

use common::check;

const DIR: &str = "tests/fixtures/invalid";

/// Run `tollgate check` on fixture `name` and compare stderr with `expected`, in which `{f}`
/// stands for the fixture's path.
fn assert_rejected(name: &str, expected: &str) {
    let path = format!("{DIR}/{name}.yaml");
    let out = check(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{name}: exit status; stderr:\n{stderr}"
    );
    assert!(
        out.stdout.is_empty(),
        "{name}: nothing on stdout for an invalid file"
    );
    let expected = expected.trim_start_matches('\n').replace("{f}", &path);
    assert_eq!(stderr, expected, "{name}: the message users read");
}

/// One test per fixture, plus the list of names to check that none is left without one.
macro_rules! fixtures {
    ($($name:ident: $expected:expr,)*) => {
        const TESTED: &[&str] = &[$(stringify!($name)),*];
        $(
            #[test]
            fn $name() {
                assert_rejected(stringify!($name), $expected);
            }
        )*
    };
}

fixtures! {
    bad_cost: r"
{f}: 4 problems
  {f}:7:72: routes[0].limits[0].cost.reserve: must be at least 1
  {f}:8:72: routes[0].limits[1].cost.reserve: reserve 500 is larger than burst 100: no request could ever pass
  {f}:9:90: routes[0].limits[2].cost.from_response: `x cost` is not a header name
  {f}:10:47: routes[0].limits[3].cost: `from_response` is for a token bucket (`rate`): a window or quota counts requests, not units
",
    bad_count_when: r#"
{f}: 5 problems
  {f}:7:60: routes[0].limits[0].count_when.status: needs at least one status, as in `[401, 403]` or `["5xx"]`
  {f}:8:74: routes[0].limits[1].count_when.status[1]: 600 is not an HTTP status: a code from 100 to 599, or a class from "1xx" to "5xx"
  {f}:8:79: routes[0].limits[1].count_when.status[2]: `6xx` is not an HTTP status: a code from 100 to 599, or a class from "1xx" to "5xx"
  {f}:8:86: routes[0].limits[1].count_when.status[3]: `4XX` is not an HTTP status: a code from 100 to 599, or a class from "1xx" to "5xx"
  {f}:9:47: routes[0].limits[2].count_when: is for `rate`, `quota` and `window` limits, not with `concurrency`: a request is counted when its response comes
"#,
    bad_protocol: "
{f}: 8 problems
  {f}:6:15: upstreams.future.protocol: `h3` is not an upstream protocol (http1, h2c, h2 or auto)
  {f}:9:15: upstreams.plain.protocol: `h2c` is HTTP/2 without TLS, for http:// targets; over TLS write `h2`
  {f}:12:15: upstreams.tls.protocol: `h2` is HTTP/2 over TLS, for https:// targets; without TLS write `h2c`
  {f}:15:15: upstreams.picky.protocol: `auto` picks the version by TLS (ALPN), for https:// targets; for http:// targets write `http1` or `h2c`
  {f}:19:16: upstreams.checked.health.check.grpc: gRPC's health check needs an HTTP/2 upstream: set `protocol: h2c` (or `h2`)
  {f}:22:5: upstreams.streams.http2: is for HTTP/2 upstreams: set `protocol: h2c`, `h2` or `auto`
  {f}:22:38: upstreams.streams.http2.max_concurrent_streams: must be at least 1
  {f}:27:22: upstreams.both.health.check.path: has both `path` and `grpc`: a check asks one
",
    bad_telemetry: r"
{f}: 5 problems
  {f}:5:15: telemetry.traces.endpoint: `otel-collector:4318` is not an http:// or https:// URL with a host: write it as http://collector:4318
  {f}:6:15: telemetry.traces.protocol: unknown protocol `thrift`: use http/protobuf or grpc
  {f}:7:19: telemetry.traces.sample_ratio: 1.5 is not a share of requests: give a number from 0 to 1
  {f}:8:30: telemetry.traces.headers.bad header: is not a valid header name
  {f}:9:19: telemetry.traces.service_name: must not be empty
",
    bad_window: r"
{f}: 7 problems
  {f}:7:31: routes[0].limits[0].window: window `0/1m`: `0` is not a whole number of at least 1
  {f}:8:34: routes[0].limits[1].window: window `5/0s`: the duration must be whole seconds from 1s to 366d
  {f}:9:48: routes[0].limits[2].algorithm: is for `window` limits (a token bucket has no algorithm to choose)
  {f}:10:64: routes[0].limits[3].burst: is for token buckets: a window's burst is its count
  {f}:11:51: routes[0].limits[4].algorithm: `exact` keeps the time of every request in the window, at most 1000 per identity; 5000 is more: write `algorithm: sliding` (two counters, a small documented error)
  {f}:12:50: routes[0].limits[5].algorithm: `leaky` is not a window algorithm (sliding, exact or fixed)
  {f}:13:48: routes[0].limits[6].timezone: is for calendar quotas: windows are aligned to the UNIX epoch (for a day from local midnight, write `quota: N/day` with `timezone`)
",
    bad_capacity: r"
{f}: 6 problems
  {f}:6:20: upstreams.zero.max_in_flight: must be at least 1 (leave it out for no cap)
  {f}:9:5: upstreams.uncapped.queue: needs `max_in_flight`: without a cap no request ever waits
  {f}:13:23: upstreams.instant.queue.timeout: must be longer than zero (`size: 0` refuses at once instead)
  {f}:17:22: upstreams.learned.adaptive.min: is 50 but max is 10: min must not exceed max
  {f}:20:20: upstreams.word.max_in_flight: `lots` is neither a number of requests nor `adaptive`
  {f}:24:15: routes[0].priority: `urgent` is not a priority: high, normal or low
",
    bad_address: r"
{f}: 1 problem
  {f}:2:14: listeners[0].address: `localhost` is not an address like `0.0.0.0:8000` or `[::]:8000`
",
    bad_admin: r"
{f}: 1 problem
  {f}:4:12: admin.address: `localhost:9901` is not an address like `0.0.0.0:8000` or `[::]:8000`
",
    bad_cidr: r"
{f}: 1 problem
  {f}:3:19: trusted_proxies[0]: `10.0.0.0/33` is not a CIDR like `10.0.0.0/8` or an IP address
",
    bad_duration: r"
{f}: 1 problem
  {f}:6:14: upstreams.app.timeout: duration `30` needs a unit: ms, s, m, h or d (as in `2s`)
",
    bad_fault_keys: r"
{f}: 2 problems
  {f}:3:17: shutdown_delay: duration `5` needs a unit: ms, s, m, h or d (as in `2s`)
  {f}:5:53: limiter.local.max_buckets_per_peer: must be at least 1 (set it to max_buckets for no per-address cap)
",
    bad_exempt: r"
{f}: 4 problems
  {f}:10:30: routes[0].limits[0].exempt[1]: `internal-batch` is neither a CIDR, an IP address nor SOURCE=VALUE (as in `header:X-API-Key=internal-batch`)
  {f}:10:46: routes[0].limits[0].exempt[2]: `ip=192.0.2.7`: exempt addresses are written as an IP or CIDR, as in `192.0.2.7` or `10.0.0.0/8`
  {f}:10:62: routes[0].limits[0].exempt[3]: `header:X-Tenant+ip=acme`: an exemption names one source, not a `+` join
  {f}:10:89: routes[0].limits[0].exempt[4]: unknown key source `adress` (expected ip, ip/N, header:NAME, query:NAME, cookie:NAME, jwt:CLAIM, bearer, global, host, method or path)
",
    bad_failure_policy: r"
{f}: 2 problems
  {f}:4:15: limiter.on_failure: `ajar` is not a failure policy (open, closed or local)
  {f}:9:59: routes[0].limits[0].on_failure: `shut` is not a failure policy (open, closed or local)
",
    bad_key: r"
{f}: 4 problems
  {f}:7:36: routes[0].limits[0].key: needs at least one source, as in `[ip]`
  {f}:8:50: routes[0].limits[1].key[1]: unknown key source `adress` (expected ip, ip/N, header:NAME, query:NAME, cookie:NAME, jwt:CLAIM, bearer, global, host, method or path)
  {f}:8:74: routes[0].limits[1].key[2]: `bad header` is not a valid header name
  {f}:8:95: routes[0].limits[1].key[3]: `query:` needs a name, as in `query:X-API-Key`
",
    bad_limiter: r"
{f}: 3 problems
  {f}:4:12: limiter.backend: `memcached` is not a backend (local or redis)
  {f}:5:25: limiter.local.max_buckets: must be at least 1
  {f}:6:32: limiter.local_fallback.divide_by: must be at least 1
",
    bad_match: r"
{f}: 7 problems
  {f}:5:20: routes[0].match.path: `login` must start with `/`
  {f}:8:5: routes[1].match: use `path` (exact) or `path_prefix`, not both
  {f}:11:20: routes[2].match.host: host `api.*.com` must be a name like `api.example.com` or a pattern like `*.example.com`
  {f}:11:48: routes[2].match.methods[1]: `P OST` is not an HTTP method
  {f}:11:81: routes[2].match.headers.X Tenant: `X Tenant` is not a valid header name
  {f}:14:20: routes[3].match.host: host `api.example.com:8080` must not carry a port: hosts are matched without their port
  {f}:14:44: routes[3].match.methods: is empty, so the route could never match: list methods or remove the key
",
    bad_name: r#"
{f}: 2 problems
  {f}:4:11: routes[0].name: name `hello world` may only use letters, digits, `_`, `.` and `-`
  {f}:7:17: routes[0].limits[0].name: name `per"ip` may only use letters, digits, `_`, `.` and `-`
"#,
    bad_numbers: r"
{f}: 3 problems
  {f}:7:47: routes[0].limits[0].burst: must be at least 1
  {f}:8:45: routes[0].limits[1].cost: must be at least 1
  {f}:9:56: routes[0].limits[2].cost: cost 3 is larger than burst 2: no request could ever pass
",
    bad_request_id_header: r"
{f}: 1 problem
  {f}:3:20: request_id_header: `x request id` is not a valid header name
",
    bad_rate: r"
{f}: 1 problem
  {f}:7:31: routes[0].limits[0].rate: rate `10/fortnight`: unknown unit `fortnight` (s, min, h, day, or a duration such as 10s)
",
    bad_redis: r"
{f}: 2 problems
  {f}:6:10: limiter.redis.url: `memcache://127.0.0.1:6379` is not a Redis URL (redis://[user:password@]host:port[/db] or rediss://...): Redis URL did not parse - InvalidClientConfig
  {f}:7:14: limiter.redis.timeout: must be longer than zero
",
    bad_redis_sentinel: r"
{f}: 4 problems
  {f}:8:31: limiter.redis.sentinel.nodes[1]: `10.0.0.2` is not host:port
  {f}:10:11: limiter.redis.tls.ca: cannot read `tests/fixtures/no-such-dir/ca.pem`: No such file or directory (os error 2)
  {f}:11:13: limiter.redis.tls.cert: needs `key` as well
  {f}:12:18: limiter.redis.client_name: must be a non-empty name without spaces (Redis refuses others)
",
    bad_redis_tls_files: r"
{f}: 4 problems
  {f}:7:15: limiter.redis.password: is also in the URL: set the password in one place
  {f}:8:5: limiter.redis.tls: is set but the URL is `redis://`: use `rediss://` for TLS
  {f}:9:13: limiter.redis.tls.cert: `{f}` holds no PEM certificate
  {f}:10:12: limiter.redis.tls.key: `{f}` holds no PEM private key
",
    bad_respond: r"
{f}: 2 problems
  {f}:5:24: routes[0].respond.status: `99` is not a final HTTP status (200-599)
  {f}:7:54: routes[1].respond.headers.Bad Header: `Bad Header` is not a valid header name
",
    bad_target: r"
{f}: 3 problems
  {f}:5:5: upstreams.none.targets: needs at least one target, as in `[127.0.0.1:8080]`
  {f}:7:15: upstreams.ftp.targets[0]: `ftp://backend.internal:21` is not a target like `127.0.0.1:8080`, `backend.internal:80` or `https://api.internal`
  {f}:9:15: upstreams.portless.targets[0]: `backend.internal` needs a port, as in `backend.internal:8080`
",
    duplicate_listener: r"
{f}: 1 problem
  {f}:3:14: listeners[1].address: `127.0.0.1:8000` is listed twice
",
    duplicate_names: r"
{f}: 2 problems
  {f}:9:11: routes[1].name: duplicate route name `hello`
  {f}:13:17: routes[1].limits[0].name: duplicate limit name `per-ip` (limit names are global: they name buckets)
",
    missing_field: r"
{f}: 1 problem
  {f}:7:9: routes[0].limits[0]: needs `rate` (a token bucket, as `10/s`), `quota` (a calendar quota, as `1000/day`) or `concurrency` (requests in flight, as `4`)
",
    no_listener: r"
{f}: 1 problem
  {f}: listeners: at least one listener is needed, as in `- address: 0.0.0.0:8000` (or `rls:` for a pure rate limit service)
",
    rate_too_fast: r"
{f}: 2 problems
  {f}:7:31: routes[0].limits[0].rate: rate `2000000/s` is above 1000000/s, the finest a bucket can count
  {f}:8:33: routes[0].limits[1].rate: rate `-5/s`: `-5` is not a positive number
",
    redis_block_unused: r"
{f}: 1 problem
  {f}:4:3: limiter.redis: is set but `limiter.backend` is `local`: set `backend: redis` to use it, or remove the block
",
    redis_without_settings: r"
{f}: 1 problem
  {f}:3:1: limiter.redis: `backend: redis` needs a `redis:` block with `url`, `cluster` or `sentinel`
",
    redis_sentinel_url: r"
{f}: 1 problem
  {f}:6:10: limiter.redis.url: Sentinel is configured as `sentinel: { master: NAME, nodes: [host:port, ...] }`, not as a URL
",
    route_action: r"
{f}: 2 problems
  {f}:7:5: routes[0]: a route has either `upstream` or `respond`, not both
  {f}:10:5: routes[1]: a route needs `upstream: NAME` or `respond: {...}`
",
    several_problems: r"
{f}: 6 problems
  {f}:2:14: listeners[0].address: `0.0.0.0:80800` is not an address like `0.0.0.0:8000` or `[::]:8000`
  {f}:3:31: trusted_proxies[1]: `not-a-network` is not a CIDR like `10.0.0.0/8` or an IP address
  {f}:7:22: upstreams.app.connect_timeout: duration `2 seconds` has unknown unit ` seconds` (ms, s, m, h or d)
  {f}:11:15: routes[0].upstream: unknown upstream `legacy`
  {f}:23:16: routes[1].limits[0].burst: must be at least 1
  {f}:24:33: routes[1].limits[0].key[1]: unknown key source `client-ip` (expected ip, ip/N, header:NAME, query:NAME, cookie:NAME, jwt:CLAIM, bearer, global, host, method or path)
",
    tls_unreadable_cert: r"
{f}: 1 problem
  {f}:3:5: listeners[0].tls: cannot read certificate tests/fixtures/no-such.crt: No such file or directory (os error 2)
",
    unknown_key: r"
{f}: 1 problem
  {f}:9:16: routes[0].limits[0].brust: unknown field `brust` (did you mean `burst`?), expected one of `name`, `rate`, `burst`, `quota`, `timezone`, `window`, `algorithm`, `concurrency`, `lease`, `ban`, `leasing`, `key`, `cost`, `shadow`, `exempt`, `on_failure`, `count_when`
",
    unknown_upstream: r"
{f}: 1 problem
  {f}:8:15: routes[0].upstream: unknown upstream `ap`
",
    wrong_type: r#"
{f}: 1 problem
  {f}:7:43: routes[0].limits[0].burst: invalid type: string "five", expected u32
"#,
    wrong_types: r#"
{f}: 5 problems
  {f}:3:15: max_inflight: invalid value: integer `-5`, expected u64
  {f}:7:43: routes[0].limits[0].burst: invalid type: floating point `2.5`, expected u32
  {f}:9:29: routes[1].respond.body: invalid type: sequence, expected a string
  {f}:12:16: routes[2].websocket: invalid type: string "yes", expected a boolean
  {f}:14:33: routes[3].respond.body: has no value (YAML null): write `""` for empty text, or leave the key out
"#,
    yaml_syntax: r"
{f}: 1 problem
  {f}:5:35: unclosed quote
",
    duplicate_key: r"
{f}: 1 problem
  {f}:8:1: duplicate mapping key `routes` is not allowed here
",
    indent_under_value: r"
{f}: 1 problem
  {f}:9:13: mapping values are not allowed in this context
    hint: check the indentation of line 9: its key is 9 spaces in, the lines above it are 8 (line 8), 4 (line 6) or 0 (line 3); it must line up with the one it belongs with (line 8 has a value, so nothing can be nested under it)
",
    indent_key: r"
{f}: 1 problem
  {f}:6:4: while parsing a block mapping, did not find expected key
    hint: check the indentation of line 6: its key is 3 spaces in, the lines above it are 4 (line 5), 2 (line 4) or 0 (line 3); it must line up with the one it belongs with
",
    indent_list_item: r"
{f}: 1 problem
  {f}:6:4: while parsing a block collection, did not find expected '-' indicator
    hint: check the indentation of line 6: its `-` is 3 spaces in, the lines above it are 4 (line 5), 2 (line 4) or 0 (line 3); it must line up with the one it belongs with
",
    unquoted_colon: r#"
{f}: 1 problem
  {f}:6:17: mapping values are not allowed in this context
    hint: a value containing `: ` must be quoted, as in `body: "note: this"`
"#,
    zero_timeouts: r"
{f}: 2 problems
  {f}:6:22: upstreams.app.connect_timeout: must be longer than zero
  {f}:7:14: upstreams.app.timeout: must be longer than zero
",
}

/// Fixtures tested by their own function below rather than by an exact message.
const TESTED_ELSEWHERE: &[&str] = &["structural_and_semantic"];

#[test]
fn every_fixture_has_a_test() {
    let on_disk: BTreeSet<String> = std::fs::read_dir(common::proxy::repo_root().join(DIR))
        .expect("read the fixture directory")
        .map(|e| {
            e.expect("a directory entry")
                .file_name()
                .into_string()
                .unwrap()
        })
        .filter_map(|f| f.strip_suffix(".yaml").map(str::to_owned))
        .collect();
    let tested: BTreeSet<String> = TESTED
        .iter()
        .chain(TESTED_ELSEWHERE)
        .map(|s| (*s).to_owned())
        .collect();
    assert_eq!(on_disk, tested, "fixtures and tests must match one to one");
}

/// DESIGN rule 2: every problem of a file at once. A typo'd key (found while parsing) must not
/// hide the other typo and the unknown upstream (found while compiling): a user fixing one
/// problem per run is what the rule is there to prevent.
#[test]
fn structural_and_semantic_problems_are_reported_together() {
    let path = format!("{DIR}/structural_and_semantic.yaml");
    let out = check(&path);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    for needle in [
        "8:43: routes[0].limits[0].brust: unknown field `brust`",
        "11:5: routes[1].limts: unknown field `limts`",
        "routes[2].upstream: unknown upstream `nowhere`",
    ] {
        assert!(
            stderr.contains(needle),
            "`{needle}` is missing from what check reports:\n{stderr}"
        );
    }
}

#[test]
fn a_missing_file_is_named() {
    let out = check("tests/fixtures/no-such-file.yaml");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "tests/fixtures/no-such-file.yaml: 1 problem\n  \
         tests/fixtures/no-such-file.yaml: cannot read the file: No such file or directory \
         (os error 2)\n"
    );
}
