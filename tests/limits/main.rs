//! Limits end to end: token buckets, identities, JWT, quotas, windows, bans, concurrency, the
//! candidate config.
//!
//! One test binary per area: each file below was a binary of its own, and linking them
//! apart was most of the suite's build time.
#![allow(clippy::disallowed_types)]
// std's Instant: tests and benchmarks time the real world

// A test is one scenario read top to bottom: its length is the scenario's.
#![allow(clippy::too_many_lines)]

#[path = "../common/mod.rs"]
mod common;

mod bans;
mod candidate;
mod concurrency;
mod count_when;
mod identity;
mod jwt;
mod limits;
mod quotas;
mod rls;
mod settled;
mod windows;
