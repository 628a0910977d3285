//! tollgate: a reverse proxy that enforces rate limits at the edge.
//!
//! # Layout
//! The request's path is the architecture: `server` accepts, `proxy::handle` takes the live
//! `runtime` once and runs `screen`, the route table, `identity`, `limiter`, then
//! `forward::send` or a response of its own.
//!
//! ```text
//! server ─► proxy::handle ─► screen ─► Runtime::find ─► identity ─► limiter::decide ─► forward::send
//!             │ (one runtime per request)                               │ denied
//!             └──────────── response::from_error ◄───────────────────────┴─► response::too_many_requests
//! reload (file watch, SIGHUP) ─► config::load ─► Runtime::build(settings, previous) ─► State::swap
//! ```
//!
//! Modules in layers, from the bottom up: a module uses only modules of its own layer and of
//! the layers above it in this list, and no two modules use each other (`tests/structure`
//! checks both, inline `crate::` paths included).
//! - `log_gate`, `sharded`, `io`, `workers`, `probe`, `header_value`, `intern`, `tls`, `proxy_protocol`, `capacity`:
//!   leaves, using no other module. One log line a second for a
//!   failure that repeats; per-thread counters; socket wrappers; the worker set; the container
//!   health probe; header values made in one allocation of their size; text kept for the
//!   process's life, once per value, for header values every request clones; rustls configs;
//!   the PROXY header; an upstream's capacity (`capacity`: per-target caps, fixed or learned
//!   from latency, and the queue fair across identities and priorities).
//! - `buffer`, `request_id`, `telemetry`: bodies held in memory and temporary files (request
//!   buffering, response read-ahead); the `X-Request-Id` kept or made; a request's trace
//!   context, its sampling, its spans assembled (`telemetry::span`) and the OTLP exporter they
//!   are queued to (`telemetry::export`).
//! - `body`: request bodies with their limits.
//! - `error`: request-path errors.
//! - `screen`: request screening (`host`: Host and `:authority` validated and canonicalised,
//!   `path`: the path normalised and the spellings backends read differently refused).
//! - `identity`: the client address and the identity digest a limit counts under
//!   (`identity::Arrival`: one request's parts, made once and read by the live limits, the
//!   candidate's and `explain`; `identity::jwt`: claims of a verified bearer JWT).
//! - `access_log`: the access log (lines formatted per worker thread, written by a thread of
//!   its own), and a request's completed entry made into its trace's spans (`access_log::span`).
//! - `route`: the route table (match conditions and their path index); `find` is pure.
//! - `config`: the YAML file (one parser, serde-saphyr), validated and compiled into plain
//!   `Settings`; nothing live. Its JSON Schema is derived from the same types.
//! - `limiter`, `pool`, `forward`, `metrics`, `response`: the limiter by concept, then by
//!   store: the token-bucket arithmetic (`limiter::gcra`), its time (`limiter::clock`),
//!   calendar quotas and fixed, sliding and exact windows (`limiter::window`; the exact logs
//!   in `local::log`), escalating bans (`ban`), the per-request `Decision`, the in-process and
//!   Redis stores behind one `store::Store` trait for buckets and concurrency slots (the failure
//!   policy in `decide`, for slots in `decide::slots`), a
//!   read-only look at one identity's state (`peek`), a busy identity's tokens leased from its
//!   Redis bucket and spent here (`leasing`, decided in `decide::leased`), limits that learn
//!   from the response (`count_when` in `decide::counted`, costs settled in `decide::settled`,
//!   a bucket's debt in `local::settle`), limits built without
//!   a config for tests (`limiter::test_util`); in `limiter::redis`
//!   the connection (`conn`), the bucket script's wire format (`wire`, beside `bucket.lua`),
//!   a Sentinel failover followed at the promotion (`sentinel`); slots of requests in flight
//!   (`limiter::concurrency`, their Redis leases in `limiter::redis::slots`) held by a guard
//!   the response body carries; keep-alive upstream connections (a capped upstream's shared
//!   by the workers and counted against its cap, `pool::open`; HTTP/2 ones multiplexed,
//!   `pool::h2`); target choice (load
//!   balancing, passive and active health), retries, the upstream rewrite, streaming, an
//!   attempt at a capped upstream that holds its slot until the backend is done
//!   (`forward::held`),
//!   WebSocket tunnels; the Prometheus registry, served in the format the scraper asks for;
//!   429 and the error responses (in gRPC's form for a gRPC call, `response::grpc`).
//! - `runtime`, `candidate`: the live config built from `Settings` plus the previous runtime
//!   (buckets, pools, the Redis client and metric handles reused where their spec is
//!   unchanged); the `candidate:` config's routes and limits, with buckets of their own,
//!   decided beside the live ones on every request and counted, never enforced.
//! - `control`: operators' bans and overrides from the admin API, enforced on every replica
//!   (kept in Redis and polled with `backend: redis`, in memory otherwise).
//! - `state`: what every request shares (the live runtime, clock, metrics, workers).
//! - `proxy`: one request through the stages (`pipeline` lists them; `proxy::limits` and
//!   `proxy::upstream` hold the limit and forwarding stages, `proxy::record` what a finished
//!   request leaves: counts, its log entry and trace), errors turned into responses in one
//!   place.
//! - `explain`, `rls`: what the stages would do with a request now, read without counting it
//!   (`limiter::peek`), for the admin API and `tollgate explain`; Envoy's rate limit service
//!   (`rls::pb` generated from `proto/`), each call's descriptors matched to their domain's
//!   rules (`limiter::descriptors`) and decided as a route's limits are.
//! - `server`, `admin`, `reload`: accept and balance, the connection, the request-line watch
//!   that answers `414`, the watchdog; the admin listener (`admin::dashboard`, the live
//!   dashboard's page and data, fed by `admin::sampler` into `metrics::history` and by 429s
//!   into `metrics::top`); build then swap.
//! - `simulate`: a JSON access log replayed through a config's routes and limits, with the
//!   limiter's own arithmetic on the log's clock (`tollgate simulate`).
//! - `app`, `cli`: wiring (`start` serves in-process until a shutdown future resolves, `run`
//!   is the binary's); the command line (`run`, `check`, `health`, `explain`, `schema`,
//!   `simulate`).
//!
//! The binary's global allocator (mimalloc, asked without an alignment where none is needed) is
//! the crate `tollgate-alloc` in `crates/alloc`, the one part of tollgate with `unsafe`.
pub mod access_log;
pub(crate) mod admin;
pub mod app;
pub(crate) mod body;
pub(crate) mod buffer;
pub mod candidate;
pub mod capacity;
pub mod cli;
pub mod config;
pub mod control;
pub(crate) mod error;
pub mod explain;
pub(crate) mod forward;
pub(crate) mod header_value;
pub mod identity;
pub(crate) mod intern;
pub(crate) mod io;
pub mod limiter;
pub(crate) mod log_gate;
pub(crate) mod metrics;
pub(crate) mod pool;
pub mod probe;
pub mod proxy;
pub(crate) mod proxy_protocol;
pub mod reload;
pub(crate) mod request_id;
pub(crate) mod response;
pub mod rls;
pub(crate) mod route;
pub(crate) mod runtime;
pub mod screen;
pub mod server;
pub mod sharded;
pub mod simulate;
pub mod state;
pub mod telemetry;
pub(crate) mod tls;
pub(crate) mod workers;

/// A route has a handful of limits: per-request lists of them live on the stack.
pub type Small<T> = smallvec::SmallVec<[T; 4]>;

/// A future on the heap, built there rather than moved there. `Box::pin(fut)` builds the future
/// on the stack, allocates, then copies all of it: every byte of its largest state, not just
/// the arguments of the call. Allocating first and building the future straight into the
/// allocation skips that copy; boxing is kept off the hot path otherwise.
#[inline]
pub(crate) fn boxed<F>(make: impl FnOnce() -> F) -> std::pin::Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), make()))
}
