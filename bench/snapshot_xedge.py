"""A full microVM snapshot used on its own edge and on another one, side by side: two edge
processes on this machine (separate homes, QEMU TCG), one source microVM (256 MiB, 1 MiB
written, as in ``bench.snapshots``), one snapshot; then per run, alternating:

* ``from_snapshot`` on the snapshot's edge -> first ``exec("true")`` (the comparison);
* ``from_snapshot(edge=other)`` -> first exec with the target's cache of received snapshot
  files emptied first (``uncached``: the copy streams RAM, state and disk, digests checked,
  disk rebased) and right after (``cached``: only the manifest goes over);
* ``fork(edge=other)`` of the running source: a snapshot of it, the copy, a child;
* a sandbox started from the snapshot on its edge and paused, then ``resume()`` there (the
  comparison) or ``resume(edge=other)`` (its pause snapshot copied, a new id there, the
  allocation moved, the source ended) -> first exec.

    .venv/bin/python -m bench.snapshot_xedge [--runs 3]

Prints JSON and writes ``bench/results/snapshot_xedge.json``, with the bytes each kind of
copy sent (the apiserver's ``snapshot_copy_bytes``). The first copy also hashes the shared
base files on both edges (kept per process after): reported apart as ``first``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import time
import urllib.request
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


def _copied(c: LocalCluster) -> int:
    with urllib.request.urlopen(c.api_url(0) + "/metrics", timeout=10) as r:
        m = re.search(r"^dsec_apiserver_snapshot_copy_bytes_total (\S+)$", r.read().decode(), re.M)
    return int(float(m.group(1))) if m else 0


def _drop_cache(home: Path) -> None:
    """Empty an edge's cache of received snapshot files (what its size bound does)."""
    for p in (Path("/dev/shm") / f"dsec-vm-{_short_hash(home)}").glob("cache-*"):
        p.unlink()
    shutil.rmtree(home / "edge" / "vm-cache", ignore_errors=True)


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
    times: dict[str, list[float]] = {k: [] for k in (
        "from_snapshot_same_edge", "from_snapshot_other_edge_uncached",
        "from_snapshot_other_edge_cached", "fork_other_edge", "resume_same_edge",
        "resume_other_edge")}  # fmt: skip
    sent: dict[str, list[int]] = {k: [] for k in times}
    try:
        with local_cluster(apiservers=1) as c:
            api = Client(api_url=c.api_url(0), api_key=c.admin_key)
            a, b = _edges(c, api, tag)
            homes += [p.home for p in c.edges]
            home_of = {e: p.home for e, p in zip((a, b), c.edges, strict=True)}
            src = Sandbox.create(backend="microvm", memory_mb=256, timeout=1200, client=api)
            if src.info().edge_id == b:
                a, b = b, a
            try:
                src.files.write("/root/data.bin", os.urandom(1 << 20))
                snap = src.snapshot()
                out["snapshot_bytes"] = snap.size_bytes
                first = _timed(lambda: Sandbox.from_snapshot(snap.id, 600, edge=b, client=api))
                out["first_from_snapshot_other_edge_s"] = round(first, 3)

                def paused() -> Sandbox:
                    s = Sandbox.from_snapshot(snap.id, 600, client=api)
                    s.exec("true")
                    s.pause()
                    return s

                def uncached() -> Sandbox:
                    _drop_cache(home_of[b])
                    return Sandbox.from_snapshot(snap.id, 600, edge=b, client=api)

                def resumed(s: Sandbox, edge: str | None) -> Sandbox:
                    s.resume(edge=edge)
                    return s

                runs: list[tuple[str, Callable[[], Sandbox]]] = [
                    ("from_snapshot_same_edge",
                     lambda: Sandbox.from_snapshot(snap.id, 600, client=api)),
                    ("from_snapshot_other_edge_uncached", uncached),
                    ("from_snapshot_other_edge_cached",
                     lambda: Sandbox.from_snapshot(snap.id, 600, edge=b, client=api)),
                    ("fork_other_edge", lambda: src.fork(1, edge=b)[0]),
                ]  # fmt: skip
                for _ in range(args.runs):
                    for name, fn in runs:
                        n0 = _copied(c)
                        times[name].append(_timed(fn))
                        sent[name].append(_copied(c) - n0)
                    for name, edge in (("resume_same_edge", None), ("resume_other_edge", b)):
                        s = paused()
                        n0 = _copied(c)
                        times[name].append(_timed(functools.partial(resumed, s, edge)))
                        sent[name].append(_copied(c) - n0)
            finally:
                src.kill()
                api.close()
    finally:
        for n in range(2):
            cgroups.remove(cgroups.detect(), f"/dsecbx-{tag}-{n}")
        for home in homes:  # the snapshot's RAM file outlives its edge's process
            shutil.rmtree(Path("/dev/shm") / f"dsec-vm-{_short_hash(home)}", ignore_errors=True)
    for name, samples in times.items():
        out[name] = {**summary(samples), "bytes_copied": sorted(sent[name])}
    out["load_avg_after"] = os.getloadavg()
    text = json.dumps(out, indent=1)
    print(text)
    res = Path(__file__).parent / "results" / "snapshot_xedge.json"
    res.parent.mkdir(exist_ok=True)
    res.write_text(text + "\n")


if __name__ == "__main__":
    main()
