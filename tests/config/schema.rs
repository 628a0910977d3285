//! `tollgate schema`: the JSON Schema editors and CI validate configs with. Every config the
//! project ships satisfies it, broken ones do not, and docs/tollgate.schema.json is exactly what
//! the command prints (so the shipped file cannot drift from the types it is derived from).

use crate::common;

use std::path::Path;

use common::proxy::{repo_root, run_cli};
use serde_json::Value;

fn printed_schema() -> String {
    let out = run_cli(&["schema"]);
    assert!(out.status.success(), "tollgate schema: {:?}", out.status);
    String::from_utf8(out.stdout).expect("the schema is UTF-8")
}

fn validator() -> jsonschema::Validator {
    let schema: Value = serde_json::from_str(&printed_schema()).expect("the schema is JSON");
    assert_eq!(
        schema["$schema"], "https://json-schema.org/draft/2020-12/schema",
        "draft 2020-12"
    );
    jsonschema::validator_for(&schema).expect("the schema is a valid JSON Schema")
}

/// The YAML as the loader reads it, as JSON (what an editor's schema check sees).
fn as_json(yaml: &str) -> Value {
    serde_saphyr::from_str_with_options(yaml, serde_saphyr::options! { strict_booleans: true })
        .expect("the YAML parses")
}

