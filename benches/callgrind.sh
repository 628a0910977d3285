#!/usr/bin/env bash
# Instructions per request of the proxy, counted by callgrind: a figure that does not move with
# the load on a shared machine, for comparing two commits or tollgate with the bare hyper floor.
#
#   benches/callgrind.sh [tollgate|bare] [fwd|rej|redis]     (defaults: tollgate fwd)
#
# Builds the target with frame pointers and line tables (target dir target/callgrind), starts
# on 127.0.0.1 a backend (nginx, the config of benches/compare.sh), Redis for `redis`, and the
# proxy under `valgrind --tool=callgrind` with instrumentation off; warms up for 3 s, counts
# DURATION seconds of `wrk -t1 -cCONNECTIONS`, and prints the instructions per request with the 40
# functions that execute most of them (self cost, inlined code counted in its caller). The
# full profile stays in target/callgrind/NAME.out for `callgrind_annotate --inclusive=yes`.
# Stops every process it started. About 2 minutes with the build.
#
# Environment: DURATION [10]; CONNECTIONS [8] (more make larger Redis batches); VALGRIND_EXTRA
# [none], further callgrind options (`--dump-instr=yes` for costs by instruction address);
# HEADERS [true], whether tollgate sends the rate-limit headers; LIMITS [on], `off` for a route
# without limits (what the proxy costs without a check); EXTRA [none], further limits of the
# route as YAML lines, e.g.
#   EXTRA='      - { name: everyone, rate: 1000000/s, burst: 1000000, key: [global] }'
# for the per-client and `global` limits of compare.sh's scenario 3d.
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-tollgate}
MODE=${2:-fwd}
DURATION=${DURATION:-10}
CONNECTIONS=${CONNECTIONS:-8}
for tool in valgrind callgrind_annotate callgrind_control nginx wrk curl python3; do
    command -v "$tool" >/dev/null || { echo "callgrind.sh needs $tool (apt-get install valgrind nginx wrk curl)" >&2; exit 1; }
done
ROOT=$(pwd)
HERE=$ROOT/benches/compare
OUT=$ROOT/target/callgrind
mkdir -p "$OUT"
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"

build=(cargo build --release --target-dir "$OUT/build")
case $WHAT in
    tollgate) build+=(--bin tollgate); BIN=$OUT/build/release/tollgate ;;
    bare) build+=(--example bare_hyper_proxy); BIN=$OUT/build/release/examples/bare_hyper_proxy ;;
    *) echo "usage: benches/callgrind.sh [tollgate|bare] [fwd|rej|redis]" >&2; exit 2 ;;
esac
CARGO_PROFILE_RELEASE_DEBUG=line-tables-only RUSTFLAGS="-C force-frame-pointers=yes" "${build[@]}" 2>&1 | tail -1

with_cleanup

start_nginx_backend "$HERE"
RATE=1000000/s
BURST=1000000
[ "$MODE" = rej ] && { RATE=1/day; BURST=1; }
LIMITER='  backend: local'
if [ "$MODE" = redis ]; then
    RPORT=$(free_port)
    redis-server --bind 127.0.0.1 --port "$RPORT" --dir "$TMP" --save "" --appendonly no >/dev/null &
    PIDS+=($!)
    LIMITER=$(printf '  backend: redis\n  on_failure: closed\n  redis:\n    url: redis://127.0.0.1:%s' "$RPORT")
fi
PORT=$(free_port)
fill "$HERE/tollgate.yaml.in" "$TMP/tollgate.yaml" "PORT=$PORT" "BACKEND_PORT=$BACKEND" \
    "LIMITER=$LIMITER" "HEADERS=${HEADERS:-true}" "RATE=$RATE" "BURST=$BURST" "KEY=ip" "EXTRA=${EXTRA:-}"
# The route's limits are the last lines of the config.
[ "${LIMITS:-on}" = off ] && sed -i '/^    limits:/,$d' "$TMP/tollgate.yaml"
NAME=$WHAT-$MODE
rm -f "$OUT/$NAME.out"*
args=(run --config "$TMP/tollgate.yaml" --access-log false --log-level warn)
[ "$WHAT" = bare ] && args=("127.0.0.1:$PORT" "127.0.0.1:$BACKEND")
valgrind --tool=callgrind --instr-atstart=no ${VALGRIND_EXTRA:-} --callgrind-out-file="$OUT/$NAME.out" \
    "$BIN" "${args[@]}" 2>"$TMP/valgrind.log" &
PID=$!
PIDS+=("$PID")
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break; sleep 0.3; done
wrk -t1 -c"$CONNECTIONS" -d3s "http://127.0.0.1:$PORT/" >/dev/null
callgrind_control -i on "$PID" >/dev/null 2>&1
result=$(wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" "http://127.0.0.1:$PORT/")
callgrind_control -i off "$PID" >/dev/null 2>&1
callgrind_control -d "$PID" >/dev/null 2>&1
sleep 1
requests=$(awk '/requests in/ {print $1}' <<<"$result")
# The dump asked for above (callgrind numbers its dumps: NAME.out.1).
mv "$OUT/$NAME.out.1" "$OUT/$NAME.profile"
callgrind_annotate --auto=no --inclusive=no --threshold=100 "$OUT/$NAME.profile" 2>/dev/null |
    sed -n '/file:function/,$p' | tail -n +3 | grep -v '^ *$' |
    awk -v n="$requests" '{
        c = $1; gsub(",", "", c); $1 = ""; $2 = ""; sub(/^ +/, ""); sub(/ \[[^]]*\]$/, "")
        f = substr($0, index($0, ":") + 1); per[f] += c / n; total += c / n
    } END {
        printf "%s %s: %d requests counted, %.0f instructions per request\n", name, mode, n, total
        for (f in per) printf "%8.0f  %s\n", per[f], f
    }' name="$WHAT" mode="$MODE" | { read -r head; echo "$head"; sort -rn | head -40; }
echo "profile: $OUT/$NAME.profile (callgrind_annotate --inclusive=yes $OUT/$NAME.profile)"
