//! `tollgate explain`: ask a running proxy's admin API, or explain from the config file alone
//! (fresh state: every bucket full, no ban, nothing in flight).

use std::path::{Path, PathBuf};

use super::{explain, render, Explanation, Query};
use crate::config::settings::Backend;

/// What `tollgate explain` was asked.
#[derive(Debug, Clone, Default)]
pub struct Args {
    /// The admin listener's URL (`http://127.0.0.1:9901`); `None`: the config alone.
    pub admin: Option<String>,
    /// The file holding the admin API's token (`admin.token_file`).
    pub token_file: Option<PathBuf>,
    pub query: Query,
    /// Print the JSON answer as it is.
    pub json: bool,
}

/// The output of `tollgate explain` for `args`, the config at `config` used without `--admin`.
pub fn run(config: &Path, args: &Args) -> Result<String, String> {
    let (explanation, raw) = match &args.admin {
        Some(url) => remote(url, args)?,
        None => from_config(config, &args.query)?,
    };
    Ok(if args.json {
        let mut raw = raw;
        if !raw.ends_with('\n') {
            raw.push('\n');
        }
        raw
    } else {
        render(&explanation)
    })
}

/// Ask the proxy whose admin listener is at `url`.
fn remote(url: &str, args: &Args) -> Result<(Explanation, String), String> {
    let file = args
        .token_file
        .as_ref()
        .ok_or("--admin needs --token-file: the file admin.token_file names")?;
    let token = std::fs::read_to_string(file)
        .map_err(|e| format!("{}: {e}", file.display()))?
        .trim()
        .to_owned();
    let endpoint = format!("{}/api/v1/explain", url.trim_end_matches('/'));
    let full = format!("{endpoint}?{}", args.query.to_query_string());
    let bearer = format!("Bearer {token}");
    let (status, body) = crate::probe::get(&full, &[("Authorization", &bearer)])?;
    if status != 200 {
        // A problem+json answer says why in `detail`.
        let detail = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("detail")?.as_str().map(str::to_owned))
            .unwrap_or(body);
        return Err(format!("{endpoint}: {status}: {}", detail.trim()));
    }
    let explanation =
        serde_json::from_str(&body).map_err(|e| format!("{endpoint}: not an explanation ({e})"))?;
    Ok((explanation, body))
}

/// Explain from the config file alone, in process, with fresh buckets.
fn from_config(config: &Path, query: &Query) -> Result<(Explanation, String), String> {
    let mut settings = crate::config::load(config).map_err(|e| e.to_string())?;
    // The proxies' Redis is not asked: this is what the config alone says.
    let redis = matches!(settings.limiter.backend, Backend::Redis(_));
    settings.limiter.backend = Backend::Local;
    // Nor a trace collector: nothing is served.
    settings.traces = None;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    rt.block_on(async {
        let workers = crate::workers::Workers::new(1);
        let metrics = crate::metrics::Metrics::new();
        let runtime = crate::runtime::Runtime::build(settings, None, &workers, &metrics)
            .map_err(|e| e.to_string())?;
        let source = format!(
            "from the config alone ({}): buckets are full, no bans, nothing in flight",
            config.display()
        );
        let now = crate::limiter::Clock::new().now();
        let mut e = explain(&runtime, None, query, now, source).await?;
        if redis {
            "redis (not asked)".clone_into(&mut e.backend);
        }
        let raw = serde_json::to_string_pretty(&e).map_err(|e| e.to_string())?;
        Ok((e, raw))
    })
}