/// Every schema error of `yaml`, one line each.
fn errors(v: &jsonschema::Validator, yaml: &str) -> Vec<String> {
    v.iter_errors(&as_json(yaml))
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Whole configs in docs/configuration.md: its YAML blocks with a top-level `listeners:`, each
/// with whether it is shown as a broken file (a `tollgate check` run on `bad.yaml` follows it).
fn doc_configs() -> Vec<(String, bool)> {
    let doc = std::fs::read_to_string(repo_root().join("docs/configuration.md")).unwrap();
    let mut blocks = Vec::new();
    let mut rest = doc.as_str();
    while let Some(start) = rest.find("```yaml\n") {
        let body = &rest[start + 8..];
        let end = body.find("```").expect("a closed code block");
        if body[..end].lines().any(|l| l.starts_with("listeners:")) {
            let broken = body[end + 3..]
                .trim_start()
                .starts_with("```console\n$ tollgate check --config bad.yaml");
            blocks.push((body[..end].to_owned(), broken));
        }
        rest = &body[end + 3..];
    }
    blocks
}

fn yaml_files(dir: &str) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(repo_root().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_shipped_config_satisfies_the_schema() {
    let v = validator();
    let mut files = yaml_files("config");
    files.extend(yaml_files("tests/fixtures/valid"));
    files.push(repo_root().join("deploy/fleet.yaml"));
    files.push(repo_root().join("deploy/kubernetes/tollgate.yaml"));
    let mut configs: Vec<(String, String)> = files
        .iter()
        .map(|p| {
            let name = p.strip_prefix(repo_root()).unwrap().display().to_string();
            (name, std::fs::read_to_string(p).unwrap())
        })
        .collect();
    let docs = doc_configs();
    assert!(
        docs.iter().any(|(_, broken)| !broken),
        "docs/configuration.md has whole configs"
    );
    for (i, (text, broken)) in docs.into_iter().enumerate() {
        let name = format!("docs/configuration.md, whole config {i}");
        if broken {
            // The structural mistakes of the broken example are the schema's to catch too.
            let errors = errors(&v, &text);
            for at in [
                "/listeners/1",
                "/upstreams/app/timeout",
                "/routes/1/limits/0",
            ] {
                assert!(
                    errors.iter().any(|e| e.starts_with(&format!("{at}: "))),
                    "{name}: no error at {at}: {errors:?}"
                );
            }
        } else {
            configs.push((name, text));
        }
    }
    assert!(configs.len() >= 6, "{} configs", configs.len());
    for (name, text) in &configs {
        let errors = errors(&v, text);
        assert!(errors.is_empty(), "{name}:\n{}", errors.join("\n"));
    }
}

#[test]
fn broken_configs_do_not() {
    let v = validator();
    let base = "listeners:\n  - address: 127.0.0.1:8000\n";
    for (yaml, at) in [
        ("listners: []\n", ""),
        (
            "routes:\n  - name: a\n    limits: [{ name: x, rate: 1/s, key: [ip], brust: 2 }]\n",
            "/routes/0/limits/0",
        ),
        (
            "routes:\n  - name: a\n    limits: [{ name: x, rate: 1/s, key: [ip], burst: five }]\n",
            "/routes/0/limits/0/burst",
        ),
        (
            "routes:\n  - name: a\n    limits: [{ name: x, rate: 10/fortnight, key: [ip] }]\n",
            "/routes/0/limits/0/rate",
        ),
        (
            "routes:\n  - name: a\n    limits: [{ name: x, key: [ip] }]\n",
            "/routes/0/limits/0",
        ),
        (
            "upstreams:\n  app: { targets: [a:1], timeout: 30 }\n",
            "/upstreams/app/timeout",
        ),
        (
            "upstreams:\n  app: { targets: [a:1], timeout: 2 seconds }\n",
            "/upstreams/app/timeout",
        ),
        (
            "routes:\n  - name: a\n    websocket: yes\n",
            "/routes/0/websocket",
        ),
        ("max_inflight: -1\n", "/max_inflight"),
        ("limiter: { backend: memcached }\n", "/limiter/backend"),
        ("client_ip_header: x-real-ip\n", "/client_ip_header"),
        (
            "routes:\n  - name: a\n    max_body: 10 lots\n",
            "/routes/0/max_body",
        ),
    ] {
        let text = format!("{base}{yaml}");
        let errors = errors(&v, &text);
        assert!(!errors.is_empty(), "accepted:\n{text}");
        assert!(
            errors.iter().any(|e| e.starts_with(&format!("{at}: "))),
            "{text}: no error at `{at}`: {errors:?}"
        );
    }
}

#[test]
fn compound_durations_sizes_and_references_are_accepted() {
    let v = validator();
    let text = "listeners:
  - address: 127.0.0.1:8000
    timeouts: { header_read: 1m30s, idle: 1.5s, send: 250ms }
    max_header_bytes: 64KiB
max_inflight: ${MAX_INFLIGHT:-10000}
shutdown_timeout: ${GRACE}
limiter: { backend: '${BACKEND:-local}', on_failure: closed }
client_ip_header: forwarded
upstreams:
  app: { targets: ['127.0.0.1:8080'], timeout: 1h30m, connect_timeout: 2s }
routes:
  - name: a
    upstream: app
    max_body: 1048576
    websocket: ${WS:-false}
    limits: [{ name: x, rate: 100/10s, burst: 5, key: [ip] }, { name: y, rate: 0.5/min, key: [global] }]
";
    let errors = errors(&v, text);
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn the_shipped_schema_file_is_what_the_command_prints() {
    let path = Path::new("docs/tollgate.schema.json");
    let shipped = std::fs::read_to_string(repo_root().join(path)).unwrap_or_default();
    assert!(
        shipped == printed_schema(),
        "{} is stale: run `cargo run -- schema > {}`",
        path.display(),
        path.display()
    );
}

#[test]
fn descriptions_come_from_the_doc_comments() {
    let schema: Value = serde_json::from_str(&printed_schema()).unwrap();
    assert_eq!(schema["title"], "tollgate configuration");
    assert_eq!(schema["additionalProperties"], false);
    assert_eq!(
        schema["properties"]["max_inflight"]["description"],
        "Requests in flight at once, all listeners together; beyond it: 503 with Retry-After."
    );
    assert_eq!(schema["$defs"]["Limit"]["additionalProperties"], false);
}

/// A valid config that touches most keys, for `mutations`.
const BASE: &str = r#"listeners:
  - address: 127.0.0.1:8000
    timeouts: { header_read: 10s, idle: 60s }
    max_connections: 100
    max_header_bytes: 32KiB
admin:
  address: 127.0.0.1:9901
upstreams:
  app:
    targets: ["127.0.0.1:9000"]
    timeout: 30s
    retries: 1
    max_in_flight: 8
routes:
  - name: api
    match: { path_prefix: /api/, methods: [GET, POST] }
    upstream: app
    limits:
      - { name: per-key, rate: 10/s, burst: 20, key: [header:X-API-Key, ip], cost: 1, shadow: false, on_failure: open }
      - { name: daily, quota: 1000/day, key: [ip] }
      - { name: login, window: 5/15m, algorithm: exact, key: [ip] }
      - { name: exports, concurrency: 4, key: [ip] }
"#;

/// Edits of `BASE` (the text replaced, its replacement), each a mistake or a legal variant.
const MUTATIONS: &[(&str, &str)] = &[
    ("burst: 20", "burst: 0"),
    ("burst: 20", "burst: -1"),
    ("burst: 20", "burst: \"20\""),
    ("burst: 20", "burst: 1.5"),
    ("rate: 10/s", "rate: 0/s"),
    ("rate: 10/s", "rate: 10"),
    ("rate: 10/s", "rate: 10/fortnight"),
    ("rate: 10/s", "rate: 10 / s"),
    ("cost: 1", "cost: 0"),
    (
        "key: [ip] }\n      - { name: login",
        "key: [] }\n      - { name: login",
    ),
    ("quota: 1000/day", "quota: 0/day"),
    ("quota: 1000/day", "quota: 1000/year"),
    ("window: 5/15m", "window: 0/15m"),
    ("window: 5/15m", "window: 5/0s"),
    ("algorithm: exact", "algorithm: exactly"),
    ("concurrency: 4", "concurrency: 0"),
    ("shadow: false", "shadow: \"false\""),
    ("shadow: false", "shadow: no"),
    ("on_failure: open", "on_failure: opened"),
    ("max_connections: 100", "max_connections: 0"),
    ("max_connections: 100", "max_connections: \"100\""),
    ("max_header_bytes: 32KiB", "max_header_bytes: 32 KiB"),
    ("header_read: 10s", "header_read: 10 s"),
    ("header_read: 10s", "header_read: 0s"),
    ("header_read: 10s", "header_read: \"10s\""),
    ("timeout: 30s", "timeout: 30"),
    ("timeout: 30s", "timeout: 1h30m"),
    ("retries: 1", "retries: -1"),
    ("max_in_flight: 8", "max_in_flight: 0"),
    ("targets: [\"127.0.0.1:9000\"]", "targets: []"),
    ("methods: [GET, POST]", "methods: []"),
    ("path_prefix: /api/", "path_prefix: api/"),
    ("name: api", "name: \"\""),
    ("address: 127.0.0.1:8000", "address: \"\""),
];

/// Mistakes only `tollgate check` sees: JSON Schema cannot compare a size written with a unit
/// with a floor, nor one key with another or with the rest of the file.
const CHECK_ONLY: &[(&str, &str)] = &[
    ("max_header_bytes: 32KiB", "max_header_bytes: 4KiB"),
    ("cost: 1", "cost: 30"),
    ("upstream: app", "upstream: nowhere"),
];

/// What `tollgate schema` and `tollgate check` say of each of `MUTATIONS`: they agree; and
/// each of `CHECK_ONLY` passes the schema and fails check.
#[test]
fn the_schema_and_check_agree_on_mutations() {
    let v = validator();
    assert!(errors(&v, BASE).is_empty(), "{:?}", errors(&v, BASE));
    assert!(
        tollgate::config::parse(BASE).is_ok(),
        "{:?}",
        tollgate::config::parse(BASE).err()
    );
    let mut disagree = Vec::new();
    for (from, to) in MUTATIONS {
        assert!(BASE.contains(from), "{from}");
        let text = BASE.replacen(from, to, 1);
        let schema_ok = errors(&v, &text).is_empty();
        let check_ok = tollgate::config::parse(&text).is_ok();
        if schema_ok != check_ok {
            disagree.push(format!("{to}: schema {schema_ok}, check {check_ok}"));
        }
    }
    assert!(
        disagree.is_empty(),
        "{} disagree:\n{}",
        disagree.len(),
        disagree.join("\n")
    );
    for (from, to) in CHECK_ONLY {
        let text = BASE.replacen(from, to, 1);
        assert!(
            errors(&v, &text).is_empty(),
            "{to}: {:?}",
            errors(&v, &text)
        );
        assert!(tollgate::config::parse(&text).is_err(), "{to} passes check");
    }
}
