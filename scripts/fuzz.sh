#!/usr/bin/env bash
# Run every cargo-fuzz target of tollgate for a bounded time, one after the other, one worker.
#
#   scripts/fuzz.sh            # each target for 60 s
#   scripts/fuzz.sh 300        # each target for 300 s
#   FUZZ_TARGETS="config values" scripts/fuzz.sh 30
#
# Not part of scripts/test.sh or CI (too slow, and results vary run to run); see
# docs/fuzzing.md. Exits non-zero when any target finds a crash, a timeout or an OOM; the
# input is left in fuzz/artifacts/<target>/ and the log in fuzz/artifacts/<target>/run.log.
#
# Settings (environment):
#   FUZZ_TARGETS    targets to run (default: all of them, in the order below)
#   FUZZ_SANITIZER  address (default), none (about twice as fast), leak, ...
#   FUZZ_TIMEOUT    seconds one input may take before libFuzzer calls it a hang (default 10)
#   FUZZ_RSS_MB     memory limit in MiB (default 2048)
#
# The committed seeds in fuzz/corpus/<target>/ are read, never written: inputs libFuzzer finds
# go to fuzz/corpus-new/<target>/ (git-ignored); promote a seed by hand when it is meaningful.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${1:-60}"
if ! [[ "$secs" =~ ^[0-9]+$ ]] || [ "$secs" -lt 1 ]; then
  echo "usage: $0 [SECONDS_PER_TARGET]" >&2
  exit 2
fi
read -r -a targets <<<"${FUZZ_TARGETS:-config values forwarded_for identity request_head canonical}"
sanitizer="${FUZZ_SANITIZER:-address}"

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

# cargo-fuzz needs nightly-only rustc flags (-Zsanitizer, sancov passes). This machine has
# only the stable toolchain; RUSTC_BOOTSTRAP=1 lets stable rustc accept them.
export RUSTC_BOOTSTRAP=1

# --debug-assertions: overflow checks and debug_assert!s (tollgate's and hyper's) are on.
build=(--release --debug-assertions --sanitizer "$sanitizer")
cargo fuzz build "${build[@]}"

failed=()
summary=()
for t in "${targets[@]}"; do
  [ -d "fuzz/corpus/$t" ] || { echo "no such target: $t" >&2; exit 2; }
  mkdir -p "fuzz/corpus-new/$t" "fuzz/artifacts/$t"
  log="fuzz/artifacts/$t/run.log"
  args=(
    -max_total_time="$secs"
    -timeout="${FUZZ_TIMEOUT:-10}"
    -rss_limit_mb="${FUZZ_RSS_MB:-2048}"
    -print_final_stats=1
    -artifact_prefix="fuzz/artifacts/$t/"
  )
  [ -f "fuzz/dict/$t.dict" ] && args+=(-dict="fuzz/dict/$t.dict")
  echo "== $t: ${secs}s"
  marker=$(mktemp)
  set +e
  # First corpus directory: where new inputs are written; the second: the committed seeds.
  cargo fuzz run "${build[@]}" "$t" "fuzz/corpus-new/$t" "fuzz/corpus/$t" -- "${args[@]}" \
    >"$log" 2>&1
  rc=$?
  set -e
  # The last status line libFuzzer printed ("#N DONE cov: .. ft: .. corp: .. exec/s: ..").
  last=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
  found=$(find "fuzz/artifacts/$t" -maxdepth 1 -type f ! -name run.log -newer "$marker" | sort)
  rm -f "$marker"
  if [ "$rc" -ne 0 ] || grep -qE '^(==[0-9]+== ?ERROR|SUMMARY: libFuzzer)' "$log"; then
    failed+=("$t")
    # The panic message (the line after "panicked at"), else the sanitizer's summary.
    why=$(grep -A1 -m1 'panicked at' "$log" | tail -n 1 | cut -c1-160 || true)
    [ -n "$why" ] || why=$(grep -m1 -E '^SUMMARY' "$log" || true)
    summary+=("$t: FAILED (exit $rc) after ${last:-loading the corpus}: ${why}")
    echo "   FAILED (exit $rc); log: $log"
    grep -E "panicked at|^SUMMARY|ERROR: libFuzzer|Test unit written to" "$log" | head -n 8 | sed 's/^/   /'
  else
    summary+=("$t: ok ${last}")
    echo "   ok: ${last}"
  fi
  if [ -n "$found" ]; then
    echo "   artifacts:"
    while read -r f; do echo "     $f"; done <<<"$found"
  fi
done

echo
echo "== summary (${secs}s per target, sanitizer $sanitizer)"
printf '%s\n' "${summary[@]}"
if ((${#failed[@]})); then
  echo
  echo "crashes in: ${failed[*]}. Reproduce with:"
  echo "  RUSTC_BOOTSTRAP=1 cargo fuzz run ${build[*]} TARGET fuzz/artifacts/TARGET/crash-..."
  echo "then minimise (cargo fuzz tmin) and add it to tests/edge/fuzz_regressions.rs (docs/fuzzing.md)."
  exit 1
fi
