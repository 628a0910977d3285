# shellcheck shell=bash
# benches/load.sh floor: the hyper floor. nginx, the bare hyper proxy (examples/bare_hyper_proxy.rs:
# hyper and tokio alone, none of tollgate's work) and tollgate, each forwarding to the same
# backend, with the CPU each spends per request: how much of tollgate's gap to nginx is hyper's
# and how much is tollgate's own. Sourced by benches/load.sh, with benches/load/lib.sh.
#
# Starts on 127.0.0.1 only the backend and nginx of `compare` (scenario 1's config: `limit_req`
# never reached), and builds the release binary and example when missing. ROUNDS times, each
# round starting with the next proxy, each proxy afresh. About ROUNDS * 3 * (WARMUP + DURATION
# + 1) seconds.

help_floor() {
    cat <<'TXT'
floor              nginx, the bare hyper proxy (examples/bare_hyper_proxy.rs) and tollgate, each
                   forwarding (compare's scenario 1), ROUNDS times in turn: req/s, p99 and CPU
                   per request (nginx: its workers together), and the ratios between them.
    ROUNDS [3]  DURATION [5]  WARMUP [1]  CONNECTIONS [64]  THREADS [2]
    TOLLGATE_HEADERS [true]  KEEP_TMP [0]  (as for compare)
    TOLLGATE_BIN   the tollgate binary [target/release/tollgate, built when missing or stale]
    BARE_BIN       the bare hyper proxy [target/release/examples/bare_hyper_proxy, built so]
TXT
}

run_floor() {
    [ $# -eq 0 ] || usage_error "benches/load.sh floor   (no arguments; benches/load.sh help floor)"
    ROUNDS=${ROUNDS:-3}
    client_defaults 5 1
    need nginx wrk curl python3 ss
    start_run
    tollgate_binary
    release_binary BARE BARE_BIN target/release/examples/bare_hyper_proxy \
        "examples crates Cargo.toml Cargo.lock" --example bare_hyper_proxy
    start_backend
    rounds "floor_nginx floor_bare floor_tollgate"
    ratio "bare hyper/nginx" forwarded "bare hyper" forwarded nginx
    ratio "tollgate/nginx" forwarded tollgate forwarded nginx
    ratio "tollgate/bare hyper" forwarded tollgate forwarded "bare hyper"
    echo "tollgate: $TOLLGATE_SOURCE"
    echo "bare hyper: $BARE_SOURCE"
    echo
    report
}

floor_nginx() {
    start_nginx floor-nginx "${FWD_NGINX[@]}"
    measure_wrk forwarded nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/"
    stop "$NGINX_PID"
}
floor_bare() {
    local port pid
    port=$(free_port)
    spawn floor-bare "$BARE" "127.0.0.1:$port" "127.0.0.1:$BACKEND_PORT"
    pid=$SPAWNED
    wait_port "$port" "$pid" "the bare hyper proxy"
    measure_wrk forwarded "bare hyper" "$pid" "http://127.0.0.1:$port/"
    stop "$pid"
}
floor_tollgate() {
    tollgate_measures floor-tollgate "$LOCAL" "${FWD_TOLLGATE[@]}" measure_wrk forwarded tollgate
}
