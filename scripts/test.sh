#!/usr/bin/env bash
# Run every test of tollgate on a fresh Debian machine: install what is missing, then the suite.
#
#   scripts/test.sh            # fmt check, clippy, all tests
#   SKIP_LINT=1 scripts/test.sh
#
# Integration tests start their own redis-server processes on free loopback ports; nothing
# here depends on a Redis already running.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v redis-cli >/dev/null || need_apt+=(redis-tools)
command -v curl >/dev/null || need_apt+=(curl)
command -v chromium >/dev/null || need_apt+=(chromium)
# libfaketime steps a test redis-server's wall clock (tests/redis_backends/faults_redis.rs).
command -v faketime >/dev/null || need_apt+=(faketime)
command -v openssl >/dev/null || need_apt+=(openssl)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
# Prometheus and promtool (2.42 on Debian 12): tests/admin/observability.rs scrapes tollgate with a
# real server and checks the shipped dashboard and alert rules against it.
command -v prometheus >/dev/null && command -v promtool >/dev/null || need_apt+=(prometheus)
[ -n "${SKIP_LINT:-}" ] || command -v shellcheck >/dev/null || need_apt+=(shellcheck)
# The distribution's redis-server and prometheus packages start system instances (6379, 9090,
# 9100) when installed; the tests never use them. Stop only what this install started: a
# service that was running before is the machine's, and is left alone.
units=(redis-server prometheus prometheus-node-exporter)
active() { command -v systemctl >/dev/null && systemctl is-active --quiet "$1" 2>/dev/null; }
running_before=()
for unit in "${units[@]}"; do
  if active "$unit"; then running_before+=("$unit"); fi
done
if ((${#need_apt[@]})); then
  echo "installing: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
  for unit in "${units[@]}"; do
    if active "$unit" && [[ " ${running_before[*]} " != *" $unit "* ]]; then
      echo "stopping $unit, which the install just started"
      $SUDO systemctl stop "$unit" || true
    fi
  done
fi

# A real gRPC server and client (grpcio) for tests/proxying/grpc.rs, once pip is there.
if ! python3 -c "import grpc" 2>/dev/null; then
  echo "installing: grpcio (pip)"
  python3 -m pip install -q grpcio || python3 -m pip install -q --break-system-packages grpcio
fi
# The OTLP messages a test receiver of traces decodes (tests/fixtures/otlp/receiver.py).
if ! python3 -c "import opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc" 2>/dev/null; then
  echo "installing: opentelemetry-proto (pip)"
  python3 -m pip install -q opentelemetry-proto || python3 -m pip install -q --break-system-packages opentelemetry-proto
fi

if [ -z "${SKIP_LINT:-}" ]; then
  cargo fmt --all -- --check
  cargo clippy --workspace --all-targets --locked -- -D warnings
  shellcheck -x benches/*.sh benches/*/*.sh scripts/*.sh
fi

# Advisory audit: needs the RustSec database, which is fetched from outside the package
# registries this machine can reach. Run it where it can; say so plainly where it cannot.
if command -v cargo-audit >/dev/null 2>&1 && [ -d "${CARGO_HOME:-$HOME/.cargo}/advisory-db" ]; then
  cargo audit --no-fetch --deny warnings
else
  echo "cargo audit: skipped (cargo-audit or its advisory database is not available here);" \
       "dependency floors for h2 and rustls are pinned in Cargo.toml"
fi

# The shipped alert rules: valid, and their unit tests pass.
promtool check rules deploy/prometheus/tollgate-rules.yaml
promtool test rules deploy/prometheus/tollgate-rules.test.yaml

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi

# The Dockerfile's build stage sees only what it copies (and .dockerignore lets through): cargo
# must be able to load the workspace (members, path dependencies, targets) from those files.
docker_context=$(mktemp -d)
while read -r src; do
  grep -qx "!${src%/}/\?" .dockerignore || { echo "Dockerfile copies $src, which .dockerignore leaves out" >&2; exit 1; }
  cp -r "$src" "$docker_context/"
done < <(awk '$1 == "COPY" && $2 !~ /^--/ { for (i = 2; i < NF; i++) print $i }' Dockerfile)
(cd "$docker_context" && cargo tree --locked --offline --target "$(rustc -vV | sed -n "s/^host: //p")" >/dev/null) ||
  { echo "cargo cannot load the manifest from the files the Dockerfile copies" >&2; exit 1; }
rm -rf "$docker_context"

# Every shipped config must pass `tollgate check` (the test build's binary is enough for that).
# The release binary, built exactly as the Dockerfile builds it (fat LTO, minutes on two cores),
# is built only when asked for: RELEASE=1.
target_dir=${CARGO_TARGET_DIR:-target}
bin=$target_dir/debug/tollgate
if [ -n "${RELEASE:-}" ]; then
  cargo build --release --locked
  bin=$target_dir/release/tollgate
elif [ ! -x "$bin" ]; then
  # The tests built it already; a `cargo build` here would compile every dependency again
  # for the dev profile (about a minute).
  cargo build --locked --bin tollgate
fi
for cfg in config/*.yaml deploy/*.yaml deploy/kubernetes/tollgate.yaml; do
  [ -f "$cfg" ] || continue
  "$bin" check --config "$cfg" >/dev/null
  echo "check ok: $cfg"
done
