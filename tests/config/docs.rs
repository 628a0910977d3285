//! The docs against the binary: every whole config the docs show as working passes `tollgate
//! check` (except for the certificate, key and token files it names, which only exist on the
//! reader's machine), and so does every fragment (a `limits:` list, a route, top-level keys)
//! once completed into a config; every log target the docs name is one tollgate logs under.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::proxy::repo_root;

const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

/// The Markdown files an operator reads.
fn docs() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo_root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    files.push(repo_root().join("README.md"));
    files.push(repo_root().join("deploy/README.md"));
    files.sort();
    files
}

/// The YAML blocks of `text` with a top-level `listeners:` (whole configs), skipping those a
/// `tollgate check --config bad.yaml` run follows (shown broken on purpose).
fn whole_configs(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("```yaml\n") {
        let body = &rest[start + 8..];
        let end = body.find("```").expect("a closed code block");
        let broken = body[end + 3..]
            .trim_start()
            .starts_with("```console\n$ tollgate check --config bad.yaml");
        if !broken && body[..end].lines().any(|l| l.starts_with("listeners:")) {
            blocks.push(body[..end].to_owned());
        }
        rest = &body[end + 3..];
    }
    blocks
}

/// Each YAML block of `text` that is not a whole config (no top-level `listeners:`) and is one
/// of tollgate's, completed into a config: a `limits:` list goes into a route, route items
/// under `routes:`, top-level keys get a listener and a route if they lack them. Blocks of
/// other programs (Prometheus, Kubernetes), a route's or a listener's keys alone, and broken
/// examples are skipped.
fn completed_fragments(text: &str) -> Vec<(String, String)> {
    const LISTENER: &str = "listeners:\n  - address: 127.0.0.1:0\n";
    const ROUTE: &str = "  - name: fragment-route\n    respond: { status: 200 }\n";
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("```yaml\n") {
        let body = &rest[start + 8..];
        let end = body.find("```").expect("a closed code block");
        let (block, after) = (&body[..end], &body[end + 3..]);
        rest = after;
        let broken = after
            .trim_start()
            .starts_with("```console\n$ tollgate check --config bad.yaml");
        let first = block
            .lines()
            .find(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .unwrap_or("");
        let top = |k: &str| block.lines().any(|l| l.starts_with(k));
        // `[...]` stands for what the reader fills in.
        if broken || top("listeners:") || block.starts_with('#') || block.contains("[...]") {
            continue;
        }
        // Leasing and fleet-wide features need the Redis backend; check connects to nothing.
        let mut redis = if top("limiter:") {
            String::new()
        } else {
            "limiter:\n  backend: redis\n  redis: { url: redis://127.0.0.1:6379 }\n".to_owned()
        };
        // The upstreams the docs' routes name.
        if !top("upstreams:") {
            redis.push_str("upstreams:\n  app: { targets: [127.0.0.1:8080] }\n  legacy: { targets: [127.0.0.1:8081] }\n");
        }
        let redis = redis.as_str();
        let config = if first.starts_with("limits:") {
            let limits = indented(block, "    ");
            format!("{LISTENER}{redis}routes:\n{ROUTE}{limits}")
        } else if first.starts_with("- name:") {
            let routes = indented(block, "  ");
            format!("{LISTENER}{redis}routes:\n{routes}")
        } else if ["scrape_configs:", "tls:", "respond:"]
            .iter()
            .any(|k| first.starts_with(k))
        {
            continue;
        } else if top("routes:") {
            format!("{LISTENER}{redis}{block}")
        } else if top("upstreams:") || top("limiter:") {
            format!("{LISTENER}{block}routes:\n{ROUTE}")
        } else {
            format!("{LISTENER}{redis}{block}routes:\n{ROUTE}")
        };
        out.push((block.to_owned(), config));
    }
    out
}

/// Each line of `block` after `by`.
fn indented(block: &str, by: &str) -> String {
    block.lines().flat_map(|l| [by, l, "\n"]).collect()
}

/// `tollgate check` on `yaml`: the problems other than files this machine lacks.
fn check_problems(yaml: &str, dir: &Path, n: usize) -> Vec<String> {
    let file = dir.join(format!("{n}.yaml"));
    std::fs::write(&file, yaml).unwrap();
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&file)
        .env("REDIS_PASSWORD", "from-the-environment")
        .env("SENTINEL_PASSWORD", "from-the-environment")
        .env_remove("TOLLGATE_CONFIG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The first line names the file and counts the problems; each problem must be a file or
    // directory the example names that this machine lacks.
    let lacks =
        |l: &str| l.contains("No such file or directory") || l.contains("is not a directory");
    stderr
        .lines()
        .skip(1)
        .filter(|l| !l.starts_with("warning:") && !lacks(l))
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_whole_config_in_the_docs_passes_check() {
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for doc in docs() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for (i, block) in whole_configs(&text).into_iter().enumerate() {
            let name = format!(
                "{} block {i}",
                doc.strip_prefix(repo_root()).unwrap().display()
            );
            let problems = check_problems(&block, dir.path(), checked);
            assert!(
                problems.is_empty(),
                "{name} fails check:\n{problems:#?}\n{block}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 5, "{checked} whole configs in the docs");
}

#[test]
fn every_config_fragment_in_the_docs_passes_check() {
    let dir = tempfile::tempdir().unwrap();
    let (mut checked, mut failed) = (0, Vec::new());
    for doc in docs() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for (block, config) in completed_fragments(&text) {
            let problems = check_problems(&config, dir.path(), checked);
            if !problems.is_empty() {
                let doc = doc.strip_prefix(repo_root()).unwrap().display().to_string();
                failed.push(format!("{doc}:\n{block}\n{problems:#?}"));
            }
            checked += 1;
        }
    }
    assert!(
        failed.is_empty(),
        "fragments that fail check:\n{}",
        failed.join("\n")
    );
    assert!(checked >= 20, "{checked} fragments in the docs");
}

/// `tollgate::a::b` names in `text`.
fn targets(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("tollgate::") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_' || c == ':'))
            .unwrap_or(tail.len());
        found.push(tail[..end].trim_end_matches(':').to_owned());
        rest = &tail[end..];
    }
    found
}

/// Whether `target` is a module of the crate (`src/a/b.rs` or `src/a/b/mod.rs`), or a target
/// the source names as a string.
fn exists(target: &str, sources: &str) -> bool {
    let path = target.trim_start_matches("tollgate::").replace("::", "/");
    let src = repo_root().join("src");
    Path::new(&src).join(format!("{path}.rs")).exists()
        || Path::new(&src).join(&path).join("mod.rs").exists()
        || sources.contains(&format!("\"{target}\""))
        || sources.contains(&format!(" {target}: "))
}

#[test]
fn every_log_target_the_docs_name_exists() {
    let mut sources = String::new();
    let mut dirs = vec![repo_root().join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                sources.push_str(&std::fs::read_to_string(path).unwrap());
            }
        }
    }
    let mut named = 0;
    for doc in docs() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for target in targets(&text) {
            assert!(
                exists(&target, &sources),
                "{} names the log target `{target}`, which tollgate has not",
                doc.display()
            );
            named += 1;
        }
    }
    assert!(named >= 5, "{named} log targets named");
}

#[test]
fn the_broken_example_shows_what_check_prints() {
    let doc = std::fs::read_to_string(repo_root().join("docs/configuration.md")).unwrap();
    let shown_at = doc
        .find("```console\n$ tollgate check --config bad.yaml\n")
        .expect("the broken example's check run");
    let yaml = doc[..shown_at]
        .rsplit_once("```yaml\n")
        .and_then(|(_, b)| b.split_once("```"))
        .map(|(b, _)| b)
        .expect("the broken example");
    let shown = doc[shown_at..]
        .split_once("bad.yaml\n")
        .map(|(_, rest)| rest)
        .unwrap();
    let shown = &shown[..shown.find("```").unwrap()];
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bad.yaml"), yaml).unwrap();
    let out = Command::new(BIN)
        .args(["check", "--config", "bad.yaml"])
        .current_dir(dir.path())
        .env_remove("TOLLGATE_CONFIG")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stderr), shown);
}
