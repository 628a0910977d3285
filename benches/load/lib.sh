# shellcheck shell=bash
# Helpers shared by the subcommands of benches/load.sh (sourced by it, not run). The driver sets
# ROOT (the repository), CONF (benches/compare: the config templates, keys.lua, summarize.py)
# and SUBCOMMAND before a subcommand runs.
#
# What is here, once for every subcommand: messages; installing the tools; the run's temp dir
# and its processes, all stopped on exit (start_run, spawn, stop); free ports and waiting for
# one (free_port, wait_port); the config templates (fill, tollgate_config); the binaries to
# measure (release_binary, copy_binary); starting the nginx backend, nginx as the proxy,
# tollgate and Redis; the CPU and memory of a process (cpu_ticks, cpu_per_request, rss_kb); a
# wrk run with its CPU per request (measure_wrk); rounds, and the report of rows and ratios.

# --- messages -------------------------------------------------------------------------------
log() { printf '== %s %s\n' "$(date +%T)" "$*" >&2; }

# Stop the subcommand with MESSAGE (cleanup stops what it started).
die() { printf 'benches/load.sh%s: %s\n' "${SUBCOMMAND:+ $SUBCOMMAND}" "$*" >&2; exit 1; }
# Stop the subcommand for a wrong command line: print USAGE, exit 2.
usage_error() { printf 'usage: %s\n' "$*" >&2; exit 2; }

# --- tools ----------------------------------------------------------------------------------
# need_python_module MODULE PACKAGE: install PACKAGE with pip when python3 cannot import MODULE.
need_python_module() {
    python3 -c "import $1" 2>/dev/null && return 0
    log "installing $2 (pip)"
    python3 -m pip install -q "$2" 2>/dev/null || python3 -m pip install -q --break-system-packages "$2"
}

