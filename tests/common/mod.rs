//! Helpers shared by the integration tests: the proxy served in-process on `127.0.0.1:0`
//! (`TestProxy`), the real binary for what only a process has (`BinaryProxy`), a real HTTP/1.1
//! backend that records what reached it (`MockUpstream`), and HTTP clients.
//!
//! Every test binary compiles this module and uses a different part of it.
#![allow(dead_code)]

pub mod client;
pub mod inproc;
pub mod otlp;
pub mod proxy;
pub mod raw;
pub mod redis;
pub mod rls;
pub mod upstream;

#[allow(unused_imports)]
pub use client::{Http, Reply};
#[allow(unused_imports)]
pub use inproc::TestProxy;
#[allow(unused_imports)]
pub use proxy::{check, BinaryProxy};
#[allow(unused_imports)]
pub use raw::{Raw, Resp};
#[allow(unused_imports)]
pub use upstream::{refused_addr, MockUpstream, Seen};

/// A config with one listener on a free port, `extra` appended as is (top-level YAML keys).
pub fn config(extra: &str) -> String {
    format!("listeners:\n  - address: 127.0.0.1:0\n{extra}")
}

/// An `upstreams:` section with one upstream `app` pointing at `target`.
pub fn upstream_app(target: std::net::SocketAddr, timeout: &str) -> String {
    format!(
        "upstreams:\n  app:\n    targets: [{target}]\n    connect_timeout: 1s\n    timeout: {timeout}\n"
    )
}

/// The value of the sample `series` (name and labels exactly as exposed) in a text scrape.
pub fn sample<T: std::str::FromStr>(scrape: &str, series: &str) -> T {
    find_sample(scrape, series).unwrap_or_else(|| panic!("no `{series}` in the scrape:\n{scrape}"))
}

/// `sample`, or `None` when the scrape has no such series (or its value does not parse).
pub fn find_sample<T: std::str::FromStr>(scrape: &str, series: &str) -> Option<T> {
    scrape.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// Poll `condition` every 10 ms until it holds (true) or `timeout` passes (false): what a test
/// waits on instead of sleeping for a guessed time.
pub async fn eventually<F: std::future::Future<Output = bool>>(
    timeout: std::time::Duration,
    mut condition: impl FnMut() -> F,
) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if condition().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
