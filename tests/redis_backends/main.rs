//! Limits over real redis-server processes: single, Cluster, Sentinel, TLS, fleets, faults.
//!
//! One test binary per area: each file below was a binary of its own, and linking them
//! apart was most of the suite's build time.
#![allow(clippy::disallowed_types)]
// std's Instant: tests and benchmarks time the real world

// A test is one scenario read top to bottom: its length is the scenario's.
#![allow(clippy::too_many_lines)]

#[path = "../common/mod.rs"]
mod common;

mod faults_redis;
mod fleet;
mod leasing;
mod redis_cluster;
mod redis_limiter;
mod redis_sentinel;
mod redis_tls;
mod redis_tls_files;
mod rls;
