#!/usr/bin/env bash
# What one call of the bucket script (src/limiter/bucket.lua) costs inside Redis, by batch shape.
#
#   benches/redis-script.sh
#
# Starts its own redis-server on a free loopback port, loads the script, and runs
# `redis-benchmark -P 16` (pipelined, so the figure is Redis's own work, not round trips) on:
#   - one check of one bucket ("batch" mode, one group of 1);
#   - 8 and 64 identical checks sent as one group (a busy client, or a `key: [global]` limit);
#   - 8 checks of 8 different clients in one call (8 groups of 1);
#   - an empty script (`return 1`), the floor of any script call.
# Prints calls/s and microseconds per call and per check. Stops the server it started.
# Environment: CALLS [100000] calls per shape.
set -euo pipefail
cd "$(dirname "$0")/.."
CALLS=${CALLS:-100000}
for tool in redis-server redis-cli redis-benchmark python3; do
    command -v "$tool" >/dev/null || { echo "redis-script.sh needs $tool (apt-get install redis-server redis-tools)" >&2; exit 1; }
done
# shellcheck source=benches/lib.sh
. benches/lib.sh
TMP=$(mktemp -d)
PORT=$(free_port)
redis-server --bind 127.0.0.1 --port "$PORT" --dir "$TMP" --save "" --appendonly no \
    --daemonize no --logfile "$TMP/redis.log" >/dev/null 2>&1 &
PID=$!
cleanup() { kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT INT TERM
for _ in $(seq 50); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
SHA=$(redis-cli -p "$PORT" script load "$(cat src/limiter/bucket.lua)")
EMPTY=$(redis-cli -p "$PORT" script load "return 1")

# The values of one bucket: 1000000/s (token 1 us), burst 1000000 (never rejects), cost 1,
# enforced. A key like the proxy's: prefix, limit name, the client digest as the hash tag.
BUCKET=(1 1000000 1 1)
key() { printf 'tollgate:bench:{%032x}' "$1"; }

# run LABEL CHECKS_PER_CALL ARGS...: calls per second and the cost per call and per check.
run() {
    local label=$1 checks=$2 out rps
    shift 2
    out=$(redis-benchmark -p "$PORT" -n "$CALLS" -P 16 -c 4 -q "$@" 2>&1 | tr '\r' '\n' | grep 'requests per second' | tail -1)
    rps=$(grep -o '[0-9.]* requests per second' <<<"$out" | cut -d' ' -f1)
    python3 - "$label" "$checks" "$rps" <<'PY'
import sys
label, checks, rps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
per_call = 1e6 / rps
per_check = per_call / checks if checks else 0.0
print(f"{label:<34} {rps:>10,.0f} calls/s  {per_call:6.1f} us per call  {per_check:5.2f} us per check")
PY
}

echo "bucket script on $(redis-server --version | cut -d' ' -f3), redis-benchmark -P 16 -c 4, $CALLS calls each"
run "empty script (return 1)" 0 evalsha "$EMPTY" 0
run "1 check" 1 evalsha "$SHA" 1 "$(key 1)" batch 1 1 1 "${BUCKET[@]}"
run "8 identical checks, one group" 8 evalsha "$SHA" 1 "$(key 1)" batch 1 8 1 "${BUCKET[@]}"
run "64 identical checks, one group" 64 evalsha "$SHA" 1 "$(key 1)" batch 1 64 1 "${BUCKET[@]}"
keys=() groups=()
for i in $(seq 8); do
    keys+=("$(key "$i")")
    groups+=(1 1 "${BUCKET[@]}")
done
run "8 clients, 8 groups of one" 8 evalsha "$SHA" 8 "${keys[@]}" batch 8 "${groups[@]}"
