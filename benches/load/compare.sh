# shellcheck shell=bash
# benches/load.sh compare: tollgate against nginx (proxy_pass + limit_req), HAProxy and Caddy on
# this machine. Sourced by benches/load.sh, with benches/load/lib.sh and benches/load/peers.sh.
#
# Starts on 127.0.0.1 only: a backend (nginx, 1 worker, `return 200 "ok\n"`), nginx as the
# rate-limiting proxy (2 workers), tollgate with the equivalent YAML, HAProxy and Caddy
# (peers.sh), and redis-server for the Redis scenarios. With LOGS=file or both, every proxy
# also runs logging every request to a file. Each proxy is started afresh for each scenario, so its peak RSS (VmHWM) is
# that scenario's. Runs wrk (HTTP/1.1), h2load (h2c) and h2load --h1 --rps (HTTP/1.1 at a fixed
# rate, scenarios 6 and 7) for a fixed time after a warm-up, prints one Markdown table with
# ratios, writes it to a results file, and stops every process it started (also on failure or
# Ctrl-C). See docs/performance.md for what each scenario measures.

help_compare() {
    cat <<'TXT'
compare            tollgate against nginx (proxy_pass + limit_req), HAProxy (stick table
                   http_req_rate) and Caddy (reverse_proxy; forwarded scenarios only, it has no
                   rate limit), every scenario: a Markdown table of req/s, p99, CPU, system
                   calls and context switches per request (perf stat over each wrk warm-up)
                   with ratios, written to RESULTS. Scenarios (SCENARIOS names them):
                   baseline (the backend alone), forwarded (1), candidate (1c: forwarded
                   with a candidate config of two limits beside the live one), rejected (2), redis (3: one
                   redis-server, beside the local limiter), cluster (3c: a 3-master Redis
                   Cluster), slots (3d: a per-client and a `global` limit, two cluster slots per
                   request), redis-quota (3e: a calendar quota on one redis-server, beside its
                   token bucket and the local limiter), redis-concurrency (3f: the same with a
                   concurrency limit), redis-leased (3g: the token bucket with `leasing: auto`,
                   one hot client), keys (4: KEYS distinct X-API-Key values), h2 (5: h2c),
                   h2up (5b: h2c clients to an h2c backend: tollgate `protocol: h2c`,
                   HAProxy `proto h2`, nginx `grpc_pass`), grpc (5c: the same with gRPC-framed
                   unary POSTs), fixed (6, 7: HTTP/1.1 at a fixed rate, forwarded and
                   rejected).
    DURATION [10]  seconds measured per run       WARMUP [2]   seconds of warm-up per run
    CONNECTIONS [64]  client connections          THREADS [2]  wrk/h2load threads
    H2_STREAMS [10]   concurrent streams per h2 connection (h2load -m)
    KEYS [100000]     distinct X-API-Key values in scenario 4
    TOLLGATE_HEADERS [true]  tollgate's rate-limit response headers (nginx sends none);
                      `false` turns both header families off
    TOLLGATE_BUFFERING [unset]  `true` or `false`: the route's request and response buffering
                      (unset: the binary's default, and no key an older binary would refuse)
    FIXED_RPS [900]   requests per second per connection in scenarios 6 and 7 (h2load --rps)
    SCENARIOS [baseline forwarded candidate rejected redis cluster slots redis-quota
               redis-concurrency redis-leased keys h2 h2up grpc fixed]
    LOGS [off]        off: every proxy's access log off; file: every proxy logs every request
                      to a file (tollgate --access-log FILE; nginx access_log FILE, and a
                      second nginx with buffer=64k flush=1s; HAProxy option httplog to its
                      stdout, a file; Caddy's log directive); both: each scenario both ways,
                      with each proxy's logged/off ratio
    PEERS [haproxy caddy]  the peers measured beside nginx and tollgate (empty: none)
    ROUNDS [1]        measure nginx and tollgate this many times each in scenarios 1, 2, 4, 6, 7
                      (and tollgate with Redis and in process in 3, 3c, 3d, 3e, 3f, 3g, with and
                      without a candidate in 1c), alternating which
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
    SCENARIOS=${SCENARIOS:-baseline forwarded candidate rejected redis cluster slots redis-quota redis-concurrency redis-leased keys h2 h2up grpc fixed}
    # Further limits of tollgate's route, as YAML lines (scenario 3d sets one).
    TOLLGATE_EXTRA=
    # The kind of tollgate's limit in place of its token bucket (scenarios 3e, 3f and 3g set it).
    TOLLGATE_LIMIT=
    ROUNDS=${ROUNDS:-1}
    LOGS=${LOGS:-off}
    case $LOGS in off | file | both) ;; *) usage_error "LOGS=off|file|both" ;; esac
    PEERS=${PEERS-haproxy caddy}
    RESULTS=${RESULTS:-$ROOT/target/compare/results-$(date +%Y%m%d-%H%M%S).md}
    local started_at=$SECONDS load_before busy_before
    load_before=$(cut -d" " -f1-3 /proc/loadavg)
    # What else was using the CPU (top's second frame: the last half second).
    busy_before=$(top -bn2 -d0.5 -w 512 -o %CPU 2>/dev/null | awk '/^ *PID/ {frame++; next} frame == 2 && n < 3 && $9 + 0 > 0 {printf "%s%s %s%%", (n++ ? ", " : ""), $12, $9}')

    need nginx wrk h2load redis-server redis-cli curl python3 ss perf
    # shellcheck disable=SC2086 # a list of commands
    [ -z "$PEERS" ] || need $PEERS
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
    url+=${H2_PATH:-}
    # H2LOAD_EXTRA: more h2load arguments (scenario 5c: the gRPC call's body and headers).
    bounded $((WARMUP + DURATION + 30)) "$out" h2load -t"$THREADS" -c"$CONNECTIONS" -m"$H2_STREAMS" \
        -D "$DURATION" --warm-up-time "$WARMUP" --log-file "$out.log" \
        ${H2LOAD_EXTRA[@]+"${H2LOAD_EXTRA[@]}"} "$url" ||
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
# Each pass of compare_scenarios runs with the logs off (LOGGED=0) or with every proxy logging
# every request to a file (LOGGED=1: tollgate's --access-log FILE, nginx's `access_log FILE`
# and a second nginx with `buffer=64k flush=1s`, HAProxy's and Caddy's file logs).
# sc NAME: the scenario's name in this pass (", logged" added when every proxy logs).
sc() { if [ "$LOGGED" = 1 ]; then echo "$1, logged"; else echo "$1"; fi; }

peer_wanted() { [[ " $PEERS " == *" $1 "* ]]; }

# line_up KIND: the functions measuring KIND (forwarded, rejected, keys, fixed, h2), one per
# target of this pass: nginx and tollgate, nginx's buffered log when logged, HAProxy, and Caddy
# for the kinds that need no rate limit to be reached.
line_up() {
    local fs="$1_nginx $1_tollgate"
    [ "$LOGGED" = 0 ] || fs+=" $1_nginxbuf"
    peer_wanted haproxy && fs+=" $1_haproxy"
    case $1 in forwarded | fixed | h2) peer_wanted caddy && fs+=" $1_caddy" ;; esac
    echo "$fs"
}

