# shellcheck shell=bash
# benches/load.sh memory: memory of the in-process limiter, RSS with KEYS distinct
# client buckets held, and after they are evicted. Sourced by benches/load.sh, with
# benches/load/lib.sh.
#
# tollgate answers itself (a `respond` route), so nothing else runs. Sends requests with KEYS
# distinct X-API-Key values (benches/compare/keys.lua) for SEND seconds (long enough to go
# through every key once), reads tollgate's RSS and its tollgate_local_buckets gauge, then waits
# for every bucket to be full again (rate 1/min, burst 1: 60 s after its request) and for the
# sweep, and reads them again. Takes about SEND + 90 seconds.

help_memory() {
    cat <<'TXT'
memory             RSS of tollgate holding KEYS client buckets (a `respond` route, a 1/min limit
                   per X-API-Key), after they are evicted (75 s later), and after a little
                   traffic; with the tollgate_local_buckets gauge. About SEND + 90 s.
    KEYS [1000000]  distinct X-API-Key values    SEND [25]  seconds of wrk -t2 -c64 sending them
    TOLLGATE_BIN    the tollgate binary [target/release/tollgate, built when missing or stale]
    KEEP_TMP [0]
TXT
}

run_memory() {
    [ $# -eq 0 ] || usage_error "benches/load.sh memory   (no arguments; benches/load.sh help memory)"
    KEYS=${KEYS:-1000000}
    export KEYS # for keys.lua
    SEND=${SEND:-25}
    need wrk curl python3 ss
    start_run
    tollgate_binary
    local port admin pid
    port=$(free_port)
    admin=$(free_port)
    cat >"$TMP/memory.yaml" <<YAML
listeners:
  - address: 127.0.0.1:$port
    max_requests_per_connection: 100000000
admin:
  address: 127.0.0.1:$admin
limiter:
  backend: local
  local:
    max_buckets: 2000000
    # every key comes from 127.0.0.1: no per-address cap
    max_buckets_per_peer: 2000000
routes:
  - name: all
    match: { path_prefix: / }
    respond: { status: 200, body: "ok\n" }
    limits:
      - { name: per-key, rate: 1/min, burst: 1, key: ["header:X-API-Key"] }
YAML
    spawn memory "$TOLLGATE" run --config "$TMP/memory.yaml" --access-log false --log-level warn
    pid=$SPAWNED
    wait_port "$port" "$pid" tollgate
    wait_port "$admin" "$pid" "tollgate's admin listener"
    echo "start:    RSS $(memory_mb "$pid" VmRSS) MB"
    log "sending $KEYS keys for ${SEND}s"
    bounded $((SEND + 60)) "$TMP/wrk.txt" wrk -t2 -c64 -d"${SEND}s" -s "$CONF/keys.lua" \
        "http://127.0.0.1:$port/" || die "wrk failed: $(cat "$TMP/wrk.txt")"
    sleep 6 # the gauge is refreshed by the sweep
    echo "held:     RSS $(memory_mb "$pid" VmRSS) MB, buckets $(memory_buckets "$admin")" \
        "(peak RSS $(memory_mb "$pid" VmHWM) MB)"
    echo "          $(grep -E 'Requests/sec' "$TMP/wrk.txt")"
    log "waiting 75 s for every bucket to be full again and swept"
    sleep 75
    echo "evicted:  RSS $(memory_mb "$pid" VmRSS) MB, buckets $(memory_buckets "$admin")"
    # Freed memory goes back to the allocator of the thread that allocated it, which hands it to
    # the OS when that thread next works: a little traffic shows it.
    bounded 30 /dev/null wrk -t2 -c8 -d2s "http://127.0.0.1:$port/"
    sleep 6
    echo "traffic:  RSS $(memory_mb "$pid" VmRSS) MB, buckets $(memory_buckets "$admin")"
    stop "$pid"
    check_log memory
    [ ! -s "$NOTES" ] || cat "$NOTES"
}

# memory_mb PID FIELD: rss_kb in MB.
memory_mb() { awk -v kb="$(rss_kb "$1" "$2")" 'BEGIN {printf "%.1f", kb / 1024}'; }
# memory_buckets ADMIN_PORT: the tollgate_local_buckets gauge.
memory_buckets() {
    curl -s --max-time 5 "http://127.0.0.1:$1/metrics" | awk '/^tollgate_local_buckets\{/ {print $2}'
}
