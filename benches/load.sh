#!/usr/bin/env bash
# The load benchmarks of tollgate, one driver for all of them.
#
#   benches/load.sh SUBCOMMAND [ARGS...]
#   benches/load.sh help [SUBCOMMAND]      what each subcommand does and its environment
#
# Subcommands: compare, ab OLD NEW, floor, memory, idle [CONNECTIONS], callgrind [tollgate|bare]
# [fwd|rej|redis|h2], heap [fwd|h2], shield, fleet. The body of each is
# benches/load/SUBCOMMAND.sh (sourced here, not run on its own); all share benches/load/lib.sh,
# and the configs, the wrk script and the report's parser in benches/compare/. Everything runs
# on 127.0.0.1 only, and a subcommand stops every process it started when it ends, fails or is
# interrupted. A tool that is missing (nginx, wrk, h2load, redis-server, valgrind, haproxy,
# caddy, perf) is installed with apt-get. See docs/performance.md for the figures.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONF=$ROOT/benches/compare
SUBCOMMANDS=(compare ab floor memory idle callgrind heap shield fleet)
SUBCOMMAND=

# shellcheck source=benches/load/lib.sh
. "$ROOT/benches/load/lib.sh"
# shellcheck source=benches/load/peers.sh
. "$ROOT/benches/load/peers.sh"
# shellcheck source=benches/load/compare.sh
. "$ROOT/benches/load/compare.sh"
# shellcheck source=benches/load/ab.sh
. "$ROOT/benches/load/ab.sh"
# shellcheck source=benches/load/floor.sh
. "$ROOT/benches/load/floor.sh"
# shellcheck source=benches/load/memory.sh
. "$ROOT/benches/load/memory.sh"
# shellcheck source=benches/load/idle.sh
. "$ROOT/benches/load/idle.sh"
# shellcheck source=benches/load/callgrind.sh
. "$ROOT/benches/load/callgrind.sh"
# shellcheck source=benches/load/heap.sh
. "$ROOT/benches/load/heap.sh"
# shellcheck source=benches/load/shield.sh
. "$ROOT/benches/load/shield.sh"
# shellcheck source=benches/load/fleet.sh
. "$ROOT/benches/load/fleet.sh"

# usage [SUBCOMMAND]: what every subcommand (or that one) does, with its environment variables
# and their defaults in brackets.
usage() {
    local sub
    if [ $# -gt 0 ]; then
        known "$1" || { echo "benches/load.sh: no subcommand $1 (benches/load.sh help)" >&2; return 2; }
        "help_$1"
        return
    fi
    cat <<'TXT'
usage: benches/load.sh SUBCOMMAND [ARGS...]     (benches/load.sh help [SUBCOMMAND])

Load benchmarks of tollgate on this machine, on 127.0.0.1 only. Each subcommand starts what it
measures (an nginx backend answering "ok", nginx as the proxy, tollgate, redis-server), stops
all of it when it ends, and installs a missing tool with apt-get. Settings are environment
variables, defaults in brackets; TMPDIR says where the run's temp dir goes.

TXT
    for sub in "${SUBCOMMANDS[@]}"; do
        "help_$sub"
        echo
    done
}

known() { [[ " ${SUBCOMMANDS[*]} " == *" $1 "* ]]; }

main() {
    case ${1:-help} in
        help | -h | --help)
            [ $# -eq 0 ] || shift
            usage "$@"
            return
            ;;
    esac
    if ! known "$1"; then
        echo "benches/load.sh: no subcommand $1" >&2
        echo >&2
        usage >&2
        return 2
    fi
    SUBCOMMAND=$1
    shift
    need python3
    "run_$SUBCOMMAND" "$@"
}

main "$@"
