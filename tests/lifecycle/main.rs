//! The process over time: reload, shutdown, and faults of buckets, header reads, reloads, shutdown.
//!
//! One test binary per area: each file below was a binary of its own, and linking them
//! apart was most of the suite's build time.
#![allow(clippy::disallowed_types)]
// std's Instant: tests and benchmarks time the real world

// A test is one scenario read top to bottom: its length is the scenario's.
#![allow(clippy::too_many_lines)]

#[path = "../common/mod.rs"]
mod common;

mod faults_buckets;
mod faults_header_read;
mod faults_reload;
mod faults_shutdown;
mod ports;
mod reload;
mod shutdown;
