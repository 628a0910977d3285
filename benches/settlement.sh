#!/usr/bin/env bash
# benches/settlement.sh BINARY: script calls and Redis CPU per request on a route that settles
# its cost from the response (`cost: { reserve, from_response }`), over one redis-server.
#
# Starts on 127.0.0.1 an nginx backend answering `X-Cost: 7`, a redis-server without
# persistence and BINARY (2 workers), warms up 2 s, then counts 10 s of `wrk -t1 -c50` for one
# tenant: every response is settled. Prints req/s, EVALSHA calls per request and Redis's
# microseconds per request (INFO commandstats). Stops everything it started.
set -euo pipefail
BIN=${1:?usage: benches/settlement.sh BINARY}
for tool in nginx redis-server redis-cli wrk python3; do
    command -v "$tool" >/dev/null || { echo "benches/settlement.sh: needs $tool" >&2; exit 1; }
done
D=$(mktemp -d)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$D"' EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
BACKEND=$(port) REDIS=$(port) PROXY=$(port)
cat >"$D/nginx.conf" <<NG
worker_processes 1; daemon off; pid $D/nginx.pid;
events { worker_connections 1024; }
http { access_log off; server { listen 127.0.0.1:$BACKEND; keepalive_requests 100000;
  location / { add_header X-Cost 7 always; return 200 "ok\n"; } } }
NG
nginx -p "$D" -c "$D/nginx.conf" -e "$D/nginx.err" & PIDS+=($!)
redis-server --port "$REDIS" --save "" --appendonly no >"$D/redis.log" 2>&1 & PIDS+=($!)
cat >"$D/tollgate.yaml" <<Y
listeners:
  - address: 127.0.0.1:$PROXY
limiter:
  backend: redis
  redis: { url: "redis://127.0.0.1:$REDIS", timeout: 1s }
upstreams:
  app: { targets: [127.0.0.1:$BACKEND] }
routes:
  - name: llm
    match: { path_prefix: / }
    upstream: app
    limits:
      - { name: tokens, rate: 1000000000/h, burst: 1000000000, key: ["header:x-tenant"], cost: { reserve: 10, from_response: x-cost } }
Y
sleep 0.5
TOLLGATE_WORKERS=2 "$BIN" run --config "$D/tollgate.yaml" --access-log off --log-level warn 2>"$D/tollgate.err" & PIDS+=($!)
for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:$PROXY/" && break; sleep 0.1; done
echo 'wrk.headers["x-tenant"] = "acme"' >"$D/tenant.lua"
wrk -t1 -c50 -d2s -s "$D/tenant.lua" "http://127.0.0.1:$PROXY/" >/dev/null
redis-cli -p "$REDIS" CONFIG RESETSTAT >/dev/null
out=$(wrk -t1 -c50 -d10s -s "$D/tenant.lua" "http://127.0.0.1:$PROXY/")
stats=$(redis-cli -p "$REDIS" INFO commandstats | tr -d '\r' | grep '^cmdstat_evalsha:')
calls=$(grep -o 'calls=[0-9]*' <<<"$stats" | head -1 | cut -d= -f2)
usec=$(grep -o 'usec=[0-9]*' <<<"$stats" | head -1 | cut -d= -f2)
reqs=$(echo "$out" | awk '/requests in/ {print $1}')
rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
python3 -c "print(f'req/s {float(\"$rps\"):,.0f}, script calls per request {$calls / $reqs:.3f}, Redis µs per request {$usec / $reqs:.2f}')"
