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
pub mod schema;
pub mod settings;
pub mod values;
pub(crate) mod yaml;

use std::fmt;
use std::path::Path;

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

/// Read, parse and compile the file at `path`.
pub fn load(path: &Path) -> Result<Settings, ConfigError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: name.clone(),
        problems: vec![Problem {
            path: String::new(),
            message: format!("cannot read the file: {e}"),
            at: None,
        }],
    })?;
    let digest = inputs_digest(&text);
    let mut settings = parse(&text).map_err(|problems| ConfigError {
        file: name,
        problems,
    })?;
    settings.inputs_digest = digest;
    Ok(settings)
}

/// A digest of config text and of the certificate, key and CA files it names, as they are on
/// disk now.
pub fn inputs_digest(text: &str) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
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
    *h.finalize().as_bytes()
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
    let (raw, mut problems) = raw::read(text);
    let compiled = raw.map(|raw| compile::compile(&raw));
    match compiled {
        Some(Ok(mut settings)) if problems.is_empty() => {
            text.clone_into(&mut settings.source);
            return Ok(settings);
        }
        Some(Err(more)) => problems.extend(more),
        Some(Ok(_)) | None => {}
    }
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
    Err(problems)
}
