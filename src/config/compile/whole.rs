//! The rules that span sections of the file (the live config's), and a candidate's one rule.

use ipnet::IpNet;

use super::Problems;
use crate::config::file;
use crate::config::settings::Listener;

/// The live config's rules that span sections; a candidate's one rule.
pub(super) fn role_checks(
    raw: &file::File,
    live: bool,
    listeners: &[Listener],
    trusted: &[IpNet],
    p: &mut Problems,
) {
    if live {
        whole_file_checks(raw, listeners, trusted, p);
    } else if raw.candidate.is_some() {
        p.add(
            "candidate",
            "a candidate config cannot name a candidate of its own",
        );
    }
}

/// Rules that span sections of the file.
fn whole_file_checks(
    raw: &file::File,
    listeners: &[Listener],
    trusted: &[IpNet],
    p: &mut Problems,
) {
    if raw.max_inflight == Some(0) {
        p.add("max_inflight", "must be at least 1");
    }
    if trusted.is_empty() && raw.listeners.iter().any(|l| l.proxy_protocol) {
        let i = raw
            .listeners
            .iter()
            .position(|l| l.proxy_protocol)
            .unwrap_or(0);
        let i = raw.positions.listeners.get(i).copied().unwrap_or(i);
        p.add(
            format!("listeners[{i}].proxy_protocol"),
            "needs `trusted_proxies`: PROXY headers are accepted only from them",
        );
    }
    // Broken listener items were reported already; only a file with none asks for one.
    let front = !listeners.is_empty() || !raw.listeners.is_empty() || raw.rls.is_some();
    if !front && raw.positions.listeners.is_empty() {
        p.add(
            "listeners",
            "at least one listener is needed, as in `- address: 0.0.0.0:8000` (or `rls:` for a pure rate limit service)",
        );
    }
}
