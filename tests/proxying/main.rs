//! Forwarding: routing, upstream rewrite, WebSocket, legacy backends (thread-per-connection ones under a cap too), upstream health and capacity, TLS.
//!
//! One test binary per area: each file below was a binary of its own, and linking them
//! apart was most of the suite's build time.
#![allow(clippy::disallowed_types)]
// std's Instant: tests and benchmarks time the real world

// A test is one scenario read top to bottom: its length is the scenario's.
#![allow(clippy::too_many_lines)]

#[path = "../common/mod.rs"]
mod common;

mod capacity;
mod forwarding;
mod grpc;
mod legacy_backends;
mod pinned_workers;
mod routing;
mod spill;
mod tls;
mod upstream_health;
mod websocket;
