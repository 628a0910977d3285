//! The edge: request framing, headers, hosts, paths, hardening, fuzz regressions, HTTP/2 attacks, PROXY headers.
//!
//! One test binary per area: each file below was a binary of its own, and linking them
//! apart was most of the suite's build time.
#![allow(clippy::disallowed_types)]
// std's Instant: tests and benchmarks time the real world

// A test is one scenario read top to bottom: its length is the scenario's.
#![allow(clippy::too_many_lines)]

#[path = "../common/mod.rs"]
mod common;

mod edge_framing;
mod edge_headers;
mod edge_host;
mod edge_paths;
mod fuzz_regressions;
mod h2_attacks;
mod hardening;
mod proxy_protocol;
mod shared;
