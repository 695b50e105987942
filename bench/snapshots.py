"""Named snapshots through the whole platform (SDK -> apiserver -> edge), side by side with
a plain create:

* container: create -> first ``exec("true")``; ``snapshot()`` (filesystem: the sandbox's
  changes packed as a layer); ``from_snapshot`` -> first exec;
* microvm (if it runs here): one cold boot -> first exec; ``snapshot()`` (full: stop, device
  state, RAM file and disk copied, guest continues); ``from_snapshot`` -> first exec (digest
  check, restore, RAM mapped copy-on-write).

    .venv/bin/python -m bench.snapshots [--runs 3]

Prints JSON and writes ``bench/results/snapshots.json``. TCG numbers are not KVM numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.foundation import summary
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import running_platform


def _timed(fn: Callable[[], Sandbox]) -> tuple[float, Sandbox]:
    t = time.perf_counter()
    sbx = fn()
    sbx.exec("true")
    return time.perf_counter() - t, sbx


def _run(api: Client, backend: str, runs: int, cold_runs: int) -> dict[str, Any]:
    cold: list[float] = []
    snap_s: list[float] = []
    from_s: list[float] = []
    sizes: list[int] = []
    src: Sandbox | None = None
    for _ in range(cold_runs):
        dt, sbx = _timed(
            lambda: Sandbox.create(backend=backend, memory_mb=256, timeout=600, client=api)
        )
        cold.append(dt)
        if src is None:
            src = sbx
        else:
            sbx.kill()
    assert src is not None
    try:
        src.files.write("/root/data.bin", os.urandom(1 << 20))
        for _ in range(runs):
            t = time.perf_counter()
            snap = src.snapshot()
            snap_s.append(time.perf_counter() - t)
            sizes.append(snap.size_bytes)
            dt, child = _timed(functools.partial(Sandbox.from_snapshot, snap.id, 600, client=api))
            from_s.append(dt)
            child.kill()
            api.delete_snapshot(snap.id)
    finally:
        src.kill()
    return {
        "create_to_first_exec": summary(cold),
        "snapshot": summary(snap_s),
        "from_snapshot_to_first_exec": summary(from_s),
        "snapshot_bytes_median": sorted(sizes)[len(sizes) // 2],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    out: dict[str, Any] = {"load_avg_before": os.getloadavg()}
    with running_platform() as p:
        api = Client(api_url=p.api_url, api_key=p.admin_key)
        out["container"] = _run(api, "container", args.runs, args.runs)
        try:
            out["microvm"] = _run(api, "microvm", args.runs, 1)  # one cold boot (TCG)
        except Exception as exc:  # the backend does not run here
            out["microvm"] = {"skipped": str(exc)}
        api.close()
    out["load_avg_after"] = os.getloadavg()
    text = json.dumps(out, indent=1)
    print(text)
    Path(__file__).with_name("results").joinpath("snapshots.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
