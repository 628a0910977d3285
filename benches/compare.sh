#!/usr/bin/env bash
# Load comparison of tollgate against nginx (proxy_pass + limit_req) on this machine.
#
#   benches/compare.sh
#
# Starts on 127.0.0.1 only: a backend (nginx, 1 worker, `return 200 "ok\n"`), nginx as the
# rate-limiting proxy (2 workers), tollgate with the equivalent YAML, and redis-server for the
# Redis scenarios. Each proxy is started afresh for each scenario, so its peak RSS (VmHWM) is
# that scenario's. Runs wrk (HTTP/1.1), h2load (h2c) and h2load --h1 --rps (HTTP/1.1 at a fixed
# rate, scenarios 6 and 7) for a fixed time after a warm-up, prints one Markdown table with
# ratios, writes it to a results file, and stops every process it started (also on failure or
# Ctrl-C). See docs/performance.md for what each scenario measures.
#
# Environment (defaults in brackets):
#   DURATION [10]      seconds measured per run          WARMUP [2]  seconds of warm-up per run
#   CONNECTIONS [64]   client connections                THREADS [2] wrk/h2load threads
#   H2_STREAMS [10]    concurrent streams per h2 connection (h2load -m)
#   KEYS [100000]      distinct X-API-Key values in scenario 4
#   TOLLGATE_HEADERS [true]  tollgate's rate-limit response headers (nginx sends none): `false`
#                      turns both header families off
#   FIXED_RPS [900]    requests per second per connection in scenarios 6 and 7 (h2load --rps):
#                      64 x 900 = 57,600 req/s, below what either proxy forwards at most
#   SCENARIOS [baseline forwarded rejected redis cluster slots keys h2 fixed]  which scenarios
#                      to run
#   ROUNDS [1]         measure nginx and tollgate this many times each in scenarios 1, 2, 4, 6, 7
#                      (and tollgate with Redis and in process in scenarios 3, 3c, 3d),
#                      alternating which goes first; ratios are taken between the medians, and
#                      each round's own ratio is listed
#   TOLLGATE_BIN       a tollgate binary to use; without it target/release/tollgate is built with
#                      `cargo build --release --locked` when missing or older than src/,
#                      Cargo.toml or Cargo.lock
#   RESULTS [target/compare/results-DATE.md]  where the report is written
#   KEEP_TMP [0]       1 keeps the temp dir (configs, logs, raw wrk/h2load output)
set -euo pipefail

DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-2}
H2_STREAMS=${H2_STREAMS:-10}
KEYS=${KEYS:-100000}
TOLLGATE_HEADERS=${TOLLGATE_HEADERS:-true}
FIXED_RPS=${FIXED_RPS:-900}
SCENARIOS=${SCENARIOS:-baseline forwarded rejected redis cluster slots keys h2 fixed}
# Further limits of tollgate's route, as YAML lines (scenario 3d sets one).
TOLLGATE_EXTRA=
ROUNDS=${ROUNDS:-1}
KEEP_TMP=${KEEP_TMP:-0}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HERE=$ROOT/benches/compare
cd "$ROOT"
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
RESULTS=${RESULTS:-$ROOT/target/compare/results-$(date +%Y%m%d-%H%M%S).md}
started_at=$SECONDS
LOAD_BEFORE=$(cut -d" " -f1-3 /proc/loadavg)
# What else was using the CPU (top's second frame: the last half second).
BUSY_BEFORE=$(top -bn2 -d0.5 -w 512 -o %CPU 2>/dev/null | awk '/^ *PID/ {frame++; next} frame == 2 && n < 3 && $9 + 0 > 0 {printf "%s%s %s%%", (n++ ? ", " : ""), $12, $9}')
BUSY_BEFORE=${BUSY_BEFORE:-none}

log() { printf "== %s %s\n" "$(date +%T)" "$*" >&2; }

