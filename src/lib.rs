//! tollgate: a reverse proxy that enforces rate limits at the edge.
pub mod identity;
pub mod limiter;
