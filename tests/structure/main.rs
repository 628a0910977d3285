//! The source's own shape, checked: module layering as `src/lib.rs` documents it, no import
//! cycles (counting inline `crate::` paths), and the size of files and functions.
#![allow(clippy::disallowed_types)]
// std's Instant: tests and benchmarks time the real world

// A test is one scenario read top to bottom: its length is the scenario's.
#![allow(clippy::too_many_lines)]

mod layering;
mod sizes;

mod source;
