# shellcheck shell=bash
# benches/load.sh idle [CONNECTIONS]: memory per idle keep-alive client connection, tollgate
# against nginx. Sourced by benches/load.sh, with benches/load/lib.sh.
#
# Starts on 127.0.0.1 only the backend of `compare`, then in turn nginx (compare's proxy config,
# scenario 1) and tollgate. For each: opens CONNECTIONS client connections one after the other,
# sends one request on each and reads its answer (so the upstream pool stays at one or two
# connections), leaves them all open and idle, and prints the proxy's RSS before and with them
# (nginx: master and workers summed) and the difference per connection. About 20 s.

help_idle() {
    cat <<'TXT'
idle [CONNECTIONS] memory per idle keep-alive client connection (default 2000 connections),
                   nginx then tollgate, each with compare's scenario 1 config: RSS idle, RSS
                   with the connections open, bytes per connection.
    TOLLGATE_BIN   the tollgate binary [target/release/tollgate, built when missing or stale]
    TOLLGATE_HEADERS [true]  KEEP_TMP [0]
TXT
}

run_idle() {
    [ $# -le 1 ] || usage_error "benches/load.sh idle [CONNECTIONS]"
    local n=${1:-2000}
    [[ $n =~ ^[1-9][0-9]*$ ]] || die "CONNECTIONS must be a positive number, not $n"
    # Every connection is a file descriptor of the client's.
    ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
    need nginx curl python3 ss
    start_run
    tollgate_binary
    start_backend
    cat >"$TMP/idle-client.py" <<'PY'
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
time.sleep(60)  # until stopped
PY
    start_nginx idle-nginx "${FWD_NGINX[@]}"
    idle_measure nginx "$NGINX_PID" "$NGINX_PORT" "$n"
    stop "$NGINX_PID"
    start_tollgate idle-tollgate "$LOCAL" "${FWD_TOLLGATE[@]}"
    idle_measure tollgate "$TOLLGATE_PID" "$TOLLGATE_PORT" "$n"
    stop "$TOLLGATE_PID"
    check_log idle-tollgate
    [ ! -s "$NOTES" ] || cat "$NOTES"
}

# idle_measure NAME PID PORT N: open N idle connections to PORT and report PID's RSS.
idle_measure() {
    local name=$1 pid=$2 port=$3 n=$4 before with client
    curl -s -o /dev/null --max-time 5 "http://127.0.0.1:$port/" || die "$name does not answer"
    sleep 0.5
    before=$(rss_kb "$pid")
    spawn "idle-client-$name" python3 "$TMP/idle-client.py" "$port" "$n"
    client=$SPAWNED
    for _ in $(seq 300); do
        grep -q open "$TMP/idle-client-$name/stdout" && break
        kill -0 "$client" 2>/dev/null ||
            die "the client of $name failed: $(cat "$TMP/idle-client-$name/stderr")"
        sleep 0.1
    done
    grep -q open "$TMP/idle-client-$name/stdout" || die "the client of $name did not open $n connections in 30 s"
    sleep 0.5
    with=$(rss_kb "$pid")
    printf '%-9s RSS %6d kB idle, %6d kB with %d idle connections: %5d bytes per connection\n' \
        "$name" "$before" "$with" "$n" $(((with - before) * 1024 / n))
    stop "$client"
}
