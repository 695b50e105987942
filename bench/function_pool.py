"""The function backend alone: calls straight to a sandbox's pool socket (no apiserver/edge).

    .venv/bin/python -m bench.function_pool [--n 300]

Starts a pool on a throw-away node (root only), creates one function sandbox, then times
the first ``exec(["true"])``, n sequential calls (p50/p90/p99) and the call rate with one
and four callers. Prints one JSON line with the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.container import testkit
from dsec.edge.backends.function.backend import FunctionBackend

CALL = {"op": "exec", "cmd": ["true"]}


def _ms(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 2)


async def _measure(n: int) -> dict[str, Any]:
    with testkit.container_test_env() as env:
        backend = FunctionBackend(
            env.paths, "e0b1", image_store=env.store, cgroup_parent=env.cgroup_parent
        )
        sid, paths = env.sandbox()
        t0 = time.perf_counter()
        await backend.create(sid, SandboxSpec(backend="function", memory_mb=256), paths)
        sock = paths.agent_socket

        async def one() -> float:
            t = time.perf_counter()
            res = await agent_client.call(sock, CALL, timeout=60)
            assert res.result["exit_code"] == 0, res.final
            return time.perf_counter() - t

        await one()
        first = time.perf_counter() - t0
        try:
            for _ in range(20):
                await one()
            seq = [await one() for _ in range(n)]
            rates = {}
            for callers in (1, 4):
                t = time.perf_counter()
                await asyncio.gather(*(_loop(one, n // callers) for _ in range(callers)))
                rates[callers] = round(n // callers * callers / (time.perf_counter() - t), 1)
        finally:
            await backend.destroy(sid, paths)
            await backend.close()
        return {
            "create_to_first_exec_ms": round(first * 1000, 2),
            "p50_ms": _ms(seq, 0.5),
            "p90_ms": _ms(seq, 0.9),
            "p99_ms": _ms(seq, 0.99),
            "median_ms": round(statistics.median(seq) * 1000, 2),
            "calls_per_s_1": rates[1],
            "calls_per_s_4": rates[4],
        }


async def _loop(one: Any, k: int) -> None:
    for _ in range(k):
        await one()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    a = ap.parse_args()
    before = os.getloadavg()
    out = asyncio.run(_measure(a.n))
    print(json.dumps({**out, "load_before": before, "load_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
