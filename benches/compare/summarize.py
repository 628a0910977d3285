#!/usr/bin/env python3
"""Parses wrk and h2load output for benches/load.sh (compare, ab, floor) and prints the report.

  summarize.py wrk OUT                 -> req/s, p50 ms, p99 ms, requests, non-2xx, errors
  summarize.py h2load OUT LOG          -> the same, p50/p99 computed from h2load's --log-file
  summarize.py perf PERF WRK_OUT       -> "SYSCALLS/SWITCHES" per request: perf stat -x, counts
                                          over the wrk run whose output is WRK_OUT
  summarize.py report ROWS RATIOS      -> the Markdown table and the ratio lines

Fields are printed tab-separated, "-" where a figure is missing.
"""

import re
import sys


def ms(text):
    """A wrk duration ("512.00us", "3.21ms", "1.02s", "2.00m") in milliseconds."""
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if not m:
        return None
    value, unit = float(m.group(1)), m.group(2)
    return value * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}[unit]


def wrk(path):
    out = open(path, encoding="utf-8", errors="replace").read()
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    total = re.search(r"^\s+(\d+) requests in", out, re.M)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out
    )
    errors = sum(int(x) for x in sock.groups()) if sock else 0
    return [
        rps.group(1) if rps else "-",
        fmt(ms(p50.group(1))) if p50 else "-",
        fmt(ms(p99.group(1))) if p99 else "-",
        total.group(1) if total else "-",
        non2xx.group(1) if non2xx else "0",
        str(errors),
    ]


def h2load(path, log):
    out = open(path, encoding="utf-8", errors="replace").read()
    rps = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    req = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
        r"(\d+) failed, (\d+) errored, (\d+) timeout",
        out,
    )
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    non2xx = sum(int(x) for x in codes.groups()[1:]) if codes else 0
    # h2load counts a 4xx or 5xx answer as "failed": those are the non-2xx above, not errors.
    # Errors are the requests that got no answer ("errored") or timed out.
    errors = int(req.group(6)) + int(req.group(7)) if req else 0
    # Percentiles from the per-request log (third column: microseconds until the end of the
    # response). h2load's own summary has min/max/mean/sd only.
    times = []
    try:
        with open(log, encoding="utf-8") as f:
            for line in f:
                cols = line.split("\t")
                if len(cols) >= 3:
                    times.append(int(cols[2]))
    except OSError:
        pass
    times.sort()
    if times:
        p50 = fmt(times[int(0.50 * (len(times) - 1))] / 1e3)
        p99 = fmt(times[int(0.99 * (len(times) - 1))] / 1e3)
    else:
        p50 = p99 = "-"
    return [
        rps.group(1) if rps else "-",
        p50,
        p99,
        req.group(3) if req else "-",
        str(non2xx),
        str(errors),
    ]


def perf(path, wrk_out):
    """System calls and context switches per request, from `perf stat -x,` over one wrk run."""
    counts = {}
    try:
        for line in open(path, encoding="utf-8", errors="replace"):
            cols = line.strip().split(",")
            if len(cols) >= 3 and not line.startswith("#"):
                counts[cols[2]] = num(cols[0])
    except OSError:
        pass
    total = num(wrk(wrk_out)[3])
    sysc, ctx = counts.get("raw_syscalls:sys_enter"), counts.get("context-switches")
    if not total or sysc is None or ctx is None:
        return "-"
    return f"{sysc / total:.2f}/{ctx / total:.3f}"


def fmt(x):
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}"


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def report(rows_path, ratios_path):
    rows = [l.rstrip("\n").split("\t") for l in open(rows_path, encoding="utf-8") if l.strip()]
    # scenario, target, rps, p50, p99, requests, non2xx, errors, rss_kb, probe[, cpu[, sys]]:
    # cpu is "USER/SYSTEM" microseconds per request, sys "SYSCALLS/SWITCHES" per request (wrk
    # runs only; sys counted over the warm-up).
    print(
        "| scenario | target | req/s | p50 (ms) | p99 (ms) | CPU per request (µs, user + system)"
        " | syscalls per request | context switches per request | peak RSS (MB) | non-2xx |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    by = {}
    for row in rows:
        scen, target, rps, p50, p99, total, non2xx, errors, rss, probe = row[:10]
        cpu = row[10] if len(row) > 10 else "-"
        sysc, _, ctx = (row[11] if len(row) > 11 else "-").partition("/")
        user, _, system = cpu.partition("/")
        cpu_total = num(user) + num(system) if num(user) is not None and num(system) is not None else None
        cpu_cell = f"{user} + {system}" if cpu_total is not None else "-"
        # With ROUNDS > 1 a scenario's target is measured several times: each run is a row.
        runs = by.setdefault((scen, target), [])
        runs.append((rps, p99, cpu_total))
        label = target if len(runs) == 1 else f"{target}, round {len(runs)}"
        rss_mb = f"{int(rss) / 1024:.1f}" if rss.isdigit() else "-"
        cell = f"{non2xx} of {total}"
        if probe and probe != "-":
            cell += f" (probe: {probe})"
        if errors != "0":
            cell += f", {errors} socket errors"
        rps_cell = f"{float(rps):,.0f}" if num(rps) is not None else rps
        print(
            f"| {scen} | {label} | {rps_cell} | {p50} | {p99} | {cpu_cell} | {sysc}"
            f" | {ctx or '-'} | {rss_mb} | {cell} |"
        )
    print()
    for line in open(ratios_path, encoding="utf-8"):
        if not line.strip():
            continue
        label, sa, ta, sb, tb = line.rstrip("\n").split("\t")
        a, b = by.get((sa, ta)), by.get((sb, tb))
        if not a or not b:
            print(f"- {label}: not measured")
            continue
        tp = ratio(median(r[0] for r in a), median(r[0] for r in b))
        lat = ratio(median(r[1] for r in a), median(r[1] for r in b))
        cpu = ratio(median(r[2] for r in a), median(r[2] for r in b))
        # The proxy's own CPU per request moves less with the machine's load than req/s does.
        cpu_part = f", CPU per request {cpu}" if cpu != "-" else ""
        if len(a) == 1 and len(b) == 1:
            print(f"- {label}: throughput {tp}, p99 {lat}{cpu_part}")
            continue
        line = (
            f"- {label}: throughput {tp}, p99 {lat}{cpu_part} between the medians of"
            f" {len(a)} and {len(b)} runs"
        )
        if len(a) == len(b):
            # Round by round: the i-th run of each, as they alternated.
            each = ", ".join(
                f"{ratio(x[0], y[0])} (p99 {ratio(x[1], y[1])})" for x, y in zip(a, b)
            )
            line += f"; round by round: {each}"
        print(line)


def median(values):
    xs = sorted(v for v in map(num, values) if v is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def ratio(a, b):
    a, b = num(a), num(b)
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "wrk":
        print("\t".join(wrk(sys.argv[2])))
    elif cmd == "h2load":
        print("\t".join(h2load(sys.argv[2], sys.argv[3])))
    elif cmd == "perf":
        print(perf(sys.argv[2], sys.argv[3]))
    elif cmd == "report":
        report(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {cmd}")
