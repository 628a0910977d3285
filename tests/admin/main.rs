//! The admin listener: health, metrics, API, operators' bans, dashboard, observability, access log.
//!
//! One test binary per area: each file below was a binary of its own, and linking them
//! apart was most of the suite's build time.
#![allow(clippy::disallowed_types)]
// std's Instant: tests and benchmarks time the real world

// A test is one scenario read top to bottom: its length is the scenario's.
#![allow(clippy::too_many_lines)]

#[path = "../common/mod.rs"]
mod common;

mod access_log;
mod admin;
mod admin_api;
mod control;
mod dashboard;
mod observability;
mod traces;
