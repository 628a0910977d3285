# shellcheck shell=bash
# Shell helpers shared by the bench scripts (sourced, not run).

# A port nothing listens on: bind :0 and let the kernel pick.
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# fill TEMPLATE OUT KEY=VALUE...: copy TEMPLATE to OUT with every @KEY@ replaced by VALUE.
# Fails, naming them, if the template has placeholders no KEY=VALUE fills.
fill() {
    local in=$1 out=$2 kv text left
    text=$(<"$in")
    shift 2
    for kv in "$@"; do text=${text//@${kv%%=*}@/${kv#*=}}; done
    left=$(grep -o '@[A-Z_0-9]*@' <<<"$text" | sort -u | tr '\n' ' ' || true)
    [ -z "$left" ] || { echo "fill: $in: nothing given for $left" >&2; return 1; }
    printf '%s\n' "$text" >"$out"
}

# A temp dir for this run and a list of the processes started for it, both cleaned up when the
# script exits, fails or is interrupted. Sets TMP and PIDS (append a PID to have it stopped).
with_cleanup() {
    TMP=$(mktemp -d)
    PIDS=()
    trap cleanup_run EXIT INT TERM
}

cleanup_run() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$TMP"
}

# start_nginx_backend CONFIG_DIR: the benchmark backend (nginx with CONFIG_DIR/backend.conf.in) on a
# free loopback port, under $TMP/backend; returns once it listens. Sets BACKEND.
start_nginx_backend() {
    BACKEND=$(free_port)
    mkdir -p "$TMP/backend"
    fill "$1/backend.conf.in" "$TMP/backend/nginx.conf" "DIR=$TMP/backend" "PORT=$BACKEND" "H2_PORT=$(free_port)"
    nginx -c "$TMP/backend/nginx.conf" -p "$TMP/backend" &
    PIDS+=($!)
    wait_port "$BACKEND" "$!" "the nginx backend"
}

# Stop the script with MESSAGE, naming the script.
die() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; exit 1; }

# CPU time used so far by PID and its children (nginx's workers), in clock ticks: "USER SYSTEM".
cpu_ticks() {
    local user=0 sys=0 p u s
    for p in "$1" $(pgrep -P "$1" || true); do
        read -r u s < <(awk '{print $14, $15}' "/proc/$p/stat" 2>/dev/null || echo 0 0)
        user=$((user + u))
        sys=$((sys + s))
    done
    echo "$user $sys"
}

# need TOOL...: stop unless every TOOL is installed (benches/compare.sh installs them).
need() {
    local tool
    for tool in "$@"; do
        command -v "$tool" >/dev/null || die "needs $tool (benches/compare.sh installs it)"
    done
}

# Wait until 127.0.0.1:PORT accepts and PID (or a process it started) is the one listening,
# failing early if PID died. The owner matters: a port picked by free_port may still be held by
# a process of an earlier run that is on its way out (a slow-dying redis-server, say), and a
# connection to it would measure that process instead.
wait_port() {
    local port=$1 pid=$2 what=$3
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || die "$what exited at startup (see $TMP)"
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && listens "$port" "$pid"; then
            return 0
        fi
        sleep 0.1
    done
    die "$what does not listen on $port after 10 s (see $TMP)"
}

# PID, or a child of PID, holds the listening socket on PORT (true when ss is not installed).
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
        redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" --save "" --appendonly no \
            --daemonize no --logfile "$dir/redis.log" --cluster-enabled yes \
            --cluster-node-timeout 5000 >/dev/null 2>&1 &
        CLUSTER_PIDS+=($!)
        PIDS+=($!)
        CLUSTER_PORTS+=("$port")
        wait_port "$port" "$!" "redis-server (cluster node $n)"
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
    REDIS_PORTS=("${CLUSTER_PORTS[@]}")
}

# "ALL SCRIPTS CPU": commands Redis has processed, and of those the script calls (EVAL, EVALSHA
# and their _RO forms), and the CPU time the servers used (user + system, microseconds), summed
# over the servers of REDIS_PORTS. Commands a script runs inside Redis (TIME, GET, SET) count in
# ALL too, so SCRIPTS per request is the number of round trips a request costs.
redis_commands() {
    local port
    for port in "${REDIS_PORTS[@]}"; do
        redis-cli -p "$port" info commandstats cpu
    done | tr -d '\r' | awk -F'[:=,]' '
        /^cmdstat_/ { all += $3; if ($1 ~ /^cmdstat_eval/) scripts += $3 }
        /^used_cpu_(sys|user):/ { cpu += $2 }
        END { printf "%d %d %.0f\n", all, scripts, cpu * 1e6 }'
}

# load_cpu LABEL PORT PID: 1 s of warm-up, then DURATION seconds of `wrk -t2 -c64` on
# 127.0.0.1:PORT; prints req/s, p99 and the user and system CPU per request of PID and its
# children (from /proc/PID/stat: a figure that moves less with background load than req/s).
load_cpu() {
    local label=$1 port=$2 pid=$3 u0 s0 u1 s1 out
    timeout 30 wrk -t2 -c64 -d1s "http://127.0.0.1:$port/" >/dev/null
    read -r u0 s0 < <(cpu_ticks "$pid")
    out=$(timeout $((DURATION + 30)) wrk -t2 -c64 -d"${DURATION}s" --latency "http://127.0.0.1:$port/")
    read -r u1 s1 < <(cpu_ticks "$pid")
    python3 - "$label" "$(awk '/requests in/{print $1}' <<<"$out")" "$u0" "$s0" "$u1" "$s1" \
        "$(getconf CLK_TCK)" "$(awk '/Requests\/sec/{print $2}' <<<"$out")" "$(awk '/ 99%/{print $2}' <<<"$out")" <<'PY'
import sys
label, n, u0, s0, u1, s1, tck, rps, p99 = sys.argv[1:]
n, tck = int(n), int(tck)
us = lambda a, b: (int(b) - int(a)) * 1e6 / tck / n
print(f"{label:<14} {float(rps):>10,.0f} req/s  p99 {p99:>8}  user {us(u0, u1):5.2f} us  system {us(s0, s1):5.2f} us per request")
PY
}

# load_cmd LABEL PORT COMMAND...: start COMMAND, wait until it listens on 127.0.0.1:PORT,
# `load_cpu` it (with its children: nginx's workers), stop it.
load_cmd() {
    local label=$1 port=$2 pid
    shift 2
    "$@" &
    pid=$!
    PIDS+=("$pid")
    wait_port "$port" "$pid" "$label"
    load_cpu "$label" "$port" "$pid"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
}
