#!/usr/bin/env bash
# Memory per idle keep-alive client connection, tollgate against nginx.
#
#   benches/idle-connections.sh [CONNECTIONS]      (default 2000)
#
# Starts on 127.0.0.1 only the backend of benches/compare.sh, then in turn nginx (the proxy
# config of benches/compare.sh, scenario 1) and tollgate (target/release/tollgate, or
# TOLLGATE_BIN). For each: opens CONNECTIONS client connections one after the other, sends one
# request on each and reads its answer (so the upstream pool stays at one or two
# connections), leaves them all open and idle, and prints the proxy's RSS before and with
# them (nginx: master and workers summed) and the difference per connection. Stops every
# process it started. About 20 s.
set -euo pipefail
N=${1:-2000}
cd "$(dirname "$0")/.."
ROOT=$(pwd)
HERE=$ROOT/benches/compare
BIN=${TOLLGATE_BIN:-$ROOT/target/release/tollgate}
for tool in nginx curl python3; do
    command -v "$tool" >/dev/null || { echo "idle-connections.sh needs $tool" >&2; exit 1; }
done
[ -x "$BIN" ] || { echo "no tollgate binary at $BIN: cargo build --release first" >&2; exit 1; }
# shellcheck source=benches/lib.sh
. "$ROOT/benches/lib.sh"
with_cleanup
start_nginx_backend "$HERE"

# The RSS of PID and its children, in kB.
rss() {
    local total=0 p
    for p in "$1" $(pgrep -P "$1" || true); do
        total=$((total + $(awk '/^VmRSS:/ {print $2}' "/proc/$p/status")))
    done
    echo "$total"
}

# measure NAME PID PORT: open N idle connections to PORT and report PID's RSS.
measure() {
    local name=$1 pid=$2 port=$3 before with
    for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/" && break; sleep 0.1; done
    sleep 0.5
    before=$(rss "$pid")
    python3 - "$port" "$N" >"$TMP/client.out" <<'PY' &
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
conns = []
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
    answer = b""
    while b"ok\n" not in answer:
        chunk = s.recv(4096)
        if not chunk:
            sys.exit("the proxy closed a connection")
        answer += chunk
    conns.append(s)
print("open", flush=True)
time.sleep(5)
PY
    local client=$!
    for _ in $(seq 100); do grep -q open "$TMP/client.out" 2>/dev/null && break; sleep 0.1; done
    sleep 0.5
    with=$(rss "$pid")
    printf '%-9s RSS %6d kB idle, %6d kB with %d idle connections: %5d bytes per connection\n' \
        "$name" "$before" "$with" "$N" $(((with - before) * 1024 / N))
    kill "$client" 2>/dev/null || true
    wait "$client" 2>/dev/null || true
}

PORT=$(free_port)
mkdir -p "$TMP/nginx"
fill "$HERE/nginx-proxy.conf.in" "$TMP/nginx/nginx.conf" "DIR=$TMP/nginx" "PORT=$PORT" \
    "H2_PORT=$(free_port)" "BACKEND_PORT=$BACKEND" "ZONE_KEY=\$binary_remote_addr" \
    "ZONE_SIZE=10m" "RATE=1000000r/s" "BURST=1000000"
nginx -p "$TMP/nginx" -c "$TMP/nginx/nginx.conf" -e "$TMP/nginx/error.log" &
PIDS+=($!)
measure nginx $! "$PORT"

PORT=$(free_port)
fill "$HERE/tollgate.yaml.in" "$TMP/tollgate.yaml" "PORT=$PORT" "BACKEND_PORT=$BACKEND" \
    "LIMITER=  backend: local" "HEADERS=true" "RATE=1000000/s" "BURST=1000000" "KEY=ip" "EXTRA="
"$BIN" --access-log false --log-level warn run --config "$TMP/tollgate.yaml" &
PIDS+=($!)
measure tollgate $! "$PORT"
