#!/usr/bin/env bash
# Profile-guided optimisation of tollgate, measured: does a PGO build cost less per request?
#
#   benches/pgo.sh            # build, train, rebuild, then benches/ab.sh plain against PGO
#
# 1. builds tollgate instrumented (-Cprofile-generate, target dir target/pgo-gen);
# 2. trains it with one round of benches/ab.sh (forwarded and rejected, wrk -t2 -c64 against
#    the nginx backend of compare.sh); each process writes its profile when SIGTERM stops it;
# 3. merges the profiles with the toolchain's llvm-profdata (`rustup component add llvm-tools`;
#    a system llvm-profdata of another LLVM version cannot read rustc's raw profiles);
# 4. builds tollgate with the profile (-Cprofile-use, target dir target/pgo-use);
# 5. runs benches/ab.sh target/release/tollgate target/pgo-use/release/tollgate.
# About 12 minutes on 2 cores, most of it the two fat-LTO builds. Loopback only; ab.sh stops
# what it starts. The PGO binary is left in target/pgo-use/release/tollgate.
#
# Environment: ROUNDS [3] and DURATION [5] of the final A/B.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SYSROOT=$(rustc --print sysroot)
HOST=$(rustc -vV | awk '/^host:/{print $2}')
PROFDATA=$SYSROOT/lib/rustlib/$HOST/bin/llvm-profdata
[ -x "$PROFDATA" ] || { echo "pgo.sh needs llvm-profdata: rustup component add llvm-tools" >&2; exit 1; }
PROFILES=$ROOT/target/pgo-profiles
rm -rf "$PROFILES"
mkdir -p "$PROFILES/raw"

echo "== instrumented build"
RUSTFLAGS="-Cprofile-generate=$PROFILES/raw" \
    cargo build --release --locked --target-dir target/pgo-gen --bin tollgate 2>&1 | tail -1
# Build scripts of the instrumented build write profiles too: only the training's are kept.
rm -f "$PROFILES"/raw/*.profraw
echo "== training (one round of benches/ab.sh)"
ROUNDS=1 DURATION="${TRAIN_SECONDS:-5}" benches/ab.sh target/pgo-gen/release/tollgate \
    target/pgo-gen/release/tollgate
"$PROFDATA" merge -o "$PROFILES/merged.profdata" "$PROFILES"/raw/*.profraw
echo "== build with the profile"
RUSTFLAGS="-Cprofile-use=$PROFILES/merged.profdata" \
    cargo build --release --locked --target-dir target/pgo-use --bin tollgate 2>&1 | tail -1
echo "== plain release build"
cargo build --release --locked --bin tollgate 2>&1 | tail -1
echo "== A: plain, B: PGO"
ROUNDS=${ROUNDS:-3} DURATION=${DURATION:-5} benches/ab.sh target/release/tollgate \
    target/pgo-use/release/tollgate
