# shellcheck shell=bash
# Shell helpers shared by the bench scripts (sourced, not run).

# A port nothing listens on: bind :0 and let the kernel pick.
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# fill TEMPLATE OUT KEY=VALUE...: copy TEMPLATE to OUT with every @KEY@ replaced by VALUE.
fill() {
    local in=$1 out=$2 kv text
    text=$(<"$in")
    shift 2
    for kv in "$@"; do text=${text//@${kv%%=*}@/${kv#*=}}; done
    printf '%s\n' "$text" >"$out"
}

# A temp dir for this run and a list of the processes started for it, both cleaned up when the
# script exits, fails or is interrupted. Sets TMP and PIDS (append a PID to have it stopped).
with_cleanup() {
    TMP=$(mktemp -d)
    PIDS=()
    trap cleanup_run EXIT INT TERM
}

cleanup_run() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$TMP"
}

# start_nginx_backend CONFIG_DIR: the benchmark backend (nginx with CONFIG_DIR/backend.conf.in) on a
# free loopback port, under $TMP/backend. Sets BACKEND.
start_nginx_backend() {
    BACKEND=$(free_port)
    mkdir -p "$TMP/backend"
    fill "$1/backend.conf.in" "$TMP/backend/nginx.conf" "DIR=$TMP/backend" "PORT=$BACKEND" "H2_PORT=$(free_port)"
    nginx -c "$TMP/backend/nginx.conf" -p "$TMP/backend" &
    PIDS+=($!)
}
