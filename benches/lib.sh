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
