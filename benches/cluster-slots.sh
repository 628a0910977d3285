#!/usr/bin/env bash
# Redis Cluster, a check spanning two slots: a three-master cluster this script starts, and each
# tollgate binary given answering a route with a per-client and a `global` limit itself (no
# upstream), measured by wrk -t2 -c64 for D seconds (default 4), binaries alternating ROUNDS
# times (default 2). Prints req/s, p99, non-2xx responses and script calls per request.
#   benches/cluster-slots.sh OLD_BINARY NEW_BINARY
# Needs redis-server, redis-cli, wrk, bc and python3; loopback only; stops what it started.
set -u
D=${D:-4}; ROUNDS=${ROUNDS:-2}
T=$(mktemp -d); trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf $T' EXIT
fp() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
ports=()
for n in 1 2 3; do p=$(fp); while [ $p -gt 55535 ]; do p=$(fp); done; mkdir -p $T/$n
  redis-server --port $p --dir $T/$n --save "" --appendonly no --cluster-enabled yes >/dev/null & ports+=($p); done
sleep 0.5; redis-cli --cluster create ${ports[@]/#/127.0.0.1:} --cluster-replicas 0 --cluster-yes >/dev/null 2>&1
for p in ${ports[@]}; do for _ in $(seq 100); do redis-cli -p $p cluster info | grep -q cluster_state:ok && break; sleep 0.1; done; done
calls() { local s=0; for p in ${ports[@]}; do c=$(redis-cli -p $p info commandstats | tr -d '\r' | grep -E '^cmdstat_(evalsha|eval):' | sed "s/^[^:]*:calls=\([0-9]*\).*/\1/" | paste -sd+ | bc); s=$((s+${c:-0})); done; echo $s; }
run() {
  local bin=$1 port=$(fp)
  cat > $T/c.yaml <<Y
listeners: [{ address: 127.0.0.1:$port }]
limiter:
  backend: redis
  on_failure: closed
  redis: { cluster: [$(printf '"redis://127.0.0.1:%s",' ${ports[@]} | sed 's/,$//')] }
routes:
  - name: r
    match: { path_prefix: / }
    respond: { status: 200, body: "ok\n" }
    limits:
      - { name: per-ip, rate: 1000000/s, burst: 1000000, key: [ip] }
      - { name: all, rate: 1000000/s, burst: 1000000, key: [global] }
Y
  $bin run --config $T/c.yaml 2>$T/log & local pid=$!
  for _ in $(seq 200); do grep -q listening $T/log && break; sleep 0.01; done
  wrk -t2 -c64 -d1s http://127.0.0.1:$port/ >/dev/null
  local c0=$(calls)
  local out=$(wrk -t2 -c64 -d${D}s --latency http://127.0.0.1:$port/)
  local c1=$(calls)
  local n=$(echo "$out" | awk '/requests in/{print $1}')
  printf '%-28s %9s req/s  p99 %8s  non-2xx %6s  calls/req %s\n' "$(basename $bin)" \
    "$(echo "$out" | awk '/Requests\/sec/{print $2}')" "$(echo "$out" | awk '$1=="99%"{print $2}')" \
    "$(echo "$out" | awk '/Non-2xx/{print $5}')" "$(echo "scale=3; ($c1-$c0)/$n" | bc)"
  kill $pid; wait $pid 2>/dev/null
}
for r in $(seq $ROUNDS); do for b in "$@"; do run $b; done; done