# --- what is needed -------------------------------------------------------------------------
missing=()
command -v nginx >/dev/null || missing+=(nginx)
command -v wrk >/dev/null || missing+=(wrk)
command -v h2load >/dev/null || missing+=(nghttp2-client)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-cli >/dev/null || missing+=(redis-tools)
command -v curl >/dev/null || missing+=(curl)
command -v python3 >/dev/null || missing+=(python3)
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi

if [ -n "${TOLLGATE_BIN:-}" ]; then
    BIN=$(realpath "$TOLLGATE_BIN")
else
    BIN=$ROOT/target/release/tollgate
    if [ ! -x "$BIN" ] || [ -n "$(find src Cargo.toml Cargo.lock -newer "$BIN" -print -quit)" ]; then
        log "building target/release/tollgate (cargo build --release --locked)"
        cargo build --release --locked
    fi
fi
[ -x "$BIN" ] || die "no tollgate binary at $BIN"

# --- processes: everything started here is stopped on exit ----------------------------------
TMP=$(mktemp -d "${TMPDIR:-/tmp}/tollgate-compare.XXXXXX")
chmod 755 "$TMP" # nginx workers run as nobody
PIDS=()          # long-lived processes, stopped by cleanup
CURRENT=""       # the wrk/h2load run in progress

