#!/usr/bin/env bash
# Redis Cluster, a check spanning two slots: a three-master cluster this script starts, and each
# tollgate binary given answering a route with a per-client and a `global` limit itself (no
# upstream), measured by wrk -t2 -c64 for D seconds (default 4), binaries alternating ROUNDS
# times (default 2). Prints req/s, p99, non-2xx responses and script calls per request.
#
#   benches/cluster-slots.sh OLD_BINARY NEW_BINARY
#
# Needs redis-server, redis-cli, wrk and python3; loopback only; stops what it started.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: benches/cluster-slots.sh BINARY..." >&2; exit 2; }
D=${D:-4}
ROUNDS=${ROUNDS:-2}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
with_cleanup
start_cluster
NODES=$(printf '"redis://127.0.0.1:%s", ' "${CLUSTER_PORTS[@]}" | sed 's/, $//')

# Script calls all nodes have run so far.
scripts() { redis_commands | awk '{print $2}'; }

run() {
    local bin=$1 port pid out n c0 c1
    port=$(free_port)
    cat >"$TMP/tollgate.yaml" <<YAML
listeners: [{ address: 127.0.0.1:$port }]
limiter:
  backend: redis
  on_failure: closed
  redis: { cluster: [$NODES] }
routes:
  - name: r
    match: { path_prefix: / }
    respond: { status: 200, body: "ok\n" }
    limits:
      - { name: per-ip, rate: 1000000/s, burst: 1000000, key: [ip] }
      - { name: all, rate: 1000000/s, burst: 1000000, key: [global] }
YAML
    "$bin" --access-log false --log-level warn run --config "$TMP/tollgate.yaml" 2>"$TMP/log" &
    pid=$!
    PIDS+=("$pid")
    wait_port "$port" "$pid" "tollgate ($bin)"
    timeout 30 wrk -t2 -c64 -d1s "http://127.0.0.1:$port/" >/dev/null
    c0=$(scripts)
    out=$(timeout $((D + 30)) wrk -t2 -c64 -d"${D}s" --latency "http://127.0.0.1:$port/")
    c1=$(scripts)
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    n=$(awk '/requests in/{print $1}' <<<"$out")
    printf '%-28s %9s req/s  p99 %8s  non-2xx %6s  calls/req %s\n' "$(basename "$bin")" \
        "$(awk '/Requests\/sec/{print $2}' <<<"$out")" "$(awk '$1=="99%"{print $2}' <<<"$out")" \
        "$(awk '/Non-2xx/{print $5}' <<<"$out")" \
        "$(python3 -c "print(f'{($c1 - $c0) / $n:.3f}')")"
}

for _ in $(seq "$ROUNDS"); do
    for bin in "$@"; do run "$(realpath "$bin")"; done
done
