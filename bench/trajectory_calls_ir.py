"""A recorded call's own work, for instruction counts: ``trajectory_calls.call`` ``N`` times
on a sandbox bound to a trajectory (SQLite log, ``NORMAL``), the edge replaced by a stub
answering an ``exec`` after one loop pass. No platform: load on the machine does not change
the count, so two versions of the code compare exactly (issue 8, docs/benchmarks.md)::

    for n in 50 450; do
      PYTHONPATH=<side>/src valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.$n \\
        .venv/bin/python -m bench.trajectory_calls_ir $n
    done
    # per recorded call: (Ir of 450 - Ir of 50) / 400 ("Collected" in valgrind's summary)
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from aiohttp.test_utils import make_mocked_request

from dsec.apiserver import relay
from dsec.apiserver import trajectory_calls as traj
from dsec.apiserver.context import Ctx
from dsec.obs import Metrics
from dsec.store.sqlite import SqliteStore
from dsec.trajectory.blobs import FileBlobStore
from dsec.trajectory.log import TrajectoryLog

SANDBOX = "sbx-abcdefgh-0123456789"


async def _edge(*args: Any, **kwargs: Any) -> relay.Reply:
    await asyncio.sleep(0)
    return relay.Reply({"exit_code": 0, "duration_ms": 1.2}, b"", b"", [], False)


async def run(calls: int) -> int:
    """Record ``calls`` calls; the trajectory's step count after them."""
    top = Path(tempfile.mkdtemp(prefix="dsec-bench-ir-"))
    store = await SqliteStore.open(top / "log.db", synchronous="NORMAL")
    tlog = TrajectoryLog(store, FileBlobStore(top / "blobs"), default_quota_bytes=1 << 30)
    relay_call = relay.call
    setattr(relay, "call", _edge)  # noqa: B010 (the edge: a stub)
    try:
        spec = {"image": "base", "memory_mb": 256, "timeout": 900}
        t, _ = await tlog.open("admin", "bench/ir", spec=spec)
        await tlog.bind(t.id, SANDBOX)
        none: Any = None  # (no edge, no authentication: not used on this path)
        c = Ctx(
            upstream=none, auth=none, metrics=Metrics("bench"), components={}, trajectories=tlog
        )
        request = make_mocked_request("POST", f"/v1/sandboxes/{SANDBOX}/exec")
        for _ in range(calls):
            await traj.call(
                request, c, none, SANDBOX, {"op": "exec", "cmd": ["true"], "timeout": 60}
            )
        return (await tlog.get(t.id)).steps
    finally:
        setattr(relay, "call", relay_call)  # noqa: B010
        await tlog.aclose()
        await store.aclose()
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 450
    steps = asyncio.run(run(n))
    assert steps == n, f"{steps} steps recorded for {n} calls"
    print(f"{n} calls recorded")