cleanup() {
    local rc=$? pid
    trap - EXIT INT TERM
    if [ -n "$CURRENT" ]; then kill -TERM "$CURRENT" 2>/dev/null || true; fi
    for pid in "${PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}" $CURRENT; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [ "$KEEP_TMP" = 1 ] || [ "$rc" -ne 0 ]; then
        log "logs, configs and raw output kept in $TMP"
    else
        rm -rf "$TMP"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A private copy: another build replacing target/release/tollgate mid-run must not change
# which binary the later scenarios start.
BIN_BUILT=$(date -u -r "$BIN" '+%Y-%m-%d %H:%M UTC')
cp "$BIN" "$TMP/tollgate-bin"
BIN_SOURCE=$BIN
BIN=$TMP/tollgate-bin

# Stop one process started by start_*, and forget it.
stop() {
    local pid=$1 keep=() p
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    for p in "${PIDS[@]}"; do [ "$p" = "$pid" ] || keep+=("$p"); done
    PIDS=("${keep[@]}")
}

# Peak RSS in kB of PID and its children (nginx: master + workers), from VmHWM.
peak_rss() {
    local total=0 p kb
    for p in "$1" $(pgrep -P "$1" || true); do
        kb=$(awk '/^VmHWM:/ {print $2}' "/proc/$p/status" 2>/dev/null || true)
        total=$((total + ${kb:-0}))
    done
    echo "$total"
}

# Reset the peak RSS of PID and its children to their current RSS (Linux clear_refs 5).
reset_peak_rss() {
    local p
    for p in "$1" $(pgrep -P "$1" || true); do
        echo 5 >"/proc/$p/clear_refs" 2>/dev/null || true
    done
}

start_backend() {
    local dir=$TMP/backend
    mkdir -p "$dir"
    BACKEND_PORT=$(free_port)
    BACKEND_H2_PORT=$(free_port)
    fill "$HERE/backend.conf.in" "$dir/nginx.conf" DIR="$dir" PORT="$BACKEND_PORT" H2_PORT="$BACKEND_H2_PORT"
    nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" >"$dir/stdout" 2>&1 &
    BACKEND_PID=$!
    PIDS+=("$BACKEND_PID")
    wait_port "$BACKEND_PORT" "$BACKEND_PID" backend
    wait_port "$BACKEND_H2_PORT" "$BACKEND_PID" backend
}

# start_nginx NAME ZONE_KEY ZONE_SIZE RATE BURST -> NGINX_PID, NGINX_PORT, NGINX_H2_PORT
start_nginx() {
    local dir=$TMP/$1
    mkdir -p "$dir"
    NGINX_PORT=$(free_port)
    NGINX_H2_PORT=$(free_port)
    fill "$HERE/nginx-proxy.conf.in" "$dir/nginx.conf" DIR="$dir" PORT="$NGINX_PORT" \
        H2_PORT="$NGINX_H2_PORT" BACKEND_PORT="$BACKEND_PORT" ZONE_KEY="$2" ZONE_SIZE="$3" \
        RATE="$4" BURST="$5"
    nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" >"$dir/stdout" 2>&1 &
    NGINX_PID=$!
    PIDS+=("$NGINX_PID")
    wait_port "$NGINX_PORT" "$NGINX_PID" "nginx ($1)"
    wait_port "$NGINX_H2_PORT" "$NGINX_PID" "nginx ($1)"
}

# start_tollgate NAME LIMITER RATE BURST KEY -> TOLLGATE_PID, TOLLGATE_PORT
start_tollgate() {
    local dir=$TMP/$1
    mkdir -p "$dir"
    TOLLGATE_PORT=$(free_port)
    fill "$HERE/tollgate.yaml.in" "$dir/tollgate.yaml" PORT="$TOLLGATE_PORT" \
        BACKEND_PORT="$BACKEND_PORT" LIMITER="$2" HEADERS="$TOLLGATE_HEADERS" RATE="$3" \
        BURST="$4" KEY="$5" EXTRA="$TOLLGATE_EXTRA"
    (cd "$dir" && exec "$BIN" --access-log false --log-level warn run --config "$dir/tollgate.yaml") \
        >"$dir/stdout" 2>"$dir/stderr" &
    TOLLGATE_PID=$!
    PIDS+=("$TOLLGATE_PID")
    wait_port "$TOLLGATE_PORT" "$TOLLGATE_PID" "tollgate ($1)"
}

# tollgate_measures NAME LIMITER RATE BURST KEY MEASURE SCENARIO TARGET [ARGS...]: start tollgate
# with that limiter and limit, run MEASURE (measure_wrk, measure_h2 or measure_fixed) on it with
# ARGS, stop it and note what it logged.
tollgate_measures() {
    local name=$1 limiter=$2 rate=$3 burst=$4 key=$5 measure=$6 scen=$7 target=$8
    shift 8
    start_tollgate "$name" "$limiter" "$rate" "$burst" "$key"
    "$measure" "$scen" "$target" "$TOLLGATE_PID" "http://127.0.0.1:$TOLLGATE_PORT/" "$@"
    stop "$TOLLGATE_PID"
    check_log "$name"
}

start_redis() {
    local dir=$TMP/redis
    mkdir -p "$dir"
    REDIS_PORT=$(free_port)
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$dir" --save "" --appendonly no \
        --daemonize no --logfile "$dir/redis.log" >/dev/null 2>&1 &
    REDIS_PID=$!
    PIDS+=("$REDIS_PID")
    REDIS_PORTS=("$REDIS_PORT")
    wait_port "$REDIS_PORT" "$REDIS_PID" redis-server
}

ROWS=$TMP/rows.tsv
RATIOS=$TMP/ratios.tsv
NOTES=$TMP/notes.md
: >"$ROWS"
: >"$RATIOS"
: >"$NOTES"
ratio() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RATIOS"; }
note() { printf -- '- %s\n' "$*" >>"$NOTES"; }

# Run one command bounded in time, in the background so that a signal reaches the trap at once.
bounded() {
    local limit=$1
    shift
    timeout --kill-after=5 "$limit" "$@" &
    CURRENT=$!
    local rc=0
    wait "$CURRENT" || rc=$?
    CURRENT=""
    return "$rc"
}

# measure_wrk SCENARIO TARGET PID URL [HEADER] [LUA]: warm-up, measured run, peak RSS, probe.
measure_wrk() {
    local scen=$1 target=$2 pid=$3 url=$4 header=${5:-} lua=${6:-}
    local out args=() probe_args=()
    RUN=$((${RUN:-0} + 1))
    out=$TMP/run-$RUN-$(echo "$scen-$target" | tr -c 'a-zA-Z0-9' _).txt
    [ -n "$lua" ] && args+=(-s "$lua")
    [ -n "$header" ] && probe_args+=(-H "$header")
    log "$scen / $target: ${WARMUP}s warm-up + ${DURATION}s (wrk -t$THREADS -c$CONNECTIONS)"
    bounded $((WARMUP + 30)) wrk -t"$THREADS" -c"$CONNECTIONS" -d"${WARMUP}s" "${args[@]}" "$url" \
        >"$out.warmup" 2>&1 || die "wrk warm-up failed: $(cat "$out.warmup")"
    local before="" cpu0 cpu1 cpu
    case $target in "tollgate (redis)" | "tollgate (cluster)") before=$(redis_commands) ;; esac
    cpu0=$(cpu_ticks "$pid")
    bounded $((DURATION + 30)) wrk -t"$THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency \
        "${args[@]}" "$url" >"$out" 2>&1 || die "wrk failed: $(cat "$out")"
    cpu1=$(cpu_ticks "$pid")
    local rss probe fields
    rss=$(peak_rss "$pid")
    probe=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "${probe_args[@]}" "$url" || echo failed)
    fields=$(python3 "$HERE/summarize.py" wrk "$out")
    # The process's user and system CPU per request of the measured run, in microseconds.
    # shellcheck disable=SC2086 # two numbers each
    cpu=$(python3 -c 'import sys; u0, s0, u1, s1, tck, n = map(float, sys.argv[1:]); print(f"{(u1 - u0) * 1e6 / tck / max(n, 1):.2f}/{(s1 - s0) * 1e6 / tck / max(n, 1):.2f}")' \
        $cpu0 $cpu1 "$(getconf CLK_TCK)" "$(cut -f4 <<<"$fields" | tr -c '0-9\n' 0)")
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$scen" "$target" "$fields" "$rss" "$probe" "$cpu" >>"$ROWS"
    if [ -n "$before" ]; then
        local after total
        after=$(redis_commands)
        total=$(cut -f4 <<<"$fields")
        # $before and $after are three numbers each: split on purpose.
        # shellcheck disable=SC2086
        note "$(python3 - "$scen" "$total" "${#REDIS_PORTS[@]}" $before $after <<'PY'
import sys
scen, total, servers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
a0, s0, c0, a1, s1, c1 = map(int, sys.argv[4:])
all_, scripts = a1 - a0 - servers, s1 - s0  # less the INFO that took the first snapshot
print(f"{scen}: Redis ran {scripts} script calls ({all_} commands counting those the script "
      f"runs inside Redis) for {total} requests completed in the measured run: "
      f"{scripts / max(total, 1):.3f} round trips per request (the requests still in flight at "
      f"the end make this slightly above the real figure); redis-server used "
      f"{(c1 - c0) / max(total, 1):.2f} us of CPU per request (not in the table's CPU column).")
PY
)"
    fi
}