# versus LABEL SCENARIO KIND: the ratios of tollgate against every other target of KIND's line-up.
versus() {
    local label=$1 scen=$2 f target
    for f in $(line_up "$3"); do
        case $f in
            *_tollgate) continue ;;
            *_nginx) target=nginx ;;
            *_nginxbuf) target="nginx (buffer=64k)" ;;
            *_haproxy) target=haproxy ;;
            *_caddy) target=caddy ;;
        esac
        if [ "$3" = fixed ] && [ "$target" = caddy ] && [[ $scen == 7* ]]; then continue; fi
        ratio "$label, tollgate/$target" "$scen" tollgate "$scen" "$target"
    done
}

# nginx_measures NAME TARGET ZONE_KEY ZONE_SIZE RATE BURST MEASURE SCENARIO [ARGS...]: start nginx
# with that limit (and this pass's log; TARGET "nginx (buffer=64k)" buffers it), run MEASURE on
# its HTTP/1.1 port with ARGS as TARGET, stop it.
nginx_measures() {
    local name=$1 target=$2 measure=$7 scen=$8
    local NGINX_LOG=off
    [ "$LOGGED" = 0 ] || NGINX_LOG="file"
    [ "$target" = nginx ] || NGINX_LOG=buffered
    start_nginx "$name" "$3" "$4" "$5" "$6"
    shift 8
    "$measure" "$scen" "$target" "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/" "$@"
    stop "$NGINX_PID"
}
# haproxy_measures NAME TYPE TRACK WINDOW LIMIT EXPIRE MEASURE SCENARIO [ARGS...]: the same for
# HAProxy, as target "haproxy".
haproxy_measures() {
    local name=$1 measure=$7 scen=$8
    start_haproxy "$name" "$2" "$3" "$4" "$5" "$6"
    shift 8
    "$measure" "$scen" haproxy "$HAPROXY_PID" "http://127.0.0.1:$HAPROXY_PORT/" "$@"
    stop "$HAPROXY_PID"
}
# caddy_measures NAME MEASURE SCENARIO: the same for Caddy, as target "caddy".
caddy_measures() {
    start_caddy "$1"
    "$2" "$3" caddy "$CADDY_PID" "http://127.0.0.1:$CADDY_PORT/"
    stop "$CADDY_PID"
}

