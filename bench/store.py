"""State store benchmark: put / get / txn latency on SQLite and on etcd (1 and 3 members).

Sequential single-client operations (one in flight), so the numbers are per-operation
latency, not throughput. The etcd runs start real members on loopback (plain HTTP for the
single member, mutual TLS for the 3-member cluster) with temp data dirs.

    .venv/bin/python -m bench.store [--n 2000]

Prints a Markdown table of medians and p99 and writes ``bench/results/store.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from dsec.store.api import Compare, Op, Put, StateStore, Target
from dsec.store.etcd import EtcdStore
from dsec.store.sqlite import SqliteStore
from dsec.testing.etcd import etcd_binary, etcd_cluster
from dsec.testing.store_checks import admit_many


def summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in samples_s)
    return {
        "median_ms": round(statistics.median(ms), 3),
        "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 3),
        "n": len(ms),
    }


async def timed(n: int, op: Callable[[int], Awaitable[object]]) -> dict[str, float]:
    samples = []
    for i in range(n):
        t = time.perf_counter()
        await op(i)
        samples.append(time.perf_counter() - t)
    return summary(samples)


async def measure(store: StateStore, n: int) -> dict[str, dict[str, float]]:
    value = b"x" * 200
    for i in range(max(n // 5, 50)):  # warm up: file growth, WAL, connections
        await store.put(b"/bench/warm/%d" % i, value)
    out = {
        "put": await timed(n, lambda i: store.put(b"/bench/put/%d" % i, value)),
        "get": await timed(n, lambda i: store.get(b"/bench/put/%d" % i)),
        "txn (create-if-absent)": await timed(
            n,
            lambda i: store.txn(
                [Compare(b"/bench/txn/%d" % i, Target.CREATE, Op.EQ, 0)],
                [Put(b"/bench/txn/%d" % i, value)],
            ),
        ),
        "range (100 keys)": await timed(
            max(n // 10, 10), lambda i: store.range(b"/bench/put/1", limit=100)
        ),
    }
    t = time.perf_counter()
    admitted = await admit_many([store], b"/bench/quota/", attempts=500, quota=310, used=10)
    out["admission (500 concurrent, 300 left)"] = {
        "wall_ms": round((time.perf_counter() - t) * 1000, 1),
        "admitted": admitted,
    }
    return out


async def run(n: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dsec-bench-store-") as tmp:
        root = Path(tmp)
        for sync in ("FULL", "NORMAL"):
            s = await SqliteStore.open(root / f"sqlite-{sync}.db", synchronous=sync)
            try:
                results[f"sqlite (synchronous={sync})"] = await measure(s, n)
            finally:
                await s.aclose()
        if etcd_binary() is None:
            print("no etcd binary: skipping etcd")
            return results
        for size, tls in ((1, False), (3, True)):
            with etcd_cluster(root / f"etcd-{size}", size=size, tls=tls) as cluster:
                leader = cluster.wait_leader()
                eps = [leader.endpoint] + [e for e in cluster.endpoints if e != leader.endpoint]
                e = EtcdStore(eps, tls=cluster.client_tls())
                try:
                    name = f"etcd {size} member{'s, mTLS' if tls else ''} (via leader)"
                    results[name] = await measure(e, n)
                finally:
                    await e.aclose()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    results = asyncio.run(run(args.n))
    ops = ["put", "get", "txn (create-if-absent)", "range (100 keys)"]
    heads = [f"{o} median / p99 ms" for o in ops] + ["500 admissions, 300 left"]
    print("| backend | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for name, r in results.items():
        cells = [f"{r[o]['median_ms']:.3f} / {r[o]['p99_ms']:.3f}" for o in ops]
        adm = r["admission (500 concurrent, 300 left)"]
        cells.append(f"{adm['wall_ms']:.0f} ms, {adm['admitted']:.0f} admitted")
        print(f"| {name} | " + " | ".join(cells) + " |")
    out = Path(__file__).parent / "results" / "store.json"
    out.write_text(json.dumps({"n": args.n, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
