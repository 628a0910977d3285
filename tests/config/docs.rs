//! The docs against the binary: every whole config the docs show as working passes `tollgate
//! check` (except for the certificate, key and token files it names, which only exist on the
//! reader's machine), and every log target the docs name is one tollgate logs under.

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
            let file = dir.path().join(format!("{checked}.yaml"));
            std::fs::write(&file, &block).unwrap();
            let out = Command::new(BIN)
                .args(["check", "--config"])
                .arg(&file)
                .env("REDIS_PASSWORD", "from-the-environment")
                .env_remove("TOLLGATE_CONFIG")
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            // The first line names the file and counts the problems; each problem must be a
            // file the example names that this machine lacks.
            for problem in stderr
                .lines()
                .skip(1)
                .filter(|l| !l.starts_with("warning:"))
            {
                assert!(
                    problem.contains("No such file or directory"),
                    "{name} fails check:\n{stderr}\n{block}"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 5, "{checked} whole configs in the docs");
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