forwarded_nginx() { nginx_measures nginx-fwd nginx "${FWD_NGINX[@]}" measure_wrk "$(sc "1 forwarded")"; }
forwarded_nginxbuf() { nginx_measures nginx-fwd-buf "nginx (buffer=64k)" "${FWD_NGINX[@]}" measure_wrk "$(sc "1 forwarded")"; }
forwarded_haproxy() { haproxy_measures haproxy-fwd "${FWD_HAPROXY[@]}" measure_wrk "$(sc "1 forwarded")"; }
forwarded_caddy() { caddy_measures caddy-fwd measure_wrk "$(sc "1 forwarded")"; }
forwarded_tollgate() {
    tollgate_measures tollgate-forwarded "$LOCAL" "${FWD_TOLLGATE[@]}" \
        measure_wrk "$(sc "1 forwarded")" tollgate
}

rejected_nginx() { nginx_measures nginx-rej nginx "${REJ_NGINX[@]}" measure_wrk "$(sc "2 rejected")"; }
rejected_nginxbuf() { nginx_measures nginx-rej-buf "nginx (buffer=64k)" "${REJ_NGINX[@]}" measure_wrk "$(sc "2 rejected")"; }
rejected_haproxy() { haproxy_measures haproxy-rej "${REJ_HAPROXY[@]}" measure_wrk "$(sc "2 rejected")"; }
rejected_tollgate() {
    tollgate_measures tollgate-rejected "$LOCAL" "${REJ_TOLLGATE[@]}" \
        measure_wrk "$(sc "2 rejected")" tollgate
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

# Scenarios 3e, 3f and 3g: the route's one limit (`key: [ip]`, as the token bucket's) is a
# calendar quota, a concurrency limit or a leased token bucket, never reached, over one redis-server, measured in alternating
# rounds beside the token bucket over the same redis-server ("tollgate (redis)") and beside the
# local limiter's token bucket ("tollgate (local)").
# kind_run NAME SCENARIO TARGET LIMITER: one forwarded run of tollgate with LIMITER and the
# limit KIND_LIMIT (a YAML mapping entry, `quota: 1000000000/day`), as KIND_TARGET (TARGET, the
# token bucket's, unused). Redis is emptied first: a quota's key is its limit's name and the
# identity's digest, as the bucket's is, and would read the bucket's number as a count.
kind_run() {
    # shellcheck disable=SC2034 # tollgate_config's
    local TOLLGATE_LIMIT=$KIND_LIMIT
    # shellcheck disable=SC2153 # set by start_redis
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
    shared_run "$1-$KIND_NAME" "$2" "$KIND_TARGET" "$4"
}
# beside_bucket SCENARIO NAME KIND LIMIT: scenario 3e, 3f or 3g (NAME its runs' directories, KIND
# the limit's kind, LIMIT its YAML) with the ratios of the kind over Redis to the local limiter
# and to the token bucket over Redis, and of that bucket to the local limiter.
beside_bucket() {
    local scen=$1 KIND_NAME=$3 KIND_LIMIT=$4 KIND_TARGET="tollgate (redis $3)"
    start_redis
    rounds "local_run shared_run kind_run" "$2" "$scen" "tollgate (redis)" "$(redis_limiter)"
    note "redis-server peak RSS $(($(rss_kb "$REDIS_PID" VmHWM) / 1024)) MB (not in the table's figure)."
    stop "$REDIS_PID"
    ratio "$scen, tollgate-redis-$3/tollgate-local" "$scen" "$KIND_TARGET" "$scen" "tollgate (local)"
    ratio "$scen, tollgate-redis-$3/tollgate-redis (token bucket)" "$scen" "$KIND_TARGET" \
        "$scen" "tollgate (redis)"
    ratio "$scen, tollgate-redis/tollgate-local (token bucket)" "$scen" "tollgate (redis)" \
        "$scen" "tollgate (local)"
}

# Scenario 1c: scenario 1's tollgate with a candidate config beside it (two limits on its one
# route, per client and `global`, never reached, so each request takes a token of both), in
# alternating rounds beside the same tollgate without one ("tollgate (local)").
# write_candidate DIR: that candidate config, DIR/candidate.yaml (callgrind's CANDIDATE=on too).
write_candidate() {
    mkdir -p "$1"
    cat >"$1/candidate.yaml" <<'YAML'
upstreams:
  backend:
    targets: [127.0.0.1:9]
routes:
  - name: all
    match: { path_prefix: / }
    upstream: backend
    limits:
      - { name: candidate-ip, rate: 1000000/s, burst: 1000000, key: [ip] }
      - { name: candidate-everyone, rate: 1000000/s, burst: 1000000, key: [global] }
YAML
}
# candidate_run NAME SCENARIO TARGET LIMITER: one forwarded run with the candidate, as TARGET.
candidate_run() {
    write_candidate "$TMP/$1-candidate"
    # shellcheck disable=SC2034 # tollgate_config's
    local TOLLGATE_TOP="candidate: candidate.yaml"
    tollgate_measures "$1-candidate" "$4" "${FWD_TOLLGATE[@]}" measure_wrk "$2" "$3"
}

KEYS_ARGS=("X-API-Key: probe" "$CONF/keys.lua")
keys_scen() { sc "4 $((KEYS / 1000))k keys"; }
keys_nginx() { nginx_measures nginx-keys nginx "${KEY_NGINX[@]}" measure_wrk "$(keys_scen)" "${KEYS_ARGS[@]}"; }
keys_nginxbuf() { nginx_measures nginx-keys-buf "nginx (buffer=64k)" "${KEY_NGINX[@]}" measure_wrk "$(keys_scen)" "${KEYS_ARGS[@]}"; }
keys_haproxy() { haproxy_measures haproxy-keys "${KEY_HAPROXY[@]}" measure_wrk "$(keys_scen)" "${KEYS_ARGS[@]}"; }
keys_tollgate() {
    tollgate_measures tollgate-keys "$KEY_LOCAL" "${KEY_TOLLGATE[@]}" \
        measure_wrk "$(keys_scen)" tollgate "${KEYS_ARGS[@]}"
}

# h2 runs each target once (h2load over h2c on its h2c port; tollgate and Caddy serve h2c and
# HTTP/1.1 on one port).
h2_nginx_as() {
    local NGINX_LOG=off
    # shellcheck disable=SC2034 # start_nginx's
    [ "$LOGGED" = 0 ] || NGINX_LOG=$2
    start_nginx "nginx-h2-$2" "${FWD_NGINX[@]}"
    measure_h2 "$(sc "5 h2 forwarded")" "$1" "$NGINX_PID" "http://127.0.0.1:$NGINX_H2_PORT/"
    stop "$NGINX_PID"
}
h2_nginx() { h2_nginx_as nginx file; }
h2_nginxbuf() { h2_nginx_as "nginx (buffer=64k)" buffered; }
h2_haproxy() {
    start_haproxy haproxy-h2 "${FWD_HAPROXY[@]}"
    measure_h2 "$(sc "5 h2 forwarded")" haproxy "$HAPROXY_PID" "http://127.0.0.1:$HAPROXY_H2_PORT/"
    stop "$HAPROXY_PID"
}
h2_caddy() { caddy_measures caddy-h2 measure_h2 "$(sc "5 h2 forwarded")"; }
h2_tollgate() {
    tollgate_measures tollgate-h2 "$LOCAL" "${FWD_TOLLGATE[@]}" \
        measure_h2 "$(sc "5 h2 forwarded")" tollgate
}

# Scenarios 5b and 5c: h2c from the clients and to the backend's h2c port (tollgate
# `protocol: h2c`, HAProxy `proto h2`, nginx `grpc_pass`, its only HTTP/2 upstream): GETs (5b),
# and gRPC-framed POSTs (5c: `content-type: application/grpc`, `te: trailers`, one 5-byte
# message, as a unary call's, to /bench.Echo/Unary), which tollgate streams both ways, never
# buffered. Each target runs once.
# shellcheck disable=SC2034 # start_nginx's, start_haproxy's and tollgate_config's settings
h2up_nginx() {
    local BACKEND_PORT=$BACKEND_H2_PORT NGINX_PASS=grpc NGINX_LOG=off
    [ "$LOGGED" = 0 ] || NGINX_LOG="file"
    start_nginx nginx-h2up "${FWD_NGINX[@]}"
    measure_h2 "$H2UP_SCEN" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_H2_PORT/"
    stop "$NGINX_PID"
}
# shellcheck disable=SC2034
h2up_haproxy() {
    local BACKEND_PORT=$BACKEND_H2_PORT HAPROXY_SERVER_OPTS="proto h2"
    start_haproxy haproxy-h2up "${FWD_HAPROXY[@]}"
    measure_h2 "$H2UP_SCEN" haproxy "$HAPROXY_PID" "http://127.0.0.1:$HAPROXY_H2_PORT/"
    stop "$HAPROXY_PID"
}
# shellcheck disable=SC2034
h2up_tollgate() {
    local BACKEND_PORT=$BACKEND_H2_PORT TOLLGATE_UPSTREAM="    protocol: h2c"
    tollgate_measures tollgate-h2up "$LOCAL" "${FWD_TOLLGATE[@]}" measure_h2 "$H2UP_SCEN" tollgate
}
# h2up_all SCENARIO: scenario 5b or 5c (H2_PATH and H2LOAD_EXTRA set) on every target.
h2up_all() {
    local H2UP_SCEN=$1 f
    for f in h2up_nginx h2up_tollgate; do "$f"; done
    if peer_wanted haproxy; then h2up_haproxy; fi
    ratio "$1, tollgate/nginx" "$1" tollgate "$1" nginx
    if peer_wanted haproxy; then ratio "$1, tollgate/haproxy" "$1" tollgate "$1" haproxy; fi
}

fixed_nginx_as() {
    nginx_measures nginx-fixed-fwd "$1" "${FWD_NGINX[@]}" measure_fixed "$(sc "6 fixed-rate forwarded")"
    nginx_measures nginx-fixed-rej "$1" "${REJ_NGINX[@]}" measure_fixed "$(sc "7 fixed-rate rejected")"
}
fixed_nginx() { fixed_nginx_as nginx; }
fixed_nginxbuf() { fixed_nginx_as "nginx (buffer=64k)"; }
fixed_haproxy() {
    haproxy_measures haproxy-fixed-fwd "${FWD_HAPROXY[@]}" measure_fixed "$(sc "6 fixed-rate forwarded")"
    haproxy_measures haproxy-fixed-rej "${REJ_HAPROXY[@]}" measure_fixed "$(sc "7 fixed-rate rejected")"
}
fixed_caddy() { caddy_measures caddy-fixed-fwd measure_fixed "$(sc "6 fixed-rate forwarded")"; }
fixed_tollgate() {
    tollgate_measures tollgate-fixed-forwarded "$LOCAL" "${FWD_TOLLGATE[@]}" \
        measure_fixed "$(sc "6 fixed-rate forwarded")" tollgate
    tollgate_measures tollgate-fixed-rejected "$LOCAL" "${REJ_TOLLGATE[@]}" \
        measure_fixed "$(sc "7 fixed-rate rejected")" tollgate
}

# compare_pass: every scenario of SCENARIOS, with this pass's logs (LOGGED, ACCESS_LOG,
# PEER_LOG).
compare_pass() {
    local pid keys r
    if compare_want forwarded; then
        rounds "$(line_up forwarded)"
        versus "$(sc "1 forwarded")" "$(sc "1 forwarded")" forwarded
    fi

    if compare_want candidate; then
        rounds "local_run candidate_run" tollgate-cand "$(sc "1c forwarded with a candidate")" \
            "tollgate (candidate)" "$LOCAL"
        ratio "$(sc "1c forwarded with a candidate"), tollgate-candidate/tollgate" \
            "$(sc "1c forwarded with a candidate")" "tollgate (candidate)" \
            "$(sc "1c forwarded with a candidate")" "tollgate (local)"
    fi

    if compare_want rejected; then
        rounds "$(line_up rejected)"
        versus "$(sc "2 rejected")" "$(sc "2 rejected")" rejected
    fi

    if compare_want redis; then
        start_redis
        beside_local "$(sc "3 redis forwarded"), tollgate-redis/tollgate-local" \
            tollgate-redis "$(sc "3 redis forwarded")" "tollgate (redis)" "$(redis_limiter)"
        # shellcheck disable=SC2153 # set by start_redis
        redis-cli -p "$REDIS_PORT" flushall >/dev/null
        tollgate_measures tollgate-redis-rejected "$(redis_limiter)" "${REJ_TOLLGATE[@]}" \
            measure_wrk "$(sc "3 redis rejected")" "tollgate (redis)"
        note "redis-server peak RSS $(($(rss_kb "$REDIS_PID" VmHWM) / 1024)) MB (not in the table's figure)."
        stop "$REDIS_PID"
        ratio "$(sc "3 redis rejected"), tollgate-redis/tollgate-local" "$(sc "3 redis rejected")" \
            "tollgate (redis)" "$(sc "2 rejected")" tollgate
    fi

    if compare_want cluster; then
        start_cluster
        beside_local "$(sc "3c cluster forwarded"), tollgate-cluster/tollgate-local" \
            tollgate-cluster "$(sc "3c cluster forwarded")" "tollgate (cluster)" "$(cluster_limiter)"
        for pid in "${CLUSTER_PIDS[@]}"; do stop "$pid"; done
    fi

    # Scenario 3d: a per-client and a `global` limit, the two buckets of a request in two slots
    # on a cluster, against the same two limits in process. Its note gives the script calls
    # per request (two per batch: Redis Cluster refuses a script whose keys span slots).
    if compare_want slots; then
        TOLLGATE_EXTRA='      - { name: everyone, rate: 1000000/s, burst: 1000000, key: [global] }'
        start_cluster
        beside_local "$(sc "3d two limits (ip + global) forwarded"), tollgate-cluster/tollgate-local" \
            tollgate-slots "$(sc "3d two limits forwarded")" "tollgate (cluster)" "$(cluster_limiter)"
        for pid in "${CLUSTER_PIDS[@]}"; do stop "$pid"; done
        # shellcheck disable=SC2034 # tollgate_config's
        TOLLGATE_EXTRA=
    fi

    # Scenarios 3e and 3f: limits that never reject (a quota of 1,000,000,000 a day, 100,000
    # requests in flight), so the figures are the cost of forwarding with each kind over Redis.
    if compare_want redis-quota; then
        beside_bucket "$(sc "3e redis quota forwarded")" tollgate-redis-q quota \
            "quota: 1000000000/day"
    fi
    if compare_want redis-concurrency; then
        beside_bucket "$(sc "3f redis concurrency forwarded")" tollgate-redis-c concurrency \
            "concurrency: 100000"
    fi
    # Scenario 3g: the token bucket of scenario 3 with `leasing: auto`; wrk's one address is
    # the hot identity whose checks leases answer in process.
    if compare_want redis-leased; then
        beside_bucket "$(sc "3g redis leased forwarded")" tollgate-redis-l leased \
            "rate: ${FWD_TOLLGATE[0]}
        burst: ${FWD_TOLLGATE[1]}
        leasing: auto"
    fi

    if compare_want keys; then
        keys=$(keys_scen)
        rounds "$(line_up keys)"
        versus "$keys" "$keys" keys
    fi

    if compare_want h2; then
        for r in $(line_up h2); do "$r"; done
        versus "$(sc "5 h2 forwarded")" "$(sc "5 h2 forwarded")" h2
    fi

    if compare_want h2up; then
        h2up_all "$(sc "5b h2c to an h2c backend")"
    fi
    if compare_want grpc; then
        printf '\0\0\0\0\5hello' >"$TMP/grpc-call.bin"
        local H2_PATH=bench.Echo/Unary
        local H2LOAD_EXTRA=(-d "$TMP/grpc-call.bin" -H "content-type: application/grpc" -H "te: trailers")
        h2up_all "$(sc "5c gRPC unary to an h2c backend")"
    fi

    if compare_want fixed; then
        rounds "$(line_up fixed)"
        versus "$(sc "6 fixed-rate forwarded")" "$(sc "6 fixed-rate forwarded")" fixed
        versus "$(sc "7 fixed-rate rejected")" "$(sc "7 fixed-rate rejected")" fixed
    fi

    if compare_want forwarded && compare_want rejected; then
        ratio "$(sc "rejected/forwarded"), nginx (>1: a 429 is cheaper than a forward)" \
            "$(sc "2 rejected")" nginx "$(sc "1 forwarded")" nginx
        ratio "$(sc "rejected/forwarded"), tollgate" "$(sc "2 rejected")" tollgate "$(sc "1 forwarded")" tollgate
    fi
}

compare_scenarios() {
    local pass s
    if compare_want baseline; then
        measure_wrk "baseline" "backend alone" "$BACKEND_PID" "http://127.0.0.1:$BACKEND_PORT/"
    fi
    if compare_want h2; then
        reset_peak_rss "$BACKEND_PID"
        measure_h2 "5 h2 forwarded" "backend alone" "$BACKEND_PID" "http://127.0.0.1:$BACKEND_H2_PORT/"
    fi
    for pass in off file; do
        [ "$LOGS" = both ] || [ "$LOGS" = "$pass" ] || continue
        # shellcheck disable=SC2034 # start_tollgate's and peers.sh's
        if [ "$pass" = off ]; then
            LOGGED=0 ACCESS_LOG=false PEER_LOG=off
        else
            LOGGED=1 ACCESS_LOG=file PEER_LOG=file
        fi
        compare_pass
    done
    # What logging every request costs each proxy: its logged run against its run without.
    [ "$LOGS" = both ] || return 0
    for s in "1 forwarded" "2 rejected"; do
        compare_want "${s#* }" || continue
        for t in tollgate nginx haproxy caddy; do
            [ "$t" = tollgate ] || [ "$t" = nginx ] || peer_wanted "$t" || continue
            [ "$t/$s" != "caddy/2 rejected" ] || continue
            ratio "$s, $t logging every request/logs off" "$s, logged" "$t" "$s" "$t"
        done
    done
}

# compare_report LOAD_BEFORE BUSY_BEFORE STARTED_AT: the report, with what it was measured on.
compare_report() {
    local dirty="" what
    echo "# tollgate vs nginx${PEERS:+, ${PEERS// /, }}, $(date -u '+%Y-%m-%d %H:%M UTC')"
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
        "$(h2load --version | head -1), $(redis-server --version | awk '{print $1, $2, $3}')" \
        "${PEERS:+; }$(! peer_wanted haproxy || haproxy -v | head -1 | awk '{print $1, $2, $3}')" \
        "$(! peer_wanted caddy || echo "Caddy $(caddy version | awk '{print $1}')")."
    echo "Each run: ${WARMUP}s warm-up, then ${DURATION}s measured, $CONNECTIONS connections," \
        "$THREADS client threads; h2 with $H2_STREAMS streams per connection;" \
        "$ROUNDS round(s) of scenarios 1, 1c, 2, 3, 3c, 3d, 3e, 3f, 3g, 4, 6 and 7; scenarios 6 and 7 at $FIXED_RPS req/s per connection." \
        "tollgate rate-limit headers: $TOLLGATE_HEADERS; buffering: ${TOLLGATE_BUFFERING:-default};" \
        "access logs: $LOGS (\", logged\": every proxy logs every request to a file)."
    echo
    report
    echo
    echo "p50/p99: wrk --latency for HTTP/1.1; for h2, computed from h2load's per-request log."
    echo "Peak RSS: VmHWM of the proxy (nginx: master + workers, summed). non-2xx: responses that were"
    echo "not 2xx/3xx out of those completed; the probe is one curl request right after the run."
    echo "System calls and context switches: perf stat (raw_syscalls:sys_enter, context-switches) of the"
    echo "proxy's processes and threads over the wrk warm-up, divided by its requests (wrk runs only)."
    echo "HAProxy limits by a sliding window (stick table http_req_rate); Caddy has no rate limit and"
    echo "runs the forwarded scenarios only. HAProxy logs to its standard output, a file."
    echo "Total time: $((SECONDS - $3)) s."
}
