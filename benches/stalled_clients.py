#!/usr/bin/env python3
"""Memory under clients that never read: N connections each ask for a large response and read
nothing; prints the proxy's resident memory (VmRSS, and its peak VmHWM) once they are all
waiting, and again after they close.

    benches/stalled_clients.py PROXY_PID HOST:PORT PATH [N] [SETTLE_SECONDS]

The proxy must allow N connections (`max_connections`) and N open files (`ulimit -n`).
"""
import resource
import socket
import sys
import time


def rss(pid):
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields["VmRSS"], fields["VmHWM"]


def main():
    pid, addr, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 10000
    settle = float(sys.argv[5]) if len(sys.argv) > 5 else 5.0
    host, port = addr.rsplit(":", 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, n + 100), max(hard, n + 100)))
    print(f"before: VmRSS {rss(pid)[0]}")
    held = []
    request = f"GET {path} HTTP/1.1\r\nHost: stalled\r\n\r\n".encode()
    for _ in range(n):
        s = socket.socket()
        # A small receive window, so the proxy's writes to this client stall at once.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        s.sendall(request)
        held.append(s)
    time.sleep(settle)
    now, peak = rss(pid)
    print(f"{n} stalled clients: VmRSS {now} (peak VmHWM {peak})")
    for s in held:
        s.close()
    time.sleep(max(settle, 12.0))
    now, peak = rss(pid)
    print(f"after they closed: VmRSS {now} (peak VmHWM {peak})")


if __name__ == "__main__":
    main()
