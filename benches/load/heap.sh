# shellcheck shell=bash
# benches/load.sh heap [fwd|h2]: what holds tollgate's heap at its peak under load, by allocation
# site, from valgrind's DHAT. Sourced by benches/load.sh, with benches/load/lib.sh.
#
# Builds tollgate with the system allocator (`--features system-alloc`: DHAT follows malloc,
# not mimalloc's own heap) and line tables into target/heap/build, starts on 127.0.0.1 the
# backend of `compare` and tollgate under `valgrind --tool=dhat` with scenario 1's config, runs
# DURATION seconds of `wrk -t1 -cCONNECTIONS` (`h2`: `h2load -t1 -cCONNECTIONS -m10` over h2c,
# scenario 5), stops tollgate, and prints the heap at its largest (t-gmax) by allocation site:
# bytes, blocks, bytes per block, and the first frames of each site's stack. Heap bytes asked,
# not RSS: mimalloc's pages, the binary's code and untouched parts of large buffers are not
# here. About 7 minutes with the build.

help_heap() {
    cat <<'TXT'
heap [fwd|h2]      tollgate's heap at its peak by allocation site (valgrind's DHAT), under
                   scenario 1 (fwd) or scenario 5 (h2: h2load -m10 over h2c). Builds tollgate
                   with the system allocator into target/heap/build; the profile stays in
                   target/heap/NAME.json (valgrind's dh_view.html reads it).
    DURATION [10]     seconds of load               CONNECTIONS [64]
    SITES [25]        allocation sites printed       FRAMES [4]  frames of each site's stack
TXT
}

run_heap() {
    [ $# -le 1 ] || usage_error "benches/load.sh heap [fwd|h2]"
    local mode=${1:-fwd} out=$ROOT/target/heap bin pid port load name
    case $mode in
        fwd | h2) ;;
        *) usage_error "benches/load.sh heap [fwd|h2]" ;;
    esac
    DURATION=${DURATION:-10}
    CONNECTIONS=${CONNECTIONS:-64}
    need valgrind nginx wrk curl python3 ss
    [ "$mode" != h2 ] || need h2load
    mkdir -p "$out"
    bin=$out/build/release/tollgate
    log "building tollgate with the system allocator"
    (cd "$ROOT" && CARGO_PROFILE_RELEASE_DEBUG=line-tables-only cargo build --release --locked \
        --features system-alloc --bin tollgate --target-dir "$out/build") 2>&1 | tail -1 >&2

    start_run
    start_backend
    port=$(free_port)
    tollgate_config "$TMP/heap.yaml" "$port" "$LOCAL" "${FWD_TOLLGATE[@]}"
    name=tollgate-$mode
    rm -f "$out/$name.json"
    spawn heap valgrind --tool=dhat --dhat-out-file="$out/$name.json" \
        "$bin" run --config "$TMP/heap.yaml" --access-log false --log-level warn
    pid=$SPAWNED
    wait_port "$port" "$pid" "tollgate under valgrind" 60
    load=(wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s")
    [ "$mode" != h2 ] || load=(h2load -t1 -c"$CONNECTIONS" -m10 -D "$DURATION")
    bounded $((DURATION + 30)) "$TMP/load.txt" "${load[@]}" "http://127.0.0.1:$port/" ||
        die "the client failed: $(cat "$TMP/load.txt")"
    # DHAT writes its profile as the process exits: give it time, then stop what is left.
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    stop "$pid"
    [ -s "$out/$name.json" ] || die "DHAT wrote no profile (see $TMP/heap)"
    log "$(awk '/requests in/ {print $1 " requests"} /^requests:/ {print $8 " requests"}' "$TMP/load.txt")"
    python3 - "$out/$name.json" "${SITES:-25}" "${FRAMES:-4}" <<'PY'
import json, re, sys

profile, sites, frames = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = json.load(open(profile))
names = d["ftbl"]
# Frames of the allocator and of std's containers say nothing about who holds the memory.
plumbing = re.compile(
    r"UnknownInlinedFun|alloc_impl|malloc|memalign|RawVec|raw_vec|finish_grow|grow_|"
    r"do_reserve|exchange_malloc|@alloc\.rs|with_capacity_in|try_allocate_in|box_new_uninit|"
    r"^alloc @|^allocate @|^\?\?\?|^with_capacity|^new_uninit|^reserve|^new<alloc::sync::ArcInner")


def frame(i):
    m = re.match(r"0x[0-9A-Fa-f]+: (.*?) \((?:in )?(.*)\)$", names[i])
    if not m:
        return names[i]
    text = re.sub(r"::h[0-9a-f]{16}", "", m.group(1))
    return f"{text[:140]} @{m.group(2).split('/')[-1]}"


pps = sorted(d["pps"], key=lambda p: -p.get("gb", 0))
total = sum(p.get("gb", 0) for p in pps)
print(f"heap at its peak: {total / 1e6:.1f} MB in {sum(p.get('gbk', 0) for p in pps)} blocks")
print(f"{'bytes':>11} {'blocks':>7} {'each':>7}  site")
for p in pps[:sites]:
    gb, gbk = p.get("gb", 0), p.get("gbk", 0)
    if not gb:
        break
    stack = [frame(i) for i in p["fs"]]
    shown = [f for f in stack if not plumbing.search(f)][:frames]
    print(f"{gb:>11,} {gbk:>7} {gb // max(gbk, 1):>7}  {shown[0] if shown else '?'}")
    for f in shown[1:]:
        print(f"{'':>29}{f}")
PY
    echo "profile: $out/$name.json"
}
