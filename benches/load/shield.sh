# shellcheck shell=bash
# benches/load.sh shield: a backend's capacity behind tollgate's max_in_flight (fixed and
# adaptive) and behind HAProxy's maxconn + timeout queue. Sourced by benches/load.sh, with
# benches/load/lib.sh.
#
# The scenario itself (the backend with 8 workers and a 20 ms service time, 200 clients of 10
# identities, one sending 10x each other, and the report) is benches/shield.rs, run as a cargo
# bench against the release binary. About 50 s.

help_shield() {
    cat <<'TXT'
shield             a backend with 8 workers and 20 ms per request, offered 475 req/s by 200
                   clients of 10 identities (one sends 10x each other), behind tollgate
                   (max_in_flight: 8, then adaptive) and HAProxy (maxconn 8 + timeout queue):
                   backend concurrency, goodput, light and heavy identities' latency and 503s,
                   Jain's index of the light identities' throughput.
    SHIELD_SECONDS [10]  measured seconds per proxy (after 3 s of warm-up)
    PEERS [haproxy]  empty: tollgate only
    TOLLGATE_BIN   the tollgate binary [target/release/tollgate, built when missing or stale]
TXT
}

run_shield() {
    [ $# -eq 0 ] || usage_error "benches/load.sh shield"
    need curl
    [[ " ${PEERS-haproxy} " != *" haproxy "* ]] || need haproxy
    start_run
    tollgate_binary
    (cd "$ROOT" && TOLLGATE_BIN=$TOLLGATE PEERS=${PEERS-haproxy} SHIELD_SECONDS=${SHIELD_SECONDS:-10} \
        cargo bench --bench shield)
}
