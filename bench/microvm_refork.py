"""Forking the same microVM again: is the second fork as cheap as the first?

One parent (``--memory-mb``, 64 MiB of the guest's tmpfs written first) is forked
``--forks`` times, one child each time; then the first child is forked (a grandchild) and
the parent paused and resumed. For each step: wall time of ``fork()`` until the new child
answered an exec, of the parent's snapshot into the template (``template_s``), the
template's device-state stream in bytes (RAM that went into it shows here), the new child's
and the parent's PSS (``/proc/<qemu>/smaps_rollup``), the RAM files on tmpfs (allocated
bytes) and the templates on disk.

    .venv/bin/python -m bench.microvm_refork [--forks 3] [--memory-mb 512] [--out NAME]

Prints JSON and writes ``bench/results/<NAME>.json`` (default ``microvm_refork``). Run it
from two checkouts (before/after) for a comparison; TCG here, so wall times move with load
(the load average is recorded) while bytes and PSS do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.microvm import Node, exec_ok, loadavg, pss_mib
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.microvm.backend import MicrovmBackend, _load_meta

MiB = 1 << 20


def allocated_mib(*dirs: Path) -> float:
    total = 0
    for d in dirs:
        for p in d.rglob("*") if d.exists() else ():
            if p.is_file():
                total += p.stat().st_blocks * 512
    return round(total / MiB, 1)


async def step(
    be: MicrovmBackend, node: Node, sid: str, kids: list[tuple[str, SandboxPaths]]
) -> dict[str, Any]:
    """Fork ``sid`` into one new child (added to ``kids``); what it cost."""
    kid = node.sandbox()
    kids.append(kid)
    template_s: list[float] = []
    make = be._make_template

    async def timed(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return await make(*args)
        finally:
            template_s.append(time.perf_counter() - t)

    be._make_template = timed  # type: ignore[method-assign,assignment]
    t0 = time.perf_counter()
    try:
        await be.fork(sid, [kid])
    finally:
        be._make_template = make  # type: ignore[method-assign]
    await exec_ok(kid[1].agent_socket)
    wall = time.perf_counter() - t0
    tid = _load_meta(be.sandboxes_dir / sid)["templates"][-1]
    await asyncio.sleep(1)
    return {
        "wall_s": round(wall, 2),
        "template_s": round(template_s[0], 2),  # snapshot (and RAM move) of the parent
        "state_mib": round((be.templates_dir / tid / "state").stat().st_size / MiB, 2),
        "child_pss_mib": round(pss_mib(be._vms[kid[0]].vmm.pid), 1),
        "parent_pss_mib": round(pss_mib(be._vms[sid].vmm.pid), 1),
        "ram_files_mib": allocated_mib(be.mem_dir),
        "templates_disk_mib": allocated_mib(be.templates_dir),
        "loadavg": loadavg(),
    }


async def run(forks: int, memory_mb: int, out: dict[str, Any]) -> None:
    root = Path(tempfile.mkdtemp(prefix="dsec-refork-"))
    run_dir = Path(tempfile.mkdtemp(prefix="drf", dir="/tmp"))
    mem = Path(tempfile.mkdtemp(prefix="dsec-refork-", dir="/dev/shm"))
    node = Node(root, run_dir, mem)
    be = node.backend
    out.update({"memory_mb": memory_mb, "accel": be.availability().reason})
    sid, p = node.sandbox()
    kids: list[tuple[str, SandboxPaths]] = []
    try:
        await be.create(sid, SandboxSpec(backend="microvm", memory_mb=memory_mb, cpu=1.0), p)
        await exec_ok(p.agent_socket, "head -c 64M /dev/urandom > /dev/shm/fill")
        out["forks"] = []
        for i in range(forks):
            out["forks"].append(await step(be, node, sid, kids))
            await exec_ok(p.agent_socket, f"head -c 8M /dev/urandom > /dev/shm/more{i}")
        out["grandchild"] = await step(be, node, kids[0][0], kids)
        t0 = time.perf_counter()
        await be.pause(sid)
        out["pause_s"] = round(time.perf_counter() - t0, 2)
        cur = be.sandboxes_dir / sid / "snapshots" / "current" / "state"
        out["pause_state_mib"] = round(cur.stat().st_size / MiB, 2)
        t0 = time.perf_counter()
        await be.resume(sid)
        await exec_ok(p.agent_socket)
        out["resume_s"] = round(time.perf_counter() - t0, 2)
        out["after_all"] = {"ram_files_mib": allocated_mib(be.mem_dir)}
    finally:
        for k, kp in reversed(kids):
            await be.destroy(k, kp)
        await be.destroy(sid, p)
        out["left_after_destroy"] = [str(x) for x in mem.iterdir()] if mem.exists() else []
        cgroups.remove(cgroups.detect(), "/" + node.cgroup_parent)
        for d in (root, run_dir, mem):
            shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forks", type=int, default=3)
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--out", default="microvm_refork")
    a = ap.parse_args()
    res: dict[str, Any] = {}
    try:
        asyncio.run(run(a.forks, a.memory_mb, res))
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        text = json.dumps(res, indent=2)
        print(text)
        dest = Path(__file__).parent / "results" / f"{a.out}.json"
        dest.write_text(text + "\n")


if __name__ == "__main__":
    main()
