"""Free TCP ports on 127.0.0.1 for daemons the tests and benchmarks start.

A port found free is only bound later, by a daemon that starts seconds after (the last of
a platform's components starts ~5 s after the first). A port inside the kernel's ephemeral
range (``net.ipv4.ip_local_port_range``) can meanwhile become the local end of some
outgoing connection on this machine, and the daemon then fails with "address already in
use". So ports are taken from outside that range.
"""

from __future__ import annotations

import os
import socket

RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 10000  # below this: well-known and registered services


def ephemeral_range(path: str = RANGE_FILE) -> tuple[int, int]:
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return lo, hi


def candidate_bases(count: int, ephemeral: tuple[int, int]) -> list[range]:
    """The ranges a block of ``count`` ports may start in: outside ``ephemeral``."""
    lo, hi = ephemeral
    spans = [range(LOWEST, lo - count + 1), range(hi + 1, 65536 - count + 1)]
    return [r for r in spans if len(r) > 0]


def free_port_base(count: int = 1) -> int:
    """The first of ``count`` consecutive ports, all free now and none ephemeral."""
    spans = candidate_bases(count, ephemeral_range())
    if not spans:
        raise RuntimeError(f"no room for {count} ports outside the ephemeral range")
    total = sum(len(r) for r in spans)
    for _ in range(200):
        i = int.from_bytes(os.urandom(4), "big") % total
        for r in spans:
            if i < len(r):
                base = r[i]
                break
            i -= len(r)
        if _all_free(base, count):
            return base
    raise RuntimeError("no free port range")


def free_port() -> int:
    return free_port_base(1)


def _all_free(base: int, count: int) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in range(base, base + count):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()
