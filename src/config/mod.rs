//! The configuration: load a YAML file, validate it completely, and compile it to `Settings`.
//!
//! `yaml` is the parser (serde-saphyr), `file` mirrors the YAML (and is the source of the JSON
//! Schema, `schema`), `compile` turns it into plain `settings` (no live objects: those are
//! `runtime`'s), `locate` maps field paths back to lines so every error points into the file.
//! Nothing here imports a module above `config`.

pub(crate) mod compile;
mod env;
pub(crate) mod file;
pub(crate) mod locate;
mod raw;
pub mod rls;
pub mod schema;
pub mod settings;
pub mod values;
pub(crate) mod yaml;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use settings::Settings;

/// One thing wrong with a config, with where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Field path such as `routes[1].limits[0].rate`; empty for syntax errors.
    pub path: String,
    pub message: String,
    /// 1-based line and column, when known.
    pub at: Option<(usize, usize)>,
}

/// Everything wrong with one config file.
#[derive(Debug, Clone)]
pub struct ConfigError {
    pub file: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        write!(
            f,
            "{}: {n} problem{}",
            self.file,
            if n == 1 { "" } else { "s" }
        )?;
        for p in &self.problems {
            write!(f, "\n  {}", self.file)?;
            if let Some((line, col)) = p.at {
                write!(f, ":{line}:{col}")?;
            }
            if p.path.is_empty() {
                write!(f, ": {}", p.message)?;
            } else {
                write!(f, ": {}: {}", p.path, p.message)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// Read, parse and compile the file at `path`, and the candidate config it names (which
/// loads or fails on its own: see `CandidateLoad`).
pub fn load(path: &Path) -> Result<Settings, ConfigError> {
    load_text(path, &read(path)?)
}

/// `load`, of the file's `text` read already.
fn load_text(path: &Path, text: &str) -> Result<Settings, ConfigError> {
    let digest = inputs_digest_at(path, text);
    let mut settings = parse(text).map_err(|problems| ConfigError {
        file: path.display().to_string(),
        problems,
    })?;
    settings.inputs_digest = digest;
    if let Some(rls) = &mut settings.rls {
        rls.domains = rls::load(&rls::resolve(path, &rls.config), &settings.limiter)?;
    }
    settings.candidate = candidate_path(path, text).map(|path| settings::CandidateLoad {
        settings: load_candidate(&path).map(Arc::new),
        path,
    });
    Ok(settings)
}

/// A config to replay or explain requests against (`tollgate simulate`): a full config, or a
/// candidate config, which has no `listeners` and is compiled as one (as `candidate:` names it).
pub fn load_routes(path: &Path) -> Result<Settings, ConfigError> {
    let text = read(path)?;
    let has_listeners = yaml::tree(&text).is_ok_and(|root| root.get("listeners").is_some());
    if has_listeners {
        load_text(path, &text)
    } else {
        candidate_text(path, &text)
    }
}

/// The candidate config at `path`: the same format, compiled as `compile::Role::Candidate`.
fn load_candidate(path: &Path) -> Result<Settings, ConfigError> {
    candidate_text(path, &read(path)?)
}

/// `load_candidate`, of the file's `text` read already.
fn candidate_text(path: &Path, text: &str) -> Result<Settings, ConfigError> {
    parse_as(text, compile::Role::Candidate).map_err(|problems| ConfigError {
        file: path.display().to_string(),
        problems,
    })
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: path.display().to_string(),
        problems: vec![Problem {
            path: String::new(),
            message: format!("cannot read the file: {e}"),
            at: None,
        }],
    })
}

/// The file the config text at `path` names as its `candidate`, resolved against the config's
/// directory.
pub fn candidate_path(path: &Path, text: &str) -> Option<PathBuf> {
    let root = yaml::tree(text).ok()?;
    let file = Path::new(root.get("candidate")?.as_str()?);
    Some(match path.parent() {
        Some(dir) if file.is_relative() => dir.join(file),
        _ => file.to_path_buf(),
    })
}

/// A digest of config text and of the certificate, key and CA files it names, as they are on
/// disk now.
pub fn inputs_digest(text: &str) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    digest_into(&mut h, text);
    *h.finalize().as_bytes()
}

