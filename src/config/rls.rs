//! The envoyproxy/ratelimit files `rls.config` names, read and compiled beside the config:
//! a file, or every `*.yaml` and `*.yml` of a directory, each a domain.

use std::path::{Path, PathBuf};

use super::settings::{DomainSpec, LimiterSettings};
use super::{ConfigError, Problem};

/// The path `rls.config` names, resolved against the directory of the config at `config`.
pub fn resolve(config: &Path, named: &str) -> PathBuf {
    let named = Path::new(named);
    match config.parent() {
        Some(dir) if named.is_relative() => dir.join(named),
        _ => named.to_path_buf(),
    }
}

/// The files at `path`: itself, or a directory's YAML files in name order.
pub fn files(path: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let unreadable = |e: std::io::Error| error(path, format!("cannot read it: {e}"), None);
    if !path.is_dir() {
        std::fs::metadata(path).map_err(unreadable)?;
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(unreadable)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    Ok(files)
}

/// Every domain of the files at `path`, compiled under `limiter`: the first file with
/// problems fails it all, each problem located in that file.
pub fn load(path: &Path, limiter: &LimiterSettings) -> Result<Vec<DomainSpec>, ConfigError> {
    let mut domains: Vec<DomainSpec> = Vec::new();
    for file in files(path)? {
        let text = std::fs::read_to_string(&file)
            .map_err(|e| error(&file, format!("cannot read the file: {e}"), None))?;
        let mut domain = super::compile::rls_domain(&text, limiter).map_err(|problems| {
            let at = super::locate::Locations::index(&text);
            ConfigError {
                file: file.display().to_string(),
                problems: (problems.into_iter())
                    .map(|p| Problem {
                        at: p.at.or_else(|| at.find(&p.path)),
                        ..p
                    })
                    .collect(),
            }
        })?;
        if let Some(first) = domains.iter().find(|d| d.domain == domain.domain) {
            let message = format!(
                "domain `{}` is already defined in {} (a domain is one file)",
                domain.domain,
                first.file.display()
            );
            let at = super::locate::Locations::index(&text).find("domain");
            return Err(error(&file, message, at));
        }
        domain.file = file;
        domains.push(domain);
    }
    Ok(domains)
}

fn error(file: &Path, message: String, at: Option<(usize, usize)>) -> ConfigError {
    ConfigError {
        file: file.display().to_string(),
        problems: vec![Problem {
            path: String::new(),
            message,
            at,
        }],
    }
}
