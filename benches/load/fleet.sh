# shellcheck shell=bash
# benches/load.sh fleet: the fleet model, N tollgate replicas sharing one tenant's limit over one
# redis-server and over a 3-master Redis Cluster, with and without `leasing: auto`. Sourced by
# benches/load.sh, with benches/load/lib.sh.
#
# The model itself (the replicas, the load, the Redis counters and the report) is
# benches/fleet.rs, run as a cargo bench against the release binary. About 2 minutes.

help_fleet() {
    cat <<'TXT'
fleet              N = 2, 8, 32 replicas (processes) share one tenant's limit (1000/s, burst
                   1000) over one redis-server and over a 3-master Cluster, with and without
                   `leasing: auto`, offered 3000 req/s spread over them: Redis script calls
                   and redis-server CPU per request, what one Redis core sustains at that CPU,
                   and the requests admitted against burst + rate x t and the leased bound.
    FLEET_SECONDS [4]     measured seconds per run
    FLEET_SIZES [2 8 32]  the numbers of replicas
    FLEET_OFFERED [3000]  req/s offered, all replicas together (800: within the limit)
    FLEET_HOLD [unset]    the leases' hold in seconds (`leasing: { hold: ... }`, sized as
                          `auto`); unset: `leasing: auto`, held 1 s
    TOLLGATE_BIN   the tollgate binary [target/release/tollgate, built when missing or stale]
TXT
}

run_fleet() {
    [ $# -eq 0 ] || usage_error "benches/load.sh fleet"
    need redis-server redis-cli
    start_run
    tollgate_binary
    (cd "$ROOT" && TOLLGATE_BIN=$TOLLGATE FLEET_SECONDS=${FLEET_SECONDS:-4} \
        FLEET_SIZES=${FLEET_SIZES:-2 8 32} FLEET_OFFERED=${FLEET_OFFERED:-3000} cargo bench --bench fleet)
}
