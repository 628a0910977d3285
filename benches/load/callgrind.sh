# shellcheck shell=bash
# benches/load.sh callgrind [tollgate|bare] [fwd|rej|redis|h2]: instructions per request of the
# proxy, counted by callgrind, a figure that does not move with the load on a shared machine,
# for comparing two commits or tollgate with the bare hyper floor. Sourced by benches/load.sh,
# with benches/load/lib.sh.
#
# Builds the target with frame pointers and line tables (target dir target/callgrind/build),
# starts on 127.0.0.1 the backend of `compare`, Redis for `redis`, and the proxy under
# `valgrind --tool=callgrind` with instrumentation off; warms up for 3 s, counts DURATION
# seconds of `wrk -t1 -cCONNECTIONS` (`h2`: `h2load -m10` over h2c), and prints the
# instructions per request with the 40 functions that execute most of them (self cost, inlined
# code counted in its caller). The full profile stays in target/callgrind/NAME.profile for
# `callgrind_annotate --inclusive=yes`.
# About 2 minutes with the build.

help_callgrind() {
    cat <<'TXT'
callgrind [tollgate|bare] [fwd|rej|redis|h2]   (defaults: tollgate fwd)
                   instructions per request under callgrind, with the 40 functions that
                   execute most of them; the profile stays in target/callgrind/. Builds the
                   target with frame pointers into target/callgrind/build. h2: scenario 1 over
                   h2c, `h2load -cCONNECTIONS -m10` (tollgate only).
    DURATION [10]     seconds counted            CONNECTIONS [8]  (more: larger Redis batches)
    VALGRIND_EXTRA    further callgrind options (`--dump-instr=yes` for costs by address)
    BIN               a binary to count instead of building one (an older commit's, say):
                      the totals hold, the function list is coarser without frame pointers
    HEADERS [true]    whether tollgate sends the rate-limit headers
    LIMITS [on]       `off` for a route without limits (the proxy without a check)
    ACCESS_LOG [false]  tollgate's --access-log; `file`: a file in the run's temp dir
    EXTRA             further limits of the route as YAML lines, e.g. compare's scenario 3d:
                      EXTRA='      - { name: everyone, rate: 1000000/s, burst: 1000000, key: [global] }'
    CANDIDATE [off]   `on`: with compare's scenario 1c candidate config beside the live one
    TRACES [off]      a sample ratio (`1`, `0.01`): telemetry.traces on, exported over
                      OTLP/HTTP to tests/fixtures/otlp/receiver.py taking every batch unread
TXT
}

run_callgrind() {
    [ $# -le 2 ] || usage_error "benches/load.sh callgrind [tollgate|bare] [fwd|rej|redis|h2]"
    local what=${1:-tollgate} mode=${2:-fwd} out=$ROOT/target/callgrind bin limiter name port
    local pid requests build extra=() limit=("${FWD_TOLLGATE[@]}") args access
    DURATION=${DURATION:-10}
    CONNECTIONS=${CONNECTIONS:-8}
    build=(cargo build --release --locked --target-dir "$out/build")
    case $what in
        tollgate) build+=(--bin tollgate); bin=$out/build/release/tollgate ;;
        bare) build+=(--example bare_hyper_proxy); bin=$out/build/release/examples/bare_hyper_proxy ;;
        *) usage_error "benches/load.sh callgrind [tollgate|bare] [fwd|rej|redis|h2]" ;;
    esac
    case $mode in
        fwd | redis) ;;
        h2) [ "$what" = tollgate ] || usage_error "callgrind h2: tollgate only (the bare proxy speaks HTTP/1.1)" ;;
        rej) limit=("${REJ_TOLLGATE[@]}") ;;
        *) usage_error "benches/load.sh callgrind [tollgate|bare] [fwd|rej|redis|h2]" ;;
    esac
    need valgrind callgrind_annotate callgrind_control nginx wrk curl python3 ss
    [ "$mode" != h2 ] || need h2load
    [ "$mode" != redis ] || need redis-server redis-cli
    read -r -a extra <<<"${VALGRIND_EXTRA:-}"
    mkdir -p "$out"
    if [ -n "${BIN:-}" ]; then
        bin=$BIN
    else
        log "building $what with frame pointers (${build[*]})"
        (cd "$ROOT" && CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
            RUSTFLAGS="-C force-frame-pointers=yes" "${build[@]}") 2>&1 | tail -1 >&2
    fi

    start_run
    start_backend
    limiter=$LOCAL
    if [ "$mode" = redis ]; then
        start_redis
        limiter=$(redis_limiter)
    fi
    port=$(free_port)
    local top=
    if [ "${CANDIDATE:-off}" = on ]; then
        write_candidate "$TMP"
        top="candidate: candidate.yaml"
    fi
    if [ "${TRACES:-off}" != off ]; then
        TRACES_B=$TRACES start_otlp_sink
        top="telemetry:
  traces: { endpoint: \"http://127.0.0.1:$OTLP_PORT\", sample_ratio: $TRACES }"
    fi
    TOLLGATE_HEADERS=${HEADERS:-true} TOLLGATE_EXTRA=${EXTRA:-} \
        tollgate_config "$TMP/callgrind.yaml" "$port" "$limiter" "${limit[@]}"
    # The route's limits are the last lines of the config.
    [ "${LIMITS:-on}" != off ] || sed -i '/^    limits:/,$d' "$TMP/callgrind.yaml"
    [ -z "$top" ] || echo "$top" >>"$TMP/callgrind.yaml"
    name=$what-$mode
    rm -f "$out/$name.out"*
    access=${ACCESS_LOG:-false}
    [ "$access" != file ] || access=$TMP/access.log
    args=(run --config "$TMP/callgrind.yaml" --access-log "$access" --log-level warn)
    [ "$what" = bare ] && args=("127.0.0.1:$port" "127.0.0.1:$BACKEND_PORT")
    spawn callgrind valgrind --tool=callgrind --instr-atstart=no "${extra[@]}" \
        --callgrind-out-file="$out/$name.out" "$bin" "${args[@]}"
    pid=$SPAWNED
    wait_port "$port" "$pid" "$what under valgrind" 60
    # The warm-up and the counted load: wrk, or h2load over h2c.
    local warm=(wrk -t1 -c"$CONNECTIONS" -d3s) load=(wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s")
    if [ "$mode" = h2 ]; then
        warm=(h2load -t1 -c"$CONNECTIONS" -m10 -D 3)
        load=(h2load -t1 -c"$CONNECTIONS" -m10 -D "$DURATION")
    fi
    bounded 40 /dev/null "${warm[@]}" "http://127.0.0.1:$port/"
    callgrind_control -i on "$pid" >/dev/null 2>&1
    bounded $((DURATION + 30)) "$TMP/wrk.txt" "${load[@]}" "http://127.0.0.1:$port/" ||
        die "the client failed: $(cat "$TMP/wrk.txt")"
    callgrind_control -i off "$pid" >/dev/null 2>&1
    callgrind_control -d "$pid" >/dev/null 2>&1
    # The dump asked for above (callgrind numbers its dumps: NAME.out.1).
    for _ in $(seq 100); do [ -s "$out/$name.out.1" ] && break; sleep 0.1; done
    sleep 1
    [ -s "$out/$name.out.1" ] || die "callgrind wrote no dump (see $TMP/callgrind)"
    stop "$pid"
    mv "$out/$name.out.1" "$out/$name.profile"
    # wrk: "N requests in"; h2load: "requests: T total, S started, D done, N succeeded".
    requests=$(awk '/requests in/ {print $1} /^requests:/ {print $8}' "$TMP/wrk.txt")
    callgrind_annotate --auto=no --inclusive=no --threshold=100 "$out/$name.profile" 2>/dev/null |
        sed -n '/file:function/,$p' | tail -n +3 | grep -v '^ *$' |
        awk -v n="$requests" -v name="$what" -v mode="$mode" '{
            c = $1; gsub(",", "", c); $1 = ""; $2 = ""; sub(/^ +/, ""); sub(/ \[[^]]*\]$/, "")
            f = substr($0, index($0, ":") + 1); per[f] += c / n; total += c / n
        } END {
            printf "%s %s: %d requests counted, %.0f instructions per request\n", name, mode, n, total
            for (f in per) printf "%8.0f  %s\n", per[f], f
        }' | {
        read -r head
        echo "$head"
        sort -rn | awk 'NR <= 40'
    }
    echo "profile: $out/$name.profile (callgrind_annotate --inclusive=yes $out/$name.profile)"
}