# measure_h2 SCENARIO TARGET PID URL
measure_h2() {
    local scen=$1 target=$2 pid=$3 url=$4
    local out
    out=$TMP/run-$(echo "$scen-$target" | tr -c 'a-zA-Z0-9' _).txt
    log "$scen / $target: ${WARMUP}s warm-up + ${DURATION}s (h2load -t$THREADS -c$CONNECTIONS -m$H2_STREAMS)"
    bounded $((WARMUP + DURATION + 30)) h2load -t"$THREADS" -c"$CONNECTIONS" -m"$H2_STREAMS" \
        -D "$DURATION" --warm-up-time "$WARMUP" --log-file "$out.log" "$url" >"$out" 2>&1 ||
        die "h2load failed: $(cat "$out")"
    local rss probe fields
    rss=$(peak_rss "$pid")
    probe=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 --http2-prior-knowledge "$url" || echo failed)
    fields=$(python3 "$HERE/summarize.py" h2load "$out" "$out.log")
    printf '%s\t%s\t%s\t%s\t%s\n' "$scen" "$target" "$fields" "$rss" "$probe" >>"$ROWS"
}

# measure_fixed SCENARIO TARGET PID URL: HTTP/1.1 at a fixed rate (FIXED_RPS per connection,
# h2load --h1 --rps), so latency is compared at the same load rather than at each proxy's own
# saturation, where wrk's closed loop measures it.
measure_fixed() {
    local scen=$1 target=$2 pid=$3 url=$4
    local out
    RUN=$((${RUN:-0} + 1))
    out=$TMP/run-$RUN-$(echo "$scen-$target" | tr -c 'a-zA-Z0-9' _).txt
    log "$scen / $target: ${WARMUP}s warm-up + ${DURATION}s (h2load --h1 -t$THREADS -c$CONNECTIONS --rps $FIXED_RPS)"
    bounded $((WARMUP + DURATION + 30)) h2load --h1 -t"$THREADS" -c"$CONNECTIONS" --rps="$FIXED_RPS" \
        -D "$DURATION" --warm-up-time "$WARMUP" --log-file "$out.log" "$url" >"$out" 2>&1 ||
        die "h2load failed: $(cat "$out")"
    local rss probe fields
    rss=$(peak_rss "$pid")
    probe=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$url" || echo failed)
    fields=$(python3 "$HERE/summarize.py" h2load "$out" "$out.log")
    printf '%s\t%s\t%s\t%s\t%s\n' "$scen" "$target" "$fields" "$rss" "$probe" >>"$ROWS"
}

