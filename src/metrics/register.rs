//! Every metric's name, help text and unit as registered, in one place: what `/metrics`
//! exposes is read here.

use prometheus_client::metrics::info::Info;

use super::Metrics;

impl Metrics {
    /// Requests, limits, upstreams and the config's series (and, through the calls at the
    /// end, the rest).
    pub(super) fn register(&mut self) {
        let r = self.registry.sub_registry_with_prefix("tollgate");
        r.register(
            "requests",
            "Requests by route and status code",
            self.requests.clone(),
        );
        r.register(
            "request_duration_seconds",
            "Time from a request's arrival to its response head, by route",
            self.durations.clone(),
        );
        r.register(
            "limit_decisions",
            "Limit decisions by route, limit and outcome",
            self.decisions.clone(),
        );
        r.register(
            "limiter_backend_seconds",
            "Time requests spent in the limit decision with the Redis backend (negative-cache answers included)",
            self.backend_seconds.clone(),
        );
        r.register(
            "upstream_seconds",
            "Time to the upstream's response head",
            self.upstream_seconds.clone(),
        );
        r.register(
            "upstream_errors",
            "Upstream failures by kind",
            self.upstream_errors.clone(),
        );
        r.register(
            "local_buckets",
            "In-process buckets held, by limit",
            self.buckets.clone(),
        );
        r.register(
            "local_bucket_overflows",
            "Checks counted in a limit's overflow bucket because its map was full",
            self.overflowed.clone(),
        );
        r.register(
            "local_bucket_peer_overflows",
            "New identities counted in their address's overflow bucket (at its cap, or the map full)",
            self.peer_overflowed.clone(),
        );
        r.register(
            "decided_without_backend",
            "Requests whose limits were decided without the shared store",
            self.without_backend.clone(),
        );
        self.targets.register(r);
        self.register_serving();
        self.registry.sub_registry_with_prefix("tollgate").register(
            "trace_spans",
            "Trace spans by what became of them: exported, dropped (the exporter's queue was full) or failed (the collector did not take them)",
            crate::telemetry::export::spans(),
        );
        self.register_redis();
        self.register_config();
    }

    /// Connections, overload, memory, buffering and the access log.
    fn register_serving(&mut self) {
        let r = self.registry.sub_registry_with_prefix("tollgate");
        r.register(
            "open_connections",
            "Open downstream connections",
            self.open_connections.clone(),
        );
        r.register(
            "worker_connections",
            "Open downstream connections by the worker thread serving them",
            self.worker_connections.clone(),
        );
        r.register(
            "connections_refused",
            "Connections closed at once because a listener was at max_connections",
            self.connections_refused.clone(),
        );
        r.register(
            "overloaded",
            "Requests answered 503 because max_inflight requests were in flight",
            self.overloaded.clone(),
        );
        r.register(
            "memory_over_budget",
            "1 while resident memory is past max_rss (new requests get 503, connections are refused)",
            self.memory_over.clone(),
        );
        r.register(
            "memory_refused_requests",
            "Requests answered 503 because resident memory was past max_rss",
            self.memory_refused_requests.clone(),
        );
        r.register(
            "memory_refused_connections",
            "Connections closed at once because resident memory was past max_rss",
            self.memory_refused_connections.clone(),
        );
        r.register(
            "buffer_spilled_bytes",
            "Bytes of buffered bodies in temporary files now (buffering.max_spill caps them)",
            self.spill.bytes.clone(),
        );
        r.register(
            "buffer_spill_unwritable",
            "Responses streamed with backpressure because temp_dir refused a file or a write",
            self.spill.unwritable.clone(),
        );
        r.register(
            "buffer_spill_capped",
            "Responses streamed with backpressure because buffering.max_spill bytes were in files",
            self.spill.capped.clone(),
        );
        r.register(
            "access_log_dropped_lines",
            "Access-log lines dropped because the writer could not keep up",
            crate::access_log::dropped_lines(),
        );
    }

