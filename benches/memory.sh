#!/usr/bin/env bash
# Memory of the in-process limiter (issue 6): RSS with KEYS distinct client buckets held, and
# after they are evicted. tollgate answers itself (a `respond` route), so nothing else runs.
#
#   benches/memory.sh                 # 1,000,000 keys
#   KEYS=200000 benches/memory.sh
#
# Sends requests with KEYS distinct X-API-Key values (benches/compare/keys.lua) for SEND
# seconds (long enough to go through every key once), reads tollgate's RSS and its
# tollgate_local_buckets gauge, then waits for every bucket to be full again (rate 1/min,
# burst 1: 60 s after its request) and for the sweep, and reads them again. Loopback only;
# stops what it started. Takes about SEND + 75 seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
KEYS=${KEYS:-1000000}
SEND=${SEND:-25}
for tool in wrk curl; do
    command -v "$tool" >/dev/null || { echo "memory.sh needs $tool (apt-get install $tool)" >&2; exit 1; }
done
BIN=${TOLLGATE_BIN:-target/release/tollgate}
[ -n "${TOLLGATE_BIN:-}" ] || cargo build --release --locked --quiet
TMP=$(mktemp -d)
PID=
cleanup() { [ -z "$PID" ] || kill "$PID" 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT INT TERM
# shellcheck source=benches/lib.sh
. benches/lib.sh
PORT=$(free_port)
ADMIN=$(free_port)
cat >"$TMP/tollgate.yaml" <<YAML
listeners:
  - address: 127.0.0.1:$PORT
    max_requests_per_connection: 100000000
admin:
  address: 127.0.0.1:$ADMIN
limiter:
  backend: local
  local:
    max_buckets: 2000000
routes:
  - name: all
    match: { path_prefix: / }
    respond: { status: 200, body: "ok\n" }
    limits:
      - { name: per-key, rate: 1/min, burst: 1, key: ["header:X-API-Key"] }
YAML
"$BIN" run --config "$TMP/tollgate.yaml" --access-log false --log-level warn &
PID=$!
for _ in $(seq 50); do curl -sf "http://127.0.0.1:$ADMIN/healthz" >/dev/null && break; sleep 0.1; done
rss() { awk '/^VmRSS/{printf "%.1f", $2/1024}' "/proc/$PID/status"; }
held() { curl -s "http://127.0.0.1:$ADMIN/metrics" | awk '/^tollgate_local_buckets\{/{print $2}'; }
echo "start:    RSS $(rss) MB"
KEYS=$KEYS timeout $((SEND + 60)) wrk -t2 -c64 -d"${SEND}s" -s benches/compare/keys.lua \
    "http://127.0.0.1:$PORT/" >"$TMP/wrk.txt"
sleep 6   # the gauge is refreshed by the sweep
echo "held:     RSS $(rss) MB, buckets $(held) (peak RSS $(awk '/^VmHWM/{printf "%.1f", $2/1024}' "/proc/$PID/status") MB)"
echo "          $(grep -E 'Requests/sec' "$TMP/wrk.txt")"
sleep 75
echo "evicted:  RSS $(rss) MB, buckets $(held)"
# Freed memory goes back to the allocator of the thread that allocated it, which hands it to
# the OS when that thread next works: a little traffic shows it.
timeout 30 wrk -t2 -c8 -d2s "http://127.0.0.1:$PORT/" >/dev/null
sleep 6
echo "traffic:  RSS $(rss) MB, buckets $(held)"