# Warnings or errors a tollgate run logged (it runs at --log-level warn).
check_log() {
    local name=$1 n
    n=$(grep -c . "$TMP/$name/stderr" 2>/dev/null || true)
    if [ "${n:-0}" -gt 0 ]; then
        note "tollgate ($name) logged $n warning/error lines, first: $(head -c 300 "$TMP/$name/stderr" | head -1)"
    fi
}

want() { [[ " $SCENARIOS " == *" $1 "* ]]; }

# rounds A B [ARGS...]: run the functions A and B with ARGS (two measurements of one scenario,
# such as nginx's and tollgate's) ROUNDS times each, A first in odd rounds and B first in even ones, so that a drift of the
# machine's speed during the runs weighs on both alike.
rounds() {
    local r a=$1 b=$2
    shift 2
    for r in $(seq "$ROUNDS"); do
        if ((r % 2)); then "$a" "$@"; "$b" "$@"; else "$b" "$@"; "$a" "$@"; fi
    done
}

# --- the limits -----------------------------------------------------------------------------
# nginx variables, written into the nginx config as they are:
# shellcheck disable=SC2016
BY_ADDR='$binary_remote_addr'
# shellcheck disable=SC2016
BY_KEY='$http_x_api_key'
# forwarded: never reached. tollgate's finest rate is 1000000/s.
FWD_NGINX=("$BY_ADDR" 10m 1000000r/s 1000000)
FWD_TOLLGATE=(1000000/s 1000000 ip)
# rejected: one request, then 429 for everyone (all clients are 127.0.0.1). nginx's slowest
# rate is 1r/m, so it may admit one more request per minute than tollgate's 1/day.
REJ_NGINX=("$BY_ADDR" 10m 1r/m 1)
REJ_TOLLGATE=(1/day 1 ip)
# 100k keys: a per-key limit no key reaches (each key is sent a few times per second at most).
KEY_NGINX=("$BY_KEY" 64m 1000r/s 1000)
KEY_TOLLGATE=(1000/s 1000 header:X-API-Key)
LOCAL='  backend: local'
redis_limiter() {
    printf '  backend: redis\n  on_failure: closed\n  redis:\n    url: redis://127.0.0.1:%s' "$REDIS_PORT"
}
cluster_limiter() {
    printf '  backend: redis\n  on_failure: closed\n  redis:\n    cluster: [%s]' \
        "$(printf '"redis://127.0.0.1:%s", ' "${CLUSTER_PORTS[@]}" | sed 's/, $//')"
}

