#!/usr/bin/env bash
# The hyper floor: nginx, the bare hyper proxy (examples/bare_hyper_proxy.rs: hyper and tokio
# alone, none of tollgate's work) and tollgate, each forwarding to the same backend, with the
# CPU each spends per request. Tells how much of tollgate's gap to nginx is hyper's and how
# much is tollgate's own.
#
#   benches/floor.sh
#
# Starts on 127.0.0.1 only the backend and nginx of benches/compare.sh (scenario 1's config:
# `limit_req` never reached) and builds the release binary and example when missing. ROUNDS
# times, alternating, each proxy afresh: a 1 s warm-up and DURATION seconds of `wrk -t2 -c64`,
# then req/s, p99 and user and system CPU per request (nginx: its two workers together). Stops
# every process it started. About ROUNDS * 3 * (DURATION + 2) seconds.
#
# Environment: ROUNDS [3], DURATION [5]; TOLLGATE_BIN, BARE_BIN: binaries to use instead.
set -euo pipefail
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-5}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HERE=$ROOT/benches/compare
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
need nginx wrk curl python3
TOLLGATE_BIN=${TOLLGATE_BIN:-$ROOT/target/release/tollgate}
BARE_BIN=${BARE_BIN:-$ROOT/target/release/examples/bare_hyper_proxy}
[ -x "$TOLLGATE_BIN" ] || (cd "$ROOT" && cargo build --release --locked --bin tollgate)
[ -x "$BARE_BIN" ] || (cd "$ROOT" && cargo build --release --locked --example bare_hyper_proxy)
with_cleanup

start_nginx_backend "$HERE"
TPORT=$(free_port)
NPORT=$(free_port)
BPORT=$(free_port)
fill "$HERE/tollgate.yaml.in" "$TMP/tollgate.yaml" "PORT=$TPORT" "BACKEND_PORT=$BACKEND" \
    "LIMITER=  backend: local" "HEADERS=true" "RATE=1000000/s" "BURST=1000000" "KEY=ip" "EXTRA="
mkdir -p "$TMP/nginx"
fill "$HERE/nginx-proxy.conf.in" "$TMP/nginx/nginx.conf" "DIR=$TMP/nginx" "PORT=$NPORT" \
    "H2_PORT=$(free_port)" "BACKEND_PORT=$BACKEND" "ZONE_KEY=\$binary_remote_addr" \
    "ZONE_SIZE=10m" "RATE=1000000r/s" "BURST=1000000"

for round in $(seq "$ROUNDS"); do
    load_cmd nginx "$NPORT" nginx -c "$TMP/nginx/nginx.conf" -p "$TMP/nginx"
    load_cmd "bare hyper" "$BPORT" "$BARE_BIN" "127.0.0.1:$BPORT" "127.0.0.1:$BACKEND"
    load_cmd tollgate "$TPORT" "$TOLLGATE_BIN" run --config "$TMP/tollgate.yaml" \
        --access-log false --log-level warn
    if [ "$round" -lt "$ROUNDS" ]; then echo; fi
done
