# shellcheck shell=bash
# benches/load.sh ab OLD NEW: an A/B of two tollgate binaries on this machine, which one costs
# less per request. Sourced by benches/load.sh, with benches/load/lib.sh.
#
# Starts on 127.0.0.1 only the backend of `compare`, then, ROUNDS times and alternating which
# goes first, each binary on scenario 1 (forwarded, the limit never reached) and scenario 2
# (rejected, every request answered 429): whether a change costs throughput. About
# ROUNDS * 4 * (WARMUP + DURATION + 1) seconds.

help_ab() {
    cat <<'TXT'
ab OLD NEW         two tollgate binaries, A (OLD) and B (NEW), alternating ROUNDS times on
                   compare's scenarios 1 (forwarded) and 2 (rejected): req/s, p99 and the
                   proxy's user and system CPU per request (which moves less with background
                   load than req/s), then B/A between the medians and round by round.
    ROUNDS [2]  DURATION [5]  WARMUP [1]  CONNECTIONS [64]  THREADS [2]
    TOLLGATE_HEADERS [true]  TOLLGATE_BUFFERING [unset]  KEEP_TMP [0]  (as for compare)
    ACCESS_LOG_A [false]  ACCESS_LOG_B [false]  each binary's --access-log: false, stderr,
                   stdout or `file` (a file in the run's temp dir). The same binary twice with
                   ACCESS_LOG_B=file measures what the access log costs.
    TRACES_A [off]  TRACES_B [off]  each binary's telemetry.traces sample_ratio (`1`,
                   `0.01`), exported over OTLP/HTTP to tests/fixtures/otlp/receiver.py taking
                   every batch unread. The same binary twice with TRACES_B=1 measures what
                   tracing costs.
TXT
}

run_ab() {
    [ $# -eq 2 ] || usage_error "benches/load.sh ab OLD_BINARY NEW_BINARY"
    ROUNDS=${ROUNDS:-2}
    client_defaults 5 1
    need nginx wrk curl python3 ss
    start_run
    copy_binary A "$1"
    copy_binary B "$2"
    start_backend
    start_otlp_sink
    rounds "ab_a ab_b"
    ratio "forwarded, B/A" forwarded B forwarded A
    ratio "rejected, B/A" rejected B rejected A
    echo "A: $A_SOURCE"
    echo "B: $B_SOURCE"
    echo
    report
}

# ab_run A|B: that binary forwarded, then rejected.
ab_run() {
    # shellcheck disable=SC2034 # start_tollgate's binary
    TOLLGATE=${!1}
    local access=ACCESS_LOG_$1
    # shellcheck disable=SC2034 # start_tollgate's --access-log
    ACCESS_LOG=${!access:-false}
    local traces=TRACES_$1
    # shellcheck disable=SC2034 # tollgate_config's top-level keys
    TOLLGATE_TOP=
    if [ "${!traces:-off}" != off ]; then
        # shellcheck disable=SC2034 # tollgate_config's top-level keys
        TOLLGATE_TOP="telemetry:
  traces: { endpoint: \"http://127.0.0.1:$OTLP_PORT\", sample_ratio: ${!traces} }"
    fi
    tollgate_measures "ab-$1-forwarded" "$LOCAL" "${FWD_TOLLGATE[@]}" measure_wrk forwarded "$1"
    tollgate_measures "ab-$1-rejected" "$LOCAL" "${REJ_TOLLGATE[@]}" measure_wrk rejected "$1"
}
ab_a() { ab_run A; }
ab_b() { ab_run B; }