# --- the runs -------------------------------------------------------------------------------
start_backend
log "backend on $BACKEND_PORT (h2c $BACKEND_H2_PORT); tollgate: $BIN_SOURCE (built $BIN_BUILT)"

if want baseline; then
    measure_wrk "baseline" "backend alone" "$BACKEND_PID" "http://127.0.0.1:$BACKEND_PORT/"
fi

forwarded_nginx() {
    start_nginx nginx-forwarded "${FWD_NGINX[@]}"
    measure_wrk "1 forwarded" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/"
    stop "$NGINX_PID"
}
forwarded_tollgate() {
    tollgate_measures tollgate-forwarded "$LOCAL" "${FWD_TOLLGATE[@]}" \
        measure_wrk "1 forwarded" tollgate
}
if want forwarded; then
    rounds forwarded_nginx forwarded_tollgate
    ratio "1 forwarded, tollgate/nginx" "1 forwarded" tollgate "1 forwarded" nginx
fi

rejected_nginx() {
    start_nginx nginx-rejected "${REJ_NGINX[@]}"
    measure_wrk "2 rejected" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/"
    stop "$NGINX_PID"
}
rejected_tollgate() {
    tollgate_measures tollgate-rejected "$LOCAL" "${REJ_TOLLGATE[@]}" \
        measure_wrk "2 rejected" tollgate
}
if want rejected; then
    rounds rejected_nginx rejected_tollgate
    ratio "2 rejected, tollgate/nginx" "2 rejected" tollgate "2 rejected" nginx
fi

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
    rounds local_run shared_run "$@"
    ratio "$label" "$2" "$3" "$2" "tollgate (local)"
}
if want redis; then
    start_redis
    beside_local "3 redis forwarded, tollgate-redis/tollgate-local" \
        tollgate-redis "3 redis forwarded" "tollgate (redis)" "$(redis_limiter)"
    redis-cli -p "$REDIS_PORT" flushall >/dev/null
    tollgate_measures tollgate-redis-rejected "$(redis_limiter)" "${REJ_TOLLGATE[@]}" \
        measure_wrk "3 redis rejected" "tollgate (redis)"
    note "redis-server peak RSS $(($(peak_rss "$REDIS_PID") / 1024)) MB (not in the table's figure)."
    stop "$REDIS_PID"
    ratio "3 redis rejected, tollgate-redis/tollgate-local" "3 redis rejected" "tollgate (redis)" "2 rejected" tollgate
fi

if want cluster; then
    start_cluster
    beside_local "3c cluster forwarded, tollgate-cluster/tollgate-local" \
        tollgate-cluster "3c cluster forwarded" "tollgate (cluster)" "$(cluster_limiter)"
    for pid in "${CLUSTER_PIDS[@]}"; do stop "$pid"; done
fi

# Scenario 3d: a per-client and a `global` limit, the two buckets of a request in two slots
# on a cluster, against the same two limits in process.
if want slots; then
    TOLLGATE_EXTRA='      - { name: everyone, rate: 1000000/s, burst: 1000000, key: [global] }'
    start_cluster
    beside_local "3d two limits (ip + global) forwarded, tollgate-cluster/tollgate-local" \
        tollgate-slots "3d two limits forwarded" "tollgate (cluster)" "$(cluster_limiter)"
    for pid in "${CLUSTER_PIDS[@]}"; do stop "$pid"; done
    TOLLGATE_EXTRA=
fi

keys_nginx() {
    start_nginx nginx-keys "${KEY_NGINX[@]}"
    measure_wrk "4 $((KEYS / 1000))k keys" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_PORT/" \
        "X-API-Key: probe" "$HERE/keys.lua"
    stop "$NGINX_PID"
}
keys_tollgate() {
    tollgate_measures tollgate-keys "$LOCAL" "${KEY_TOLLGATE[@]}" \
        measure_wrk "4 $((KEYS / 1000))k keys" tollgate "X-API-Key: probe" "$HERE/keys.lua"
}
if want keys; then
    rounds keys_nginx keys_tollgate
    ratio "4 $((KEYS / 1000))k keys, tollgate/nginx" "4 $((KEYS / 1000))k keys" tollgate "4 $((KEYS / 1000))k keys" nginx