    /// The Redis client's series.
    pub(super) fn register_bans(&mut self) {
        let r = self.registry.sub_registry_with_prefix("tollgate");
        r.register(
            "bans",
            "Bans begun (an identity's last strike), by route and limit",
            self.bans.clone(),
        );
        r.register(
            "banned_requests",
            "Requests refused by a ban, by route and limit",
            self.banned_requests.clone(),
        );
        r.register(
            "ban_lifts",
            "Bans seen lifted (the identity's first request after its ban), by route and limit",
            self.ban_lifts.clone(),
        );
        r.register(
            "admin_banned_requests",
            "Requests refused by an operator's ban (admin API), by route",
            self.admin_banned_requests.clone(),
        );
        r.register(
            "grpc_calls",
            "gRPC calls by route and gRPC status (the upstream's trailers, or tollgate's own answer)",
            self.grpc_calls.clone(),
        );
        r.register(
            "limit_units",
            "Units requests were charged once their response settled the cost (cost.from_response), by route and limit",
            self.limit_units.clone(),
        );
        r.register(
            "rls_descriptors",
            "Rate limit service descriptors by domain, rule and result (within_limit, near_limit, over_limit, shadow_mode)",
            self.rls_descriptors.clone(),
        );
    }

    pub(super) fn register_redis(&mut self) {
        let r = self.registry.sub_registry_with_prefix("tollgate");
        r.register(
            "redis_evicted_keys",
            "Keys Redis evicted since it started (INFO stats evicted_keys, read every 5 s)",
            self.redis_evicted_keys.clone(),
        );
        r.register(
            "redis_check_duration_seconds",
            "Time of limit checks sent to Redis, until answered or failed",
            self.redis_check_seconds.clone(),
        );
        r.register(
            "redis_errors",
            "Redis checks that failed (errors, timeouts, breaker open)",
            self.redis_errors.clone(),
        );
        r.register(
            "redis_timeouts",
            "Redis checks that hit the timeout",
            self.redis_timeouts.clone(),
        );
        r.register(
            "redis_calls",
            "Script calls sent to Redis",
            self.redis_calls.clone(),
        );
        r.register(
            "redis_negative_cache_hits",
            "Rejections answered from the negative cache without Redis",
            self.negative_hits.clone(),
        );
        r.register(
            "redis_leased_checks",
            "Checks admitted from a lease this replica holds, without asking Redis",
            self.leased_checks.clone(),
        );
        r.register(
            "redis_lease_tokens_returned",
            "Leased tokens handed back to Redis unused",
            self.lease_tokens_returned.clone(),
        );
        r.register(
            "redis_reconnects",
            "Redis connections replaced because their calls kept timing out or went out of step",
            self.redis_reconnects.clone(),
        );
        r.register(
            "redis_failovers",
            "Redis connections that followed a Sentinel failover to another master",
            self.redis_failovers.clone(),
        );
        r.register(
            "redis_breaker_open",
            "1 while the Redis circuit breaker is open",
            self.breaker_open.clone(),
        );
    }

    /// The build's and the live config's series.
    pub(super) fn register_config(&mut self) {
        let r = self.registry.sub_registry_with_prefix("tollgate");
        r.register(
            "config_reloads",
            "Config reloads by result",
            self.reloads.clone(),
        );
        r.register(
            "config_generation",
            "Generation of the live config (1 = as started)",
            self.generation.clone(),
        );
        let version = env!("CARGO_PKG_VERSION").to_owned();
        let commit = env!("TOLLGATE_COMMIT").to_owned();
        r.register(
            "build",
            "The version and commit of this tollgate binary",
            Info::new(vec![("version", version), ("commit", commit)]),
        );
        r.register(
            "config_hash",
            "Hash of the live config file (the first 48 bits of its BLAKE3 digest)",
            self.config_hash.clone(),
        );
        r.register(
            "config_last_reload_successful",
            "1 if the last config load (start or reload) succeeded, 0 if it failed",
            self.config_ok.clone(),
        );
        r.register(
            "config_last_reload_success_timestamp_seconds",
            "When the live config was loaded (at start or by the last successful reload)",
            self.config_loaded_at.clone(),
        );
        r.register(
            "tls_certificate_expiry_timestamp_seconds",
            "When a listener certificate expires (its notAfter), by listener and file",
            self.certificates.clone(),
        );
    }
}
