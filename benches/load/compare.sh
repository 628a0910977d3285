# shellcheck shell=bash
# benches/load.sh compare: tollgate against nginx (proxy_pass + limit_req) on this machine.
# Sourced by benches/load.sh, with benches/load/lib.sh.
#
# Starts on 127.0.0.1 only: a backend (nginx, 1 worker, `return 200 "ok\n"`), nginx as the
# rate-limiting proxy (2 workers), tollgate with the equivalent YAML, and redis-server for the
# Redis scenarios. Each proxy is started afresh for each scenario, so its peak RSS (VmHWM) is
# that scenario's. Runs wrk (HTTP/1.1), h2load (h2c) and h2load --h1 --rps (HTTP/1.1 at a fixed
# rate, scenarios 6 and 7) for a fixed time after a warm-up, prints one Markdown table with
# ratios, writes it to a results file, and stops every process it started (also on failure or
# Ctrl-C). See docs/performance.md for what each scenario measures.

help_compare() {
    cat <<'TXT'
compare            tollgate against nginx (proxy_pass + limit_req), every scenario: a Markdown
                   table with ratios, written to RESULTS. Scenarios (SCENARIOS names them):
                   baseline (the backend alone), forwarded (1), rejected (2), redis (3: one
                   redis-server, beside the local limiter), cluster (3c: a 3-master Redis
                   Cluster), slots (3d: a per-client and a `global` limit, two cluster slots per
                   request), keys (4: KEYS distinct X-API-Key values), h2 (5: h2c), fixed (6, 7:
                   HTTP/1.1 at a fixed rate, forwarded and rejected).
    DURATION [10]  seconds measured per run       WARMUP [2]   seconds of warm-up per run
    CONNECTIONS [64]  client connections          THREADS [2]  wrk/h2load threads
    H2_STREAMS [10]   concurrent streams per h2 connection (h2load -m)
    KEYS [100000]     distinct X-API-Key values in scenario 4
    TOLLGATE_HEADERS [true]  tollgate's rate-limit response headers (nginx sends none);
                      `false` turns both header families off
    TOLLGATE_BUFFERING [unset]  `true` or `false`: the route's request and response buffering
                      (unset: the binary's default, and no key an older binary would refuse)
    FIXED_RPS [900]   requests per second per connection in scenarios 6 and 7 (h2load --rps)
    SCENARIOS [baseline forwarded rejected redis cluster slots keys h2 fixed]
    ROUNDS [1]        measure nginx and tollgate this many times each in scenarios 1, 2, 4, 6, 7
                      (and tollgate with Redis and in process in 3, 3c, 3d), alternating which
                      goes first; ratios are taken between the medians, each round's listed
    TOLLGATE_BIN      the tollgate binary [target/release/tollgate, built when missing or older
                      than src/, Cargo.toml or Cargo.lock]
    RESULTS [target/compare/results-DATE.md]  where the report is written
    KEEP_TMP [0]      1 keeps the temp dir (configs, logs, raw wrk/h2load output)
TXT
}

run_compare() {
    [ $# -eq 0 ] || usage_error "benches/load.sh compare   (no arguments; benches/load.sh help compare)"
    client_defaults 10 2
    H2_STREAMS=${H2_STREAMS:-10}
    KEYS=${KEYS:-100000}
    export KEYS # for keys.lua
    TOLLGATE_HEADERS=${TOLLGATE_HEADERS:-true}
    FIXED_RPS=${FIXED_RPS:-900}
    SCENARIOS=${SCENARIOS:-baseline forwarded rejected redis cluster slots keys h2 fixed}
    # Further limits of tollgate's route, as YAML lines (scenario 3d sets one).
    TOLLGATE_EXTRA=
    ROUNDS=${ROUNDS:-1}
    RESULTS=${RESULTS:-$ROOT/target/compare/results-$(date +%Y%m%d-%H%M%S).md}
    local started_at=$SECONDS load_before busy_before
    load_before=$(cut -d" " -f1-3 /proc/loadavg)
    # What else was using the CPU (top's second frame: the last half second).
    busy_before=$(top -bn2 -d0.5 -w 512 -o %CPU 2>/dev/null | awk '/^ *PID/ {frame++; next} frame == 2 && n < 3 && $9 + 0 > 0 {printf "%s%s %s%%", (n++ ? ", " : ""), $12, $9}')

    need nginx wrk h2load redis-server redis-cli curl python3 ss
    start_run
    tollgate_binary
    start_backend
    log "backend on $BACKEND_PORT (h2c $BACKEND_H2_PORT); tollgate: $TOLLGATE_SOURCE (built $(built "$TOLLGATE_SOURCE"))"
    compare_scenarios
    mkdir -p "$(dirname "$RESULTS")"
    compare_report "$load_before" "${busy_before:-none}" "$started_at" >"$RESULTS.tmp"
    mv "$RESULTS.tmp" "$RESULTS"
    cat "$RESULTS"
    log "results written to $RESULTS"
}

# built FILE: when FILE was last written, in UTC.
built() { date -u -r "$1" '+%Y-%m-%d %H:%M UTC'; }

compare_want() { [[ " $SCENARIOS " == *" $1 "* ]]; }

# measure_h2 SCENARIO TARGET PID URL: h2load over h2c (prior knowledge), its own warm-up.
measure_h2() {
    local scen=$1 target=$2 pid=$3 url=$4 out rss probe fields
    out_file "$scen" "$target"
    out=$OUT
    log "$scen / $target: ${WARMUP}s warm-up + ${DURATION}s (h2load -t$THREADS -c$CONNECTIONS -m$H2_STREAMS)"
    bounded $((WARMUP + DURATION + 30)) "$out" h2load -t"$THREADS" -c"$CONNECTIONS" -m"$H2_STREAMS" \
        -D "$DURATION" --warm-up-time "$WARMUP" --log-file "$out.log" "$url" ||
        die "h2load failed: $(cat "$out")"
    rss=$(rss_kb "$pid" VmHWM)
    probe=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 --http2-prior-knowledge "$url" || echo failed)
    fields=$(python3 "$CONF/summarize.py" h2load "$out" "$out.log")
    row "$scen" "$target" "$fields" "$rss" "$probe"
}

# measure_fixed SCENARIO TARGET PID URL: HTTP/1.1 at a fixed rate (FIXED_RPS per connection,
# h2load --h1 --rps), so latency is compared at the same load rather than at each proxy's own
# saturation, where wrk's closed loop measures it.
measure_fixed() {
    local scen=$1 target=$2 pid=$3 url=$4 out rss probe fields
    out_file "$scen" "$target"
    out=$OUT
    log "$scen / $target: ${WARMUP}s warm-up + ${DURATION}s (h2load --h1 -t$THREADS -c$CONNECTIONS --rps $FIXED_RPS)"
    bounded $((WARMUP + DURATION + 30)) "$out" h2load --h1 -t"$THREADS" -c"$CONNECTIONS" \
        --rps="$FIXED_RPS" -D "$DURATION" --warm-up-time "$WARMUP" --log-file "$out.log" "$url" ||
        die "h2load failed: $(cat "$out")"
    rss=$(rss_kb "$pid" VmHWM)
    probe=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$url" || echo failed)
    fields=$(python3 "$CONF/summarize.py" h2load "$out" "$out.log")
    row "$scen" "$target" "$fields" "$rss" "$probe"
}

# A Redis Cluster of three masters (no replicas) -> CLUSTER_PORTS, CLUSTER_PIDS, REDIS_PORTS.
start_cluster() {
    local n port dir
    CLUSTER_PORTS=()
    CLUSTER_PIDS=()
    for n in 1 2 3; do
        # A node's cluster bus listens 10,000 above its port, so the port must be <= 55,535.
        port=$(free_port)
        while [ "$port" -gt 55535 ]; do port=$(free_port); done
        dir=$TMP/cluster-$n
        # A fresh directory: a nodes.conf left by an earlier cluster of this run would bring
        # back its ports.
        rm -rf "$dir"
        mkdir -p "$dir"
        spawn "cluster-$n" redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" --save "" \
            --appendonly no --daemonize no --logfile "$dir/redis.log" --cluster-enabled yes \
            --cluster-node-timeout 5000
        CLUSTER_PIDS+=("$SPAWNED")
        CLUSTER_PORTS+=("$port")
        wait_port "$port" "$SPAWNED" "redis-server (cluster node $n)"
    done
    redis-cli --cluster create "${CLUSTER_PORTS[@]/#/127.0.0.1:}" --cluster-replicas 0 \
        --cluster-yes >"$TMP/cluster-create.log" 2>&1 ||
        die "redis-cli --cluster create failed: $(cat "$TMP/cluster-create.log")"
    # Every node, not only the first: a node that has not yet taken in the new configuration
    # answers CLUSTERDOWN, and tollgate's first checks would time out on it.
    for port in "${CLUSTER_PORTS[@]}"; do
        for _ in $(seq 100); do
            redis-cli -p "$port" cluster info | grep -q cluster_state:ok && break
            sleep 0.1
        done
    done
    # shellcheck disable=SC2034 # for redis_commands
    REDIS_PORTS=("${CLUSTER_PORTS[@]}")
}

cluster_limiter() {
    printf '  backend: redis\n  on_failure: closed\n  redis:\n    cluster: [%s]' \
        "$(printf '"redis://127.0.0.1:%s", ' "${CLUSTER_PORTS[@]}" | sed 's/, $//')"
}

# --- the scenarios --------------------------------------------------------------------------
forwarded_nginx() {
    start_nginx nginx-forwarded "${FWD_NGINX[@]}"
    measure_wrk "1 forwarded" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/"
    stop "$NGINX_PID"
}
forwarded_tollgate() {
    tollgate_measures tollgate-forwarded "$LOCAL" "${FWD_TOLLGATE[@]}" \
        measure_wrk "1 forwarded" tollgate
}

rejected_nginx() {
    start_nginx nginx-rejected "${REJ_NGINX[@]}"
    measure_wrk "2 rejected" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/"
    stop "$NGINX_PID"
}
rejected_tollgate() {
    tollgate_measures tollgate-rejected "$LOCAL" "${REJ_TOLLGATE[@]}" \
        measure_wrk "2 rejected" tollgate
}

# Scenarios 3, 3c and 3d compare tollgate with Redis against tollgate with the same limits in
# process, measured in alternating rounds beside it (not against scenario 1's runs, made
# minutes apart on a machine whose speed drifts).
# local_run NAME SCENARIO TARGET LIMITER: one forwarded run of tollgate with the local limiter,
# as "tollgate (local)" (TARGET and LIMITER unused: the arguments are shared_run's).
local_run() {
    tollgate_measures "$1-local" "$LOCAL" "${FWD_TOLLGATE[@]}" measure_wrk "$2" "tollgate (local)"
}
# shared_run NAME SCENARIO TARGET LIMITER: one forwarded run of tollgate with LIMITER, as TARGET.
shared_run() {
    tollgate_measures "$1" "$4" "${FWD_TOLLGATE[@]}" measure_wrk "$2" "$3"
}
# beside_local LABEL NAME SCENARIO TARGET LIMITER: tollgate with LIMITER (as TARGET) and with the
# local limiter ("tollgate (local)"), ROUNDS times each in SCENARIO, then their ratio as LABEL.
# NAME names the runs' directories.
beside_local() {
    local label=$1
    shift
    rounds "local_run shared_run" "$@"
    ratio "$label" "$2" "$3" "$2" "tollgate (local)"
}

keys_nginx() {
    start_nginx nginx-keys "${KEY_NGINX[@]}"
    measure_wrk "4 $((KEYS / 1000))k keys" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/" \
        "X-API-Key: probe" "$CONF/keys.lua"
    stop "$NGINX_PID"
}
keys_tollgate() {
    tollgate_measures tollgate-keys "$LOCAL" "${KEY_TOLLGATE[@]}" \
        measure_wrk "4 $((KEYS / 1000))k keys" tollgate "X-API-Key: probe" "$CONF/keys.lua"
}

fixed_nginx() {
    start_nginx nginx-fixed-forwarded "${FWD_NGINX[@]}"
    measure_fixed "6 fixed-rate forwarded" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/"
    stop "$NGINX_PID"
    start_nginx nginx-fixed-rejected "${REJ_NGINX[@]}"
    measure_fixed "7 fixed-rate rejected" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/"
    stop "$NGINX_PID"
}
fixed_tollgate() {
    tollgate_measures tollgate-fixed-forwarded "$LOCAL" "${FWD_TOLLGATE[@]}" \
        measure_fixed "6 fixed-rate forwarded" tollgate
    tollgate_measures tollgate-fixed-rejected "$LOCAL" "${REJ_TOLLGATE[@]}" \
        measure_fixed "7 fixed-rate rejected" tollgate
}

compare_scenarios() {
    local pid keys
    if compare_want baseline; then
        measure_wrk "baseline" "backend alone" "$BACKEND_PID" "http://127.0.0.1:$BACKEND_PORT/"
    fi

    if compare_want forwarded; then
        rounds "forwarded_nginx forwarded_tollgate"
        ratio "1 forwarded, tollgate/nginx" "1 forwarded" tollgate "1 forwarded" nginx
    fi

    if compare_want rejected; then
        rounds "rejected_nginx rejected_tollgate"
        ratio "2 rejected, tollgate/nginx" "2 rejected" tollgate "2 rejected" nginx
    fi

    if compare_want redis; then
        start_redis
        beside_local "3 redis forwarded, tollgate-redis/tollgate-local" \
            tollgate-redis "3 redis forwarded" "tollgate (redis)" "$(redis_limiter)"
        # shellcheck disable=SC2153 # set by start_redis
        redis-cli -p "$REDIS_PORT" flushall >/dev/null
        tollgate_measures tollgate-redis-rejected "$(redis_limiter)" "${REJ_TOLLGATE[@]}" \
            measure_wrk "3 redis rejected" "tollgate (redis)"
        note "redis-server peak RSS $(($(rss_kb "$REDIS_PID" VmHWM) / 1024)) MB (not in the table's figure)."
        stop "$REDIS_PID"
        ratio "3 redis rejected, tollgate-redis/tollgate-local" "3 redis rejected" "tollgate (redis)" "2 rejected" tollgate
    fi

    if compare_want cluster; then
        start_cluster
        beside_local "3c cluster forwarded, tollgate-cluster/tollgate-local" \
            tollgate-cluster "3c cluster forwarded" "tollgate (cluster)" "$(cluster_limiter)"
        for pid in "${CLUSTER_PIDS[@]}"; do stop "$pid"; done
    fi

    # Scenario 3d: a per-client and a `global` limit, the two buckets of a request in two slots
    # on a cluster, against the same two limits in process. Its note gives the script calls
    # per request (two per batch: Redis Cluster refuses a script whose keys span slots).
    if compare_want slots; then
        TOLLGATE_EXTRA='      - { name: everyone, rate: 1000000/s, burst: 1000000, key: [global] }'
        start_cluster
        beside_local "3d two limits (ip + global) forwarded, tollgate-cluster/tollgate-local" \
            tollgate-slots "3d two limits forwarded" "tollgate (cluster)" "$(cluster_limiter)"
        for pid in "${CLUSTER_PIDS[@]}"; do stop "$pid"; done
        # shellcheck disable=SC2034 # tollgate_config's
        TOLLGATE_EXTRA=
    fi

    if compare_want keys; then
        keys="4 $((KEYS / 1000))k keys"
        rounds "keys_nginx keys_tollgate"
        ratio "$keys, tollgate/nginx" "$keys" tollgate "$keys" nginx
    fi

    if compare_want h2; then
        reset_peak_rss "$BACKEND_PID"
        measure_h2 "5 h2 forwarded" "backend alone" "$BACKEND_PID" "http://127.0.0.1:$BACKEND_H2_PORT/"
        start_nginx nginx-h2 "${FWD_NGINX[@]}"
        measure_h2 "5 h2 forwarded" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_H2_PORT/"
        stop "$NGINX_PID"
        tollgate_measures tollgate-h2 "$LOCAL" "${FWD_TOLLGATE[@]}" \
            measure_h2 "5 h2 forwarded" tollgate
        ratio "5 h2 forwarded, tollgate/nginx" "5 h2 forwarded" tollgate "5 h2 forwarded" nginx
    fi

    if compare_want fixed; then
        rounds "fixed_nginx fixed_tollgate"
        ratio "6 fixed-rate forwarded, tollgate/nginx" "6 fixed-rate forwarded" tollgate "6 fixed-rate forwarded" nginx
        ratio "7 fixed-rate rejected, tollgate/nginx" "7 fixed-rate rejected" tollgate "7 fixed-rate rejected" nginx
    fi

    if compare_want forwarded && compare_want rejected; then
        ratio "rejected/forwarded, nginx (>1: a 429 is cheaper than a forward)" "2 rejected" nginx "1 forwarded" nginx
        ratio "rejected/forwarded, tollgate" "2 rejected" tollgate "1 forwarded" tollgate
    fi
}

# compare_report LOAD_BEFORE BUSY_BEFORE STARTED_AT: the report, with what it was measured on.
compare_report() {
    local dirty="" what
    echo "# tollgate vs nginx, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "Machine: $(nproc) cores, $(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)," \
        "$(awk '/^MemTotal:/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo) RAM;" \
        "load average (1, 5, 15 min) before the run: $1; busiest processes then: $2."
    git -C "$ROOT" diff --quiet HEAD -- src Cargo.toml Cargo.lock 2>/dev/null ||
        dirty=" (plus uncommitted changes in src/)"
    what="tollgate $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$dirty"
    [ -n "${TOLLGATE_BIN:-}" ] && what="tollgate $TOLLGATE_SOURCE (TOLLGATE_BIN)"
    echo "$what, binary built $(built "$TOLLGATE_SOURCE");" \
        "$(nginx -v 2>&1 | sed 's/.*: //'), $(wrk -v 2>&1 | head -1 | awk '{print $1, $2}')," \
        "$(h2load --version | head -1), $(redis-server --version | awk '{print $1, $2, $3}')."
    echo "Each run: ${WARMUP}s warm-up, then ${DURATION}s measured, $CONNECTIONS connections," \
        "$THREADS client threads; h2 with $H2_STREAMS streams per connection;" \
        "$ROUNDS round(s) of scenarios 1, 2, 3, 3c, 3d, 4, 6 and 7; scenarios 6 and 7 at $FIXED_RPS req/s per connection." \
        "tollgate rate-limit headers: $TOLLGATE_HEADERS; buffering: ${TOLLGATE_BUFFERING:-default}."
    echo
    report
    echo
    echo "p50/p99: wrk --latency for HTTP/1.1; for h2, computed from h2load's per-request log."
    echo "Peak RSS: VmHWM of the proxy (nginx: master + workers, summed). non-2xx: responses that were"
    echo "not 2xx/3xx out of those completed; the probe is one curl request right after the run."
    echo "Total time: $((SECONDS - $3)) s."
}