fi

if want h2; then
    reset_peak_rss "$BACKEND_PID"
    measure_h2 "5 h2 forwarded" "backend alone" "$BACKEND_PID" "http://127.0.0.1:$BACKEND_H2_PORT/"
    start_nginx nginx-h2 "${FWD_NGINX[@]}"
    measure_h2 "5 h2 forwarded" nginx "$NGINX_PID" "http://127.0.0.1:$NGINX_H2_PORT/"
    stop "$NGINX_PID"
    tollgate_measures tollgate-h2 "$LOCAL" "${FWD_TOLLGATE[@]}" \
        measure_h2 "5 h2 forwarded" tollgate
    ratio "5 h2 forwarded, tollgate/nginx" "5 h2 forwarded" tollgate "5 h2 forwarded" nginx
fi

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
if want fixed; then
    rounds fixed_nginx fixed_tollgate
    ratio "6 fixed-rate forwarded, tollgate/nginx" "6 fixed-rate forwarded" tollgate "6 fixed-rate forwarded" nginx
    ratio "7 fixed-rate rejected, tollgate/nginx" "7 fixed-rate rejected" tollgate "7 fixed-rate rejected" nginx
fi

if want forwarded && want rejected; then
    ratio "rejected/forwarded, nginx (>1: a 429 is cheaper than a forward)" "2 rejected" nginx "1 forwarded" nginx
    ratio "rejected/forwarded, tollgate" "2 rejected" tollgate "1 forwarded" tollgate
fi

# --- the report -----------------------------------------------------------------------------
mkdir -p "$(dirname "$RESULTS")"
{
    echo "# tollgate vs nginx, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "Machine: $(nproc) cores, $(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)," \
        "$(awk '/^MemTotal:/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo) RAM;" \
        "load average (1, 5, 15 min) before the run: $LOAD_BEFORE; busiest processes then: $BUSY_BEFORE."
    dirty=""
    git -C "$ROOT" diff --quiet HEAD -- src Cargo.toml Cargo.lock 2>/dev/null ||
        dirty=" (plus uncommitted changes in src/)"
    what="tollgate $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$dirty"
    [ -n "${TOLLGATE_BIN:-}" ] && what="tollgate $BIN_SOURCE (TOLLGATE_BIN)"
    echo "$what, binary built $BIN_BUILT;" \
        "$(nginx -v 2>&1 | sed 's/.*: //'), $(wrk -v 2>&1 | head -1 | awk '{print $1, $2}')," \
        "$(h2load --version | head -1), $(redis-server --version | awk '{print $1, $2, $3}')."
    echo "Each run: ${WARMUP}s warm-up, then ${DURATION}s measured, $CONNECTIONS connections," \
        "$THREADS client threads; h2 with $H2_STREAMS streams per connection;" \
        "$ROUNDS round(s) of scenarios 1, 2, 3, 3c, 3d, 4, 6 and 7; scenarios 6 and 7 at $FIXED_RPS req/s per connection." \
        "tollgate rate-limit headers: $TOLLGATE_HEADERS."
    echo
    python3 "$HERE/summarize.py" report "$ROWS" "$RATIOS"
    if [ -s "$NOTES" ]; then
        echo
        cat "$NOTES"
    fi
    echo
    echo "p50/p99: wrk --latency for HTTP/1.1; for h2, computed from h2load's per-request log."
    echo "Peak RSS: VmHWM of the proxy (nginx: master + workers, summed). non-2xx: responses that were"
    echo "not 2xx/3xx out of those completed; the probe is one curl request right after the run."
    echo "Total time: $((SECONDS - started_at)) s."
} >"$RESULTS.tmp"
mv "$RESULTS.tmp" "$RESULTS"
cat "$RESULTS"
log "results written to $RESULTS"
