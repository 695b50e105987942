"""CPU time the apiserver spends per ``exec("true")`` of a sandbox bound to a trajectory
(each call recorded) against one of an unbound sandbox, with the round trips: blocks of
``--block`` calls, alternating recorded and unbound, the apiserver's CPU time (user +
system of all its threads, ``/proc/<pid>/task/*/stat``) read around each block. CPU time
moves less with the machine's load than wall time. ``--sync``: FULL or NORMAL.

    .venv/bin/python -m bench.trajectory_cpu [--calls 600] [--block 50] [--sync NORMAL]

For two versions side by side, run it with ``PYTHONPATH`` of each in turn (as
``bench.trajectory_ab``). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from typing import Any

import dsec
from bench.call_cpu import _cpu
from bench.foundation import settle, summary
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import running_platform


def _apiserver_cpu(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    _cpu(pid, "apiserver", True, out)
    out.pop("apiserver:children", None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("label", nargs="?", default="this")
    ap.add_argument("--calls", type=int, default=600, help="calls per side")
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--sync", default="NORMAL")
    args = ap.parse_args()
    os.environ["DSEC_TRAJECTORY_SYNC"] = args.sync
    out: dict[str, Any] = {
        "code": args.label,
        "dsec": os.path.dirname(dsec.__file__),
        "sync": args.sync,
        "load": os.getloadavg(),
    }
    with running_platform() as p:
        client = Client(api_url=p.api_url, api_key=p.admin_key)
        settle(3)
        pid = p.pid("apiserver")
        plain = Sandbox.create(memory_mb=256, timeout=900, client=client)
        bound = Sandbox.create(
            memory_mb=256, timeout=900, trajectory=f"bench/{uuid.uuid4().hex}", client=client
        )
        try:
            for s in (plain, bound):
                for _ in range(20):
                    s.exec("true")
            wall: dict[str, list[float]] = {"unbound": [], "recorded": []}
            cpu: dict[str, float] = {"unbound": 0.0, "recorded": 0.0}
            threads: dict[str, dict[str, float]] = {"unbound": {}, "recorded": {}}
            for _ in range(args.calls // args.block):
                for name, s in (("unbound", plain), ("recorded", bound)):
                    before = _apiserver_cpu(pid)
                    for _ in range(args.block):
                        t0 = time.perf_counter()
                        s.exec("true")
                        wall[name].append(time.perf_counter() - t0)
                    after = _apiserver_cpu(pid)
                    for k, v in after.items():
                        d = v - before.get(k, 0.0)
                        cpu[name] += d
                        threads[name][k] = threads[name].get(k, 0.0) + d
        finally:
            plain.kill()
            bound.kill()
            client.close()
    n = args.calls // args.block * args.block
    for name in ("unbound", "recorded"):
        out[name] = summary(wall[name]) | {
            "apiserver_cpu_ms_per_call": round(cpu[name] / n * 1000, 3),
            "by_thread": {
                k.removeprefix("apiserver:"): round(v / n * 1000, 3)
                for k, v in sorted(threads[name].items())
                if v / n * 1000 >= 0.01
            },
        }
    base, rec = out["unbound"]["p50_ms"], out["recorded"]["p50_ms"]
    out["overhead_p50_ms"] = round(rec - base, 2)
    out["overhead_p50_pct"] = round(100 * (rec - base) / base, 1)
    out["apiserver_cpu_overhead_ms_per_call"] = round(
        out["recorded"]["apiserver_cpu_ms_per_call"] - out["unbound"]["apiserver_cpu_ms_per_call"],
        3,
    )
    out["samples_median_ms"] = {k: round(statistics.median(v) * 1000, 2) for k, v in wall.items()}
    out["load_at_end"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