/// `inputs_digest` of the config at `path`, its candidate's text and files included: an edit
/// to either is a change to reload.
pub fn inputs_digest_at(path: &Path, text: &str) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    digest_into(&mut h, text);
    if let Some(named) = yaml::tree(text).ok().and_then(|root| {
        let config = root.get("rls")?.get("config")?.as_str()?.to_owned();
        Some(config)
    }) {
        // The rate limit service's files, a directory's added and removed ones included.
        for file in rls::files(&rls::resolve(path, &named)).unwrap_or_default() {
            h.update(file.as_os_str().as_encoded_bytes());
            match std::fs::read(&file) {
                Ok(bytes) => h.update(&bytes),
                Err(_) => h.update(b"missing"),
            };
        }
    }
    if let Some(candidate) = candidate_path(path, text) {
        match std::fs::read_to_string(&candidate) {
            Ok(text) => digest_into(&mut h, &text),
            Err(_) => {
                h.update(b"candidate missing");
            }
        }
    }
    *h.finalize().as_bytes()
}

fn digest_into(h: &mut blake3::Hasher, text: &str) {
    h.update(&(text.len() as u64).to_le_bytes());
    h.update(text.as_bytes());
    for file in referenced_files(text) {
        match std::fs::read(&file) {
            Ok(bytes) => {
                h.update(&(bytes.len() as u64).to_le_bytes());
                h.update(&bytes);
            }
            Err(_) => {
                h.update(b"missing");
            }
        }
    }
}

/// The files a config names: listener certificates and keys, upstream CA bundles.
pub fn referenced_files(text: &str) -> Vec<std::path::PathBuf> {
    let Ok(root) = yaml::tree(text) else {
        return Vec::new();
    };
    let mut files = Vec::new();
    let mut take = |v: Option<&serde_json::Value>| {
        if let Some(p) = v.and_then(serde_json::Value::as_str) {
            files.push(std::path::PathBuf::from(p));
        }
    };
    for listener in root
        .get("listeners")
        .and_then(|l| l.as_array())
        .into_iter()
        .flatten()
    {
        let Some(tls) = listener.get("tls") else {
            continue;
        };
        take(tls.get("cert"));
        take(tls.get("key"));
        for pair in tls
            .get("certificates")
            .and_then(|c| c.as_array())
            .into_iter()
            .flatten()
        {
            take(pair.get("cert"));
            take(pair.get("key"));
        }
    }
    for (_, upstream) in root
        .get("upstreams")
        .and_then(|u| u.as_object())
        .into_iter()
        .flatten()
    {
        take(upstream.get("tls").and_then(|t| t.get("ca")));
    }
    take(root.get("admin").and_then(|a| a.get("token_file")));
    let jwt = root.get("identity").and_then(|i| i.get("jwt"));
    take(jwt.and_then(|j| j.get("hs256_secret_file")));
    take(jwt.and_then(|j| j.get("jwks_file")));
    files
}

/// Parse and compile config text, reporting every problem found, in file order.
pub fn parse(text: &str) -> Result<Settings, Vec<Problem>> {
    parse_as(text, compile::Role::Live)
}

/// `parse`, compiling the text as a live config or as a candidate.
fn parse_as(text: &str, role: compile::Role) -> Result<Settings, Vec<Problem>> {
    let (raw, mut problems) = raw::read(text);
    let compiled = raw.map(|raw| compile::compile(&raw, role));
    match compiled {
        Some(Ok(mut settings)) if problems.is_empty() => {
            text.clone_into(&mut settings.source);
            return Ok(settings);
        }
        Some(Err(more)) => problems.extend(more),
        Some(Ok(_)) | None => {}
    }
    Err(locate_all(text, problems))
}

/// `problems` with their exact field paths and positions in `text`, in file order.
fn locate_all(text: &str, mut problems: Vec<Problem>) -> Vec<Problem> {
    let locations = locate::Locations::index(text);
    for p in &mut problems {
        if let Some((under, key)) = p.path.split_once('\u{0}') {
            let exact = locations.key_under(under, key);
            p.path = exact.unwrap_or_else(|| {
                if under.is_empty() {
                    key.to_owned()
                } else {
                    format!("{under}.{key}")
                }
            });
        }
        if p.at.is_none() {
            p.at = locations.find(&p.path);
        }
    }
    problems.sort_by_key(|p| p.at.unwrap_or((usize::MAX, 0)));
    problems
}