# need TOOL...: install, with apt-get, the Debian package of every TOOL that is missing.
need() {
    local tool pkg pkgs=() sudo=()
    for tool in "$@"; do
        command -v "$tool" >/dev/null && continue
        case $tool in
            h2load) pkg=nghttp2-client ;;
            redis-cli | redis-benchmark) pkg=redis-tools ;;
            callgrind_annotate | callgrind_control) pkg=valgrind ;;
            ss) pkg=iproute2 ;;
            perf) pkg=linux-perf ;;
            *) pkg=$tool ;;
        esac
        [[ " ${pkgs[*]} " == *" $pkg "* ]] || pkgs+=("$pkg")
    done
    ((${#pkgs[@]})) || return 0
    log "installing ${pkgs[*]}"
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
        "${pkgs[@]}" >/dev/null
    for tool in "$@"; do
        command -v "$tool" >/dev/null || die "needs $tool, which apt-get did not install"
    done
}

# --- the run's temp dir and processes -------------------------------------------------------
# start_run: TMP, this run's temp dir (configs, logs, raw client output), and PIDS, the processes
# started for it. When the subcommand exits, fails or is interrupted, cleanup stops every
# process in PIDS and the client run in progress (CURRENT): SIGTERM, then SIGKILL after 5 s.
# TMP is removed unless the run failed or KEEP_TMP=1.
start_run() {
    TMP=$(mktemp -d "${TMPDIR:-/tmp}/tollgate-$SUBCOMMAND.XXXXXX")
    chmod 755 "$TMP" # nginx workers run as nobody
    PIDS=()
    CURRENT=""
    ROWS=$TMP/rows.tsv
    RATIOS=$TMP/ratios.tsv
    NOTES=$TMP/notes.md
    : >"$ROWS"
    : >"$RATIOS"
    : >"$NOTES"
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

cleanup() {
    local rc=$? pid
    trap - EXIT INT TERM
    [ -z "$CURRENT" ] || PIDS+=("$CURRENT")
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do reap "$pid"; done
    if [ "${KEEP_TMP:-0}" = 1 ] || [ "$rc" -ne 0 ]; then
        log "logs, configs and raw output kept in $TMP"
    else
        rm -rf "$TMP"
    fi
    exit "$rc"
}

# reap PID: wait up to 5 s for PID, sent SIGTERM, to exit; then SIGKILL it.
reap() {
    local pid=$1
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# spawn NAME COMMAND...: run COMMAND in the background in the directory $TMP/NAME, its output in
# stdout and stderr there, and add it to PIDS. Sets SPAWNED, its PID (the command's own: exec).
spawn() {
    local dir=$TMP/$1
    shift
    mkdir -p "$dir"
    (cd "$dir" && exec "$@") >"$dir/stdout" 2>"$dir/stderr" &
    SPAWNED=$!
    PIDS+=("$SPAWNED")
}

# stop PID: stop one process started by spawn (SIGTERM, SIGKILL after 5 s), and forget it.
stop() {
    local pid=$1 keep=() p
    kill -TERM "$pid" 2>/dev/null || true
    reap "$pid"
    for p in "${PIDS[@]}"; do [ "$p" = "$pid" ] || keep+=("$p"); done
    PIDS=("${keep[@]}")
}

# bounded SECONDS OUT COMMAND...: run a client bounded in time, its output (stdout and stderr)
# in the file OUT, in the background as CURRENT so that a signal reaches the trap at once (and
# cleanup stops the client). Only the client's output is redirected, never the shell's: the
# trap's messages go where the subcommand's do.
bounded() {
    local limit=$1 out=$2 rc=0
    shift 2
    timeout --kill-after=5 "$limit" "$@" >"$out" 2>&1 &
    CURRENT=$!
    wait "$CURRENT" || rc=$?
    CURRENT=""
    return "$rc"
}

# --- ports ----------------------------------------------------------------------------------
# A port nothing listens on: bind :0 and let the kernel pick.
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_port PORT PID WHAT [SECONDS]: wait (10 s unless told) until 127.0.0.1:PORT accepts and
# PID (or a process it started) is the one listening, failing early if PID died. The owner
# matters: a port picked by free_port may still be held by a process of an earlier run that is
# on its way out (a slow-dying redis-server, say), and a connection to it would measure that
# process instead.
wait_port() {
    local port=$1 pid=$2 what=$3 seconds=${4:-10}
    for _ in $(seq $((seconds * 10))); do
        kill -0 "$pid" 2>/dev/null || die "$what exited at startup (see $TMP)"
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && listens "$port" "$pid"; then
            return 0
        fi
        sleep 0.1
    done
    die "$what does not listen on $port after $seconds s (see $TMP)"
}

# listens PORT PID: PID, or a child of PID, holds the listening socket on PORT (true without ss).
listens() {
    local port=$1 pid=$2 owners owner
    command -v ss >/dev/null || return 0
    owners=$(ss -Hltnp "sport = :$port" | grep -o 'pid=[0-9]*' | cut -d= -f2)
    for owner in $owners; do
        [ "$owner" = "$pid" ] && return 0
        [ "$(awk '{print $4}' "/proc/$owner/stat" 2>/dev/null)" = "$pid" ] && return 0
    done
    return 1
}

# --- configs --------------------------------------------------------------------------------
# fill TEMPLATE OUT KEY=VALUE...: copy TEMPLATE to OUT with every @KEY@ replaced by VALUE.
# Fails, naming them, if the template has placeholders no KEY=VALUE fills.
fill() {
    local in=$1 out=$2 kv text left
    text=$(<"$in")
    shift 2
    for kv in "$@"; do text=${text//@${kv%%=*}@/${kv#*=}}; done
    left=$(grep -o '@[A-Z_0-9]*@' <<<"$text" | sort -u | tr '\n' ' ' || true)
    [ -z "$left" ] || die "fill: $in: nothing given for $left"
    printf '%s\n' "$text" >"$out"
}

# The limits the subcommands use, nginx's and tollgate's equivalent (the block: shellcheck,
# reading this file alone, sees no use of them). nginx variables are written into the nginx
# config as they are.
# shellcheck disable=SC2016,SC2034
{
    BY_ADDR='$binary_remote_addr'
    BY_KEY='$http_x_api_key'
    # forwarded: never reached. tollgate's finest rate is 1000000/s.
    FWD_NGINX=("$BY_ADDR" 10m 1000000r/s 1000000)
    FWD_TOLLGATE=(1000000/s 1000000 ip)
    # rejected: one request, then 429 for everyone (all clients are 127.0.0.1). nginx's slowest
    # rate is 1r/m, so it may admit one more request per minute than tollgate's 1/day.
    REJ_NGINX=("$BY_ADDR" 10m 1r/m 1)
    REJ_TOLLGATE=(1/day 1 ip)
    # many keys: a per-key limit no key reaches (each key is sent a few times per second at most).
    KEY_NGINX=("$BY_KEY" 64m 1000r/s 1000)
    KEY_TOLLGATE=(1000/s 1000 header:X-API-Key)
    # tollgate's limiter blocks (the YAML under `limiter:`).
    LOCAL='  backend: local'
    # Scenario 4's 100k keys all come from 127.0.0.1: without the per-address cap on buckets
    # (nginx has none), not capped at 1000 buckets for the one client.
    KEY_LOCAL="$LOCAL
  local: { max_buckets_per_peer: 1000000 }"
}
redis_limiter() {
    printf '  backend: redis\n  on_failure: closed\n  redis:\n    url: redis://127.0.0.1:%s' "$REDIS_PORT"
}

# client_defaults DURATION WARMUP: the load client's settings, from the environment or these
# defaults (64 connections, 2 threads).
client_defaults() {
    DURATION=${DURATION:-$1}
    WARMUP=${WARMUP:-$2}
    CONNECTIONS=${CONNECTIONS:-64}
    THREADS=${THREADS:-2}
}

# tollgate_config FILE PORT LIMITER RATE BURST KEY: tollgate forwarding to the backend with one
# limit (benches/compare/tollgate.yaml.in). TOLLGATE_HEADERS [true] turns the rate-limit
# headers on or off; TOLLGATE_LIMIT [unset: the token bucket of RATE and BURST] is the limit's
# kind as one YAML mapping entry in their place (`quota: 1000000000/day`, `concurrency:
# 100000`); TOLLGATE_EXTRA [none] adds further limits to the route, as YAML lines;
# TOLLGATE_BUFFERING [unset: the binary's default] sets the route's request and response
# buffering; TOLLGATE_TOP [none] adds top-level keys, as YAML lines.
tollgate_config() {
    local buffering="    # buffering: the binary's default"
    local limit="        rate: $4
        burst: $5"
    if [ -n "${TOLLGATE_BUFFERING:-}" ]; then
        buffering="    buffering: { request: $TOLLGATE_BUFFERING, response: $TOLLGATE_BUFFERING }"
    fi
    [ -z "${TOLLGATE_LIMIT:-}" ] || limit="        $TOLLGATE_LIMIT"
    fill "$CONF/tollgate.yaml.in" "$1" PORT="$2" BACKEND_PORT="$BACKEND_PORT" LIMITER="$3" \
        HEADERS="${TOLLGATE_HEADERS:-true}" LIMIT="$limit" KEY="$6" \
        EXTRA="${TOLLGATE_EXTRA:-}" BUFFERING="$buffering" TOP="${TOLLGATE_TOP:-}" \
        UPSTREAM="${TOLLGATE_UPSTREAM:-    # protocol: http1 (the default)}"
}

# --- binaries -------------------------------------------------------------------------------
# copy_binary VAR PATH: copy the binary at PATH into TMP and set VAR to the copy, VAR_SOURCE to
# PATH (absolute). A build that replaces PATH mid-run does not change what later runs start.
copy_binary() {
    local src
    if ! { [ -f "$2" ] && [ -x "$2" ]; }; then die "no binary at $2"; fi
    src=$(realpath "$2")
    mkdir -p "$TMP/bin"
    cp "$src" "$TMP/bin/$1"
    printf -v "$1" '%s' "$TMP/bin/$1"
    printf -v "$1_SOURCE" '%s' "$src"
}

# release_binary VAR OVERRIDE PATH "WATCHED..." CARGO_ARGS...: copy_binary VAR of the binary named
# by the variable OVERRIDE when it is set, else of PATH (relative to the repository), first
# built with `cargo build --release --locked CARGO_ARGS` when it is missing or older than any
# of the WATCHED paths.
release_binary() {
    local var=$1 override=$2 path=$3 watched=$4
    shift 4
    if [ -n "${!override:-}" ]; then
        copy_binary "$var" "${!override}"
        return
    fi
    # shellcheck disable=SC2086 # WATCHED is a list of paths
    if [ ! -x "$ROOT/$path" ] || [ -n "$(cd "$ROOT" && find $watched -newer "$path" -print -quit)" ]; then
        log "building $path (cargo build --release --locked $*)"
        (cd "$ROOT" && cargo build --release --locked "$@") >&2
    fi
    copy_binary "$var" "$ROOT/$path"
}

# tollgate_binary: TOLLGATE, the tollgate to measure: TOLLGATE_BIN, or target/release/tollgate
# (built when missing or older than src/, Cargo.toml or Cargo.lock).
tollgate_binary() {
    release_binary TOLLGATE TOLLGATE_BIN target/release/tollgate "src Cargo.toml Cargo.lock" --bin tollgate
}

# --- the processes measured -----------------------------------------------------------------
# start_backend: the backend every proxy forwards to (nginx, 1 worker, `return 200 "ok\n"`,
# benches/compare/backend.conf.in) on an HTTP/1.1 and an h2c port; returns once both listen.
# Sets BACKEND_PID, BACKEND_PORT, BACKEND_H2_PORT.
start_backend() {
    local dir=$TMP/backend
    mkdir -p "$dir"
    BACKEND_PORT=$(free_port)
    BACKEND_H2_PORT=$(free_port)
    fill "$CONF/backend.conf.in" "$dir/nginx.conf" DIR="$dir" PORT="$BACKEND_PORT" H2_PORT="$BACKEND_H2_PORT"
    spawn backend nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log"
    BACKEND_PID=$SPAWNED
    wait_port "$BACKEND_PORT" "$BACKEND_PID" backend
    wait_port "$BACKEND_H2_PORT" "$BACKEND_PID" backend
}

# start_otlp_sink: when TRACES_A or TRACES_B is set, an OTLP/HTTP receiver that takes every
# batch unread (tests/fixtures/otlp/receiver.py sink). Sets OTLP_PORT.
start_otlp_sink() {
    [ "${TRACES_A:-off}${TRACES_B:-off}" != offoff ] || return 0
    need_python_module opentelemetry.proto opentelemetry-proto
    spawn otlp python3 "$ROOT/tests/fixtures/otlp/receiver.py" sink
    for _ in $(seq 100); do grep -q '^ready' "$TMP/otlp/stdout" && break; sleep 0.1; done
    OTLP_PORT=$(awk '{print $3}' "$TMP/otlp/stdout")
    [ -n "$OTLP_PORT" ] || die "the OTLP receiver did not start: $(cat "$TMP/otlp/stderr")"
}

# start_nginx NAME ZONE_KEY ZONE_SIZE RATE BURST: nginx as the rate-limiting proxy (2 workers,
# benches/compare/nginx-proxy.conf.in) in $TMP/NAME, forwarding to the backend. NGINX_LOG
# [off] is its access log: off, `file` ($TMP/NAME/access.log, each line written at once) or
# `buffered` (the same file, `buffer=64k flush=1s`). Sets NGINX_PID, NGINX_PORT, NGINX_H2_PORT.
start_nginx() {
    local dir=$TMP/$1 access="access_log off;"
    mkdir -p "$dir"
    case ${NGINX_LOG:-off} in
        file) access="access_log $dir/access.log combined;" ;;
        buffered) access="access_log $dir/access.log combined buffer=64k flush=1s;" ;;
    esac
    NGINX_PORT=$(free_port)
    NGINX_H2_PORT=$(free_port)
    # NGINX_PASS=grpc: to the backend over h2c (`grpc_pass`, nginx's only HTTP/2 upstream).
    local pass="proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_set_header Host \$http_host;"
    [ "${NGINX_PASS:-proxy}" != grpc ] || pass="grpc_pass grpc://backend;
            grpc_set_header Host \$http_host;"
    fill "$CONF/nginx-proxy.conf.in" "$dir/nginx.conf" DIR="$dir" PORT="$NGINX_PORT" \
        H2_PORT="$NGINX_H2_PORT" BACKEND_PORT="$BACKEND_PORT" ZONE_KEY="$2" ZONE_SIZE="$3" \
        RATE="$4" BURST="$5" ACCESS_LOG="$access" PASS="$pass" \
        SET_HEADER="${NGINX_PASS:-proxy}_set_header"
    spawn "$1" nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log"
    NGINX_PID=$SPAWNED
    wait_port "$NGINX_PORT" "$NGINX_PID" "nginx ($1)"
    wait_port "$NGINX_H2_PORT" "$NGINX_PID" "nginx ($1)"
}

# start_tollgate NAME LIMITER RATE BURST KEY: the binary TOLLGATE with tollgate_config, in
# $TMP/NAME, at --log-level warn. ACCESS_LOG [false] is its --access-log; `file`
# means $TMP/NAME/access.log. Sets TOLLGATE_PID, TOLLGATE_PORT.
start_tollgate() {
    local dir=$TMP/$1 access=${ACCESS_LOG:-false}
    mkdir -p "$dir"
    [ "$access" != file ] || access=$dir/access.log
    TOLLGATE_PORT=$(free_port)
    tollgate_config "$dir/tollgate.yaml" "$TOLLGATE_PORT" "$2" "$3" "$4" "$5"
    spawn "$1" "$TOLLGATE" --access-log "$access" --log-level warn run --config "$dir/tollgate.yaml"
    TOLLGATE_PID=$SPAWNED
    wait_port "$TOLLGATE_PORT" "$TOLLGATE_PID" "tollgate ($1)"
}

# check_log NAME: note the warnings or errors tollgate's run in $TMP/NAME logged.
check_log() {
    local name=$1 n
    n=$(grep -c . "$TMP/$name/stderr" 2>/dev/null || true)
    if [ "${n:-0}" -gt 0 ]; then
        note "tollgate ($name) logged $n warning/error lines, first: $(head -c 300 "$TMP/$name/stderr" | head -1)"
    fi
}

# tollgate_measures NAME LIMITER RATE BURST KEY MEASURE SCENARIO TARGET [ARGS...]: start tollgate
# with that limiter and limit, run MEASURE (measure_wrk, say) on it with ARGS, stop it and note
# what it logged.
tollgate_measures() {
    local name=$1 limiter=$2 rate=$3 burst=$4 key=$5 measure=$6 scen=$7 target=$8
    shift 8
    start_tollgate "$name" "$limiter" "$rate" "$burst" "$key"
    "$measure" "$scen" "$target" "$TOLLGATE_PID" "http://127.0.0.1:$TOLLGATE_PORT/" "$@"
    stop "$TOLLGATE_PID"
    check_log "$name"
}

# start_redis: one redis-server without persistence. Sets REDIS_PID, REDIS_PORT, REDIS_PORTS.
start_redis() {
    local dir=$TMP/redis
    mkdir -p "$dir"
    REDIS_PORT=$(free_port)
    spawn redis redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$dir" --save "" \
        --appendonly no --daemonize no --logfile "$dir/redis.log"
    REDIS_PID=$SPAWNED
    REDIS_PORTS=("$REDIS_PORT")
    wait_port "$REDIS_PORT" "$REDIS_PID" redis-server
}

# "ALL SCRIPTS CPU TAKES DROPS": commands Redis has processed, and of those the script calls
# (EVAL, EVALSHA and their _RO forms), the CPU time the servers used (user + system,
# microseconds), and the ZADD and ZREM commands run (one each by a concurrency lease's take and
# its release, both inside slots.lua; its renewals, a few a minute, count as takes), summed over the servers of REDIS_PORTS. Commands a
# script runs inside Redis (TIME, GET, SET) count in ALL too, so SCRIPTS per request is the
# number of round trips a request costs.
redis_commands() {
    local port
    for port in "${REDIS_PORTS[@]}"; do
        redis-cli -p "$port" info commandstats cpu
    done | tr -d '\r' | awk -F'[:=,]' '
        /^cmdstat_/ { all += $3; if ($1 ~ /^cmdstat_eval/) scripts += $3 }
        /^cmdstat_zadd:/ { takes += $3 }
        /^cmdstat_zrem:/ { drops += $3 }
        /^used_cpu_(sys|user):/ { cpu += $2 }
        END { printf "%d %d %.0f %d %d\n", all, scripts, cpu * 1e6, takes, drops }'
}

# --- CPU and memory of a process ------------------------------------------------------------
# cpu_ticks PID: CPU time used so far by PID and its children (nginx's workers), in clock
# ticks: "USER SYSTEM".
cpu_ticks() {
    local user=0 sys=0 p u s
    for p in "$1" $(pgrep -P "$1" || true); do
        read -r u s < <(awk '{print $14, $15}' "/proc/$p/stat" 2>/dev/null || echo 0 0)
        user=$((user + u))
        sys=$((sys + s))
    done
    echo "$user $sys"
}

# cpu_per_request "U0 S0" "U1 S1" REQUESTS: user and system CPU per request between two
# cpu_ticks, in microseconds: "USER/SYSTEM".
cpu_per_request() {
    awk -v a="$1" -v b="$2" -v n="$3" -v tck="$(getconf CLK_TCK)" 'BEGIN {
        split(a, x, " "); split(b, y, " "); n = n > 0 ? n : 1
        printf "%.2f/%.2f\n", (y[1] - x[1]) * 1e6 / tck / n, (y[2] - x[2]) * 1e6 / tck / n }'
}

# rss_kb PID [FIELD]: FIELD of /proc/PID/status (VmRSS unless told; VmHWM is the peak) of PID and
# its children (nginx: master and workers), summed, in kB.
rss_kb() {
    local total=0 p kb
    for p in "$1" $(pgrep -P "$1" || true); do
        kb=$(awk -v f="${2:-VmRSS}:" '$1 == f {print $2}' "/proc/$p/status" 2>/dev/null || true)
        total=$((total + ${kb:-0}))
    done
    echo "$total"
}

# reset_peak_rss PID: the peak RSS of PID and its children set to their current RSS (Linux
# clear_refs 5).
reset_peak_rss() {
    local p
    for p in "$1" $(pgrep -P "$1" || true); do
        echo 5 >"/proc/$p/clear_refs" 2>/dev/null || true
    done
}

# --- measuring ------------------------------------------------------------------------------
# count_start PID OUT: count the system calls and context switches of PID, its threads and its
# children (nginx's workers) with `perf stat` into OUT, until count_stop. measure_wrk counts
# over the warm-up, not the measured run: counting a tracepoint slows every system call, and
# req/s and p99 must not pay for it. Without perf (or its permission), OUT stays empty and the
# report shows "-".
count_start() {
    local pids
    COUNTER=""
    : >"$2"
    command -v perf >/dev/null || return 0
    pids=$({ echo "$1"; pgrep -P "$1" || true; } | paste -sd,)
    perf stat -x, -e raw_syscalls:sys_enter,context-switches -p "$pids" -o "$2" 2>/dev/null &
    COUNTER=$!
    PIDS+=("$COUNTER")
    sleep 0.3 # perf attaches before the client starts
}
count_stop() {
    [ -n "$COUNTER" ] || return 0
    kill -INT "$COUNTER" 2>/dev/null || true
    wait "$COUNTER" 2>/dev/null || true
    local keep=() p
    for p in "${PIDS[@]}"; do [ "$p" = "$COUNTER" ] || keep+=("$p"); done
    PIDS=("${keep[@]}")
    COUNTER=""
}

# Rows of the report: scenario, target, the client's figures, peak RSS, probe[, CPU[, system
# calls and context switches per request]].
row() {
    local IFS=$'\t'
    echo "$*" >>"$ROWS"
}
# ratio LABEL SCENARIO_A TARGET_A SCENARIO_B TARGET_B: A against B in the report.
ratio() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RATIOS"; }
note() { printf -- '- %s\n' "$*" >>"$NOTES"; }

# out_file SCENARIO TARGET: OUT, a new file name in TMP for one run's raw client output.
out_file() {
    RUN=$((${RUN:-0} + 1))
    OUT=$TMP/run-$RUN-$(echo "$1-$2" | tr -c 'a-zA-Z0-9' _).txt
}

# measure_wrk SCENARIO TARGET PID URL [HEADER] [LUA]: WARMUP seconds of wrk, then DURATION
# seconds measured (wrk -tTHREADS -cCONNECTIONS --latency, with the script LUA), the user and
# system CPU per request of PID and its children over the measured run, PID's peak RSS and one
# probe request (with HEADER): one row of the report. For the targets "tollgate (redis...)"
# and "tollgate (cluster)", a note of the script calls per request Redis ran (and, when there
# were any, the concurrency leases taken and released per request).
measure_wrk() {
    local scen=$1 target=$2 pid=$3 url=$4 header=${5:-} lua=${6:-}
    local out args=() probe_args=() before="" cpu0 cpu1 cpu rss probe fields sys
    out_file "$scen" "$target"
    out=$OUT
    [ -n "$lua" ] && args+=(-s "$lua")
    [ -n "$header" ] && probe_args+=(-H "$header")
    log "$scen / $target: ${WARMUP}s warm-up + ${DURATION}s (wrk -t$THREADS -c$CONNECTIONS)"
    count_start "$pid" "$out.perf"
    bounded $((WARMUP + 30)) "$out.warmup" wrk -t"$THREADS" -c"$CONNECTIONS" -d"${WARMUP}s" \
        "${args[@]}" "$url" || die "wrk warm-up failed: $(cat "$out.warmup")"
    count_stop
    sys=$(python3 "$CONF/summarize.py" perf "$out.perf" "$out.warmup")
    case $target in "tollgate (redis"* | "tollgate (cluster)") before=$(redis_commands) ;; esac
    cpu0=$(cpu_ticks "$pid")
    bounded $((DURATION + 30)) "$out" wrk -t"$THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency \
        "${args[@]}" "$url" || die "wrk failed: $(cat "$out")"
    cpu1=$(cpu_ticks "$pid")
    rss=$(rss_kb "$pid" VmHWM)
    probe=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "${probe_args[@]}" "$url" || echo failed)
    fields=$(python3 "$CONF/summarize.py" wrk "$out")
    cpu=$(cpu_per_request "$cpu0" "$cpu1" "$(cut -f4 <<<"$fields" | tr -c '0-9\n' 0)")
    row "$scen" "$target" "$fields" "$rss" "$probe" "$cpu" "$sys"
    log "$scen / $target: $(awk -F'\t' '{printf "%.0f req/s, p99 %s ms, %s non-2xx", $1, $3, $5}' <<<"$fields"), CPU ${cpu/\// + } us, syscalls/switches ${sys/\// \/ } per request"
    if [ -n "$before" ]; then
        local after total
        after=$(redis_commands)
        total=$(cut -f4 <<<"$fields")
        # $before and $after are three numbers each: split on purpose.
        # shellcheck disable=SC2086
        note "$(python3 - "$scen" "$total" "${#REDIS_PORTS[@]}" $before $after <<'PY'
import sys
scen, total, servers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
a0, s0, c0, t0, d0, a1, s1, c1, t1, d1 = map(int, sys.argv[4:])
all_, scripts = a1 - a0 - servers, s1 - s0  # less the INFO that took the first snapshot
takes, drops, n = t1 - t0, d1 - d0, max(total, 1)
leases = (f" ({takes / n:.3f} lease takes and {drops / n:.3f} releases per request)"
          if takes or drops else "")
print(f"{scen}: Redis ran {scripts} script calls ({all_} commands counting those the script "
      f"runs inside Redis) for {total} requests completed in the measured run: "
      f"{scripts / n:.3f} round trips per request{leases} (the requests still in flight at "
      f"the end make this slightly above the real figure); redis-server used "
      f"{(c1 - c0) / n:.2f} us of CPU per request (not in the table's CPU column).")
PY
)"
    fi
}

# rounds "F..." [ARGS...]: ROUNDS times, each function F with ARGS (the measurements of one
# scenario, such as nginx's and tollgate's), each round starting one function later (A B, then
# B A; or A B C, B C A, C A B), so that a drift of the machine's speed weighs on all alike.
rounds() {
    local fs r i n
    read -r -a fs <<<"$1"
    shift
    n=${#fs[@]}
    for ((r = 0; r < ROUNDS; r++)); do
        for ((i = 0; i < n; i++)); do "${fs[(r + i) % n]}" "$@"; done
    done
}

# report: the Markdown table of the rows, the ratios (between medians when there are several
# rounds, and round by round) and the notes.
report() {
    python3 "$CONF/summarize.py" report "$ROWS" "$RATIOS"
    if [ -s "$NOTES" ]; then
        echo
        cat "$NOTES"
    fi
}
