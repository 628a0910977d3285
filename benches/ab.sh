#!/usr/bin/env bash
# A/B of two tollgate binaries on this machine: which one costs less per request.
#
#   benches/ab.sh OLD_BINARY NEW_BINARY
#
# Starts on 127.0.0.1 only a backend (nginx, 1 worker, `return 200 "ok\n"`, the config of
# benches/compare.sh), then, ROUNDS times and alternating, each binary on scenario 1 (forwarded,
# the limit never reached) and scenario 2 (rejected, every request answered 429). Each run is
# a 1 s warm-up and DURATION seconds of `wrk -t2 -c64`. Prints req/s, p99, and the proxy's
# user and system CPU per request (from /proc/PID/stat), which moves less with background load
# than req/s does. Stops every process it started. For the figures of docs/performance.md,
# "Before and after". About ROUNDS * 4 * (DURATION + 2) seconds.
#
# Environment: ROUNDS [2], DURATION [5].
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: benches/ab.sh OLD_BINARY NEW_BINARY" >&2; exit 2; }
OLD=$(realpath "$1")
NEW=$(realpath "$2")
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-5}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HERE=$ROOT/benches/compare
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
need nginx wrk curl python3
with_cleanup

start_nginx_backend "$HERE"

# Scenario configs: forwarded (never limited) and rejected (one request a day).
FWD=$(free_port)
REJ=$(free_port)
for s in "fwd $FWD 1000000/s 1000000" "rej $REJ 1/day 1"; do
    set -- $s
    fill "$HERE/tollgate.yaml.in" "$TMP/$1.yaml" "PORT=$2" "BACKEND_PORT=$BACKEND" \
        "LIMITER=  backend: local" "HEADERS=true" "RATE=$3" "BURST=$4" "KEY=ip" "EXTRA="
done

measure() { # label binary config port
    load_cmd "$1" "$4" "$2" run --config "$3" --access-log false --log-level warn
}

echo "A: $OLD"
echo "B: $NEW"
for round in $(seq "$ROUNDS"); do
    for which in A B; do
        bin=$OLD
        [ "$which" = B ] && bin=$NEW
        measure "$which forwarded" "$bin" "$TMP/fwd.yaml" "$FWD"
        measure "$which rejected" "$bin" "$TMP/rej.yaml" "$REJ"
    done
    if [ "$round" -lt "$ROUNDS" ]; then echo; fi
done
