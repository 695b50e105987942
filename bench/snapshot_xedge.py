"""A full microVM snapshot used on its own edge and on another one, side by side: two edge
processes on this machine (separate homes, QEMU TCG), one source microVM (256 MiB, 1 MiB
written, as in ``bench.snapshots``), one snapshot; then per run:

* ``from_snapshot`` on the snapshot's edge -> first ``exec("true")`` (the comparison);
* ``from_snapshot(edge=other)`` -> first exec: the copy (manifest, the files the target
  lacks streamed through the apiserver, digests checked, disk rebased) plus the same restore;
* ``fork(edge=other)`` of the running source: a snapshot of it, the copy, a child.

    .venv/bin/python -m bench.snapshot_xedge [--runs 3]

Prints JSON and writes ``bench/results/snapshot_xedge.json``. The first copy also hashes the
shared base files on both edges (kept per process after): reported apart as ``first``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.foundation import summary
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.microvm.backend import _short_hash
from dsec.sdk import Client, Sandbox
from dsec.testing.cluster import LocalCluster, local_cluster


def _edges(c: LocalCluster, admin: Client, tag: str) -> list[str]:
    ids = []
    for n in range(2):
        extra = ["--cgroup-parent", f"dsecbx-{tag}-{n}"]
        p = c.add_edge(admin.create_join_token(600)["token"], backend="real", extra=extra)
        deadline = time.monotonic() + 60
        while not (found := [str(e["edge_id"]) for e in admin.list_edges()
                             if e.get("address") == p.address and e["healthy"]]):  # fmt: skip
            if time.monotonic() > deadline:
                raise RuntimeError("edge did not report")
            time.sleep(0.2)
        ids.append(found[0])
    return ids


def _timed(fn: Callable[[], Sandbox]) -> float:
    t = time.perf_counter()
    sbx = fn()
    sbx.exec("true")
    dt = time.perf_counter() - t
    sbx.kill()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    out: dict[str, Any] = {"load_avg_before": os.getloadavg()}
    tag = os.urandom(3).hex()
    homes: list[Path] = []
    same: list[float] = []
    other: list[float] = []
    fork: list[float] = []
    try:
        with local_cluster(apiservers=1) as c:
            api = Client(api_url=c.api_url(0), api_key=c.admin_key)
            a, b = _edges(c, api, tag)
            homes += [p.home for p in c.edges]
            src = Sandbox.create(backend="microvm", memory_mb=256, timeout=1200, client=api)
            if src.info().edge_id == b:
                a, b = b, a
            try:
                src.files.write("/root/data.bin", os.urandom(1 << 20))
                snap = src.snapshot()
                out["snapshot_bytes"] = snap.size_bytes
                first = _timed(lambda: Sandbox.from_snapshot(snap.id, 600, edge=b, client=api))
                out["first_from_snapshot_other_edge_s"] = round(first, 3)
                for _ in range(args.runs):
                    same.append(_timed(lambda: Sandbox.from_snapshot(snap.id, 600, client=api)))
                    other.append(
                        _timed(lambda: Sandbox.from_snapshot(snap.id, 600, edge=b, client=api))
                    )
                    fork.append(_timed(lambda: src.fork(1, edge=b)[0]))
            finally:
                src.kill()
                api.close()
    finally:
        for n in range(2):
            cgroups.remove(cgroups.detect(), f"/dsecbx-{tag}-{n}")
        for home in homes:  # the snapshot's RAM file outlives its edge's process
            shutil.rmtree(Path("/dev/shm") / f"dsec-vm-{_short_hash(home)}", ignore_errors=True)
    out.update(
        from_snapshot_same_edge=summary(same),
        from_snapshot_other_edge=summary(other),
        fork_other_edge=summary(fork),
        load_avg_after=os.getloadavg(),
    )
    text = json.dumps(out, indent=1)
    print(text)
    res = Path(__file__).parent / "results" / "snapshot_xedge.json"
    res.parent.mkdir(exist_ok=True)
    res.write_text(text + "\n")


if __name__ == "__main__":
    main()
