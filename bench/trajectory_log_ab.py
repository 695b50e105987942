"""The trajectory log alone (SQLite in a temp dir, no platform), per recorded step: the
read of the bound record, the quota check and the append, one writer and 8 at once.

Runs against the ``dsec`` on ``sys.path``, this tree's or an older checkout's (whose
``append`` took ``known=(record, usage)``), for a side-by-side comparison; alternate them:

    for i in 1 2; do
      PYTHONPATH=/work/main/src .venv/bin/python -m bench.trajectory_log_ab main FULL
      PYTHONPATH=src .venv/bin/python -m bench.trajectory_log_ab branch FULL
    done
"""

from __future__ import annotations

import asyncio
import inspect
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec.store.sqlite import SqliteStore
from dsec.trajectory.blobs import FileBlobStore
from dsec.trajectory.log import Step, TrajectoryLog

RESULT = {"result": {"exit_code": 0}, "stdout": "", "stderr": "", "events": []}


async def run(sync: str, steps: int, writers: int) -> tuple[float, float]:
    top = Path(tempfile.mkdtemp(prefix="dsec-bench-log-"))
    store = await SqliteStore.open(top / "log.db", synchronous=sync, retain_revisions=10_000)
    tlog = TrajectoryLog(store, FileBlobStore(top / "blobs"), default_quota_bytes=1 << 40)
    new_api = "tid" in inspect.signature(tlog.lookup).parameters
    lat: list[float] = []

    async def writer(i: int) -> None:
        t, _ = await tlog.open("bench/log", f"w{i}", spec={})
        await tlog.bind(t.id, f"sbx-{i}")
        for n in range(steps):
            t0 = time.perf_counter()
            args: Any = (f"sbx-{i}", t.id) if new_api else (f"sbx-{i}",)
            found = await tlog.lookup(*args)
            assert found is not None
            known: Any = found[1]
            if new_api:
                await tlog.check_quota("bench/log")
            else:  # the old check answered the usage entry, for append
                check: Any = tlog.check_quota
                known = (found[1], await check("bench/log"))
            await tlog.append(
                t.id,
                lambda k: Step(k, "exec", {"op": "exec", "cmd": "true"}, 200, RESULT, time.time()),
                known=known,
            )
            if n >= steps // 4:  # past the warm-up
                lat.append(time.perf_counter() - t0)
            await asyncio.sleep(0.005)  # the call itself

    try:
        await asyncio.gather(*(writer(i) for i in range(writers)))
    finally:
        await store.aclose()
        shutil.rmtree(top, ignore_errors=True)
    lat.sort()
    return round(statistics.median(lat) * 1000, 2), round(lat[int(0.9 * (len(lat) - 1))] * 1000, 2)


def main() -> None:
    label, sync = sys.argv[1], sys.argv[2]
    out = {
        "code": label,
        "sync": sync,
        "one_writer_p50_p90_ms": asyncio.run(run(sync, 200, 1)),
        "8_writers_p50_p90_ms": asyncio.run(run(sync, 50, 8)),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
