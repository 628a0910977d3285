# shellcheck shell=bash
# benches/load.sh: HAProxy and Caddy, the peers `compare` measures beside nginx and tollgate.
# Sourced by benches/load.sh, with benches/load/lib.sh (start_run, spawn, fill, wait_port).
#
# Both forward to compare's backend over pooled keep-alive connections, as their docs
# recommend for keep-alive upstreams: HAProxy with `http-reuse always` and `pool-max-conn
# 1024`, Caddy's reverse_proxy with `keepalive_idle_conns 1024`. HAProxy limits with a stick
# table's `http_req_rate` (a sliding window; it has no token bucket); Caddy has no built-in rate
# limit, so it runs the forwarded scenarios only.

# HAProxy's limits equivalent to lib.sh's: table type, tracked fetch, window, requests allowed
# per window, entry expiry. Forwarded: never reached; rejected: one request, then 429 (the
# window is a day, like tollgate's 1/day); keys: 1000 per second per X-API-Key.
# shellcheck disable=SC2034 # used by compare.sh
{
    FWD_HAPROXY=(ip src 1s 1000000 10s)
    REJ_HAPROXY=(ip src 1d 1 1d)
    KEY_HAPROXY=("string len 32" "req.hdr(x-api-key)" 1s 1000 10s)
}

# start_haproxy NAME TYPE TRACK WINDOW LIMIT EXPIRE: HAProxy (2 threads,
# benches/compare/haproxy.cfg.in) in $TMP/NAME. PEER_LOG [off]: `file` logs every request
# (`option httplog`) to its standard output, which spawn writes to $TMP/NAME/stdout: HAProxy
# logs to syslog or to a file descriptor, never to a path of its own, and a file descriptor
# open on a regular file is its way to a file. Sets HAPROXY_PID, HAPROXY_PORT,
# HAPROXY_H2_PORT.
start_haproxy() {
    local dir=$TMP/$1 global="# no log" defaults="no log"
    mkdir -p "$dir"
    if [ "${PEER_LOG:-off}" = file ]; then
        global="log stdout format raw local0 info"
        defaults="log global
    option httplog"
    fi
    HAPROXY_PORT=$(free_port)
    HAPROXY_H2_PORT=$(free_port)
    fill "$CONF/haproxy.cfg.in" "$dir/haproxy.cfg" PORT="$HAPROXY_PORT" \
        H2_PORT="$HAPROXY_H2_PORT" BACKEND_PORT="$BACKEND_PORT" TABLE_TYPE="$2" TRACK="$3" \
        WINDOW="$4" LIMIT="$5" EXPIRE="$6" LOG_GLOBAL="$global" LOG_DEFAULTS="$defaults" \
        SERVER_OPTS="${HAPROXY_SERVER_OPTS:-}"
    spawn "$1" haproxy -db -f "$dir/haproxy.cfg"
    HAPROXY_PID=$SPAWNED
    wait_port "$HAPROXY_PORT" "$HAPROXY_PID" "haproxy ($1)"
    wait_port "$HAPROXY_H2_PORT" "$HAPROXY_PID" "haproxy ($1)"
}

# start_caddy NAME: Caddy (benches/compare/Caddyfile.in: reverse_proxy, HTTP/1.1 and h2c on one
# listener, GOMAXPROCS left at the core count) in $TMP/NAME. PEER_LOG [off]: `file` logs every
# request to $TMP/NAME/access.log (the `log` directive, `output file`). Sets CADDY_PID,
# CADDY_PORT.
start_caddy() {
    local dir=$TMP/$1 logdir="# no access log"
    mkdir -p "$dir"
    [ "${PEER_LOG:-off}" != file ] || logdir="log {
        output file $dir/access.log
    }"
    CADDY_PORT=$(free_port)
    fill "$CONF/Caddyfile.in" "$dir/Caddyfile" PORT="$CADDY_PORT" BACKEND_PORT="$BACKEND_PORT" \
        LOG="$logdir"
    spawn "$1" env XDG_DATA_HOME="$dir/data" XDG_CONFIG_HOME="$dir/config" \
        caddy run --adapter caddyfile --config "$dir/Caddyfile"
    CADDY_PID=$SPAWNED
    wait_port "$CADDY_PORT" "$CADDY_PID" "caddy ($1)"
}
