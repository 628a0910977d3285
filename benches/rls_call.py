#!/usr/bin/env python3
"""Write one gRPC-framed ShouldRateLimit call to stdout, for h2load -d.

    benches/rls_call.py DOMAIN KEY=VALUE[,KEY=VALUE...] [...] > call.bin
    h2load -n 200000 -c 10 -m 10 -d call.bin -H 'content-type: application/grpc' \
        -H 'te: trailers' http://127.0.0.1:8081/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit

Each argument after the domain is one descriptor. The protobuf is written by hand (three
message types, strings only), so nothing needs installing.
"""
import sys


def varint(n):
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out += bytes([low | 0x80])
        else:
            return out + bytes([low])


def field(number, payload):
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    call = field(1, argv[1].encode())
    for descriptor in argv[2:]:
        entries = b""
        for entry in descriptor.split(","):
            key, value = entry.split("=", 1)
            entries += field(1, field(1, key.encode()) + field(2, value.encode()))
        call += field(2, entries)
    sys.stdout.buffer.write(b"\x00" + len(call).to_bytes(4, "big") + call)


if __name__ == "__main__":
    main(sys.argv)
