"""Full-VM benchmark (QEMU q35 + the Debian system image, TCG on this machine).

Drives :class:`VmBackend` directly in a temp node (no apiserver hop) and measures the row
the backends table needs:

* create -> first ``exec("true")`` returns (QEMU start, SeaBIOS, Debian kernel, initramfs,
  systemd up to the agent units, one runtime call);
* exec round trip (``exec("true")``, sequential, after the boot settled);
* pause (snapshot to a file, QEMU quit) and resume -> first exec;
* host memory of one idle VM: PSS of its QEMU (``/proc/<pid>/smaps_rollup``) once the
  guest reached ``systemctl is-system-running``.

    .venv/bin/python -m bench.vm [--runs 3] [--execs 50] [--memory-mb 512]

Prints JSON and writes ``bench/results/vm.json``. TCG numbers are not KVM numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.foundation import summary
from dsec.core.ids import new_sandbox_id
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.vm.backend import VmBackend
from dsec.edge.images.store import ImageStore
from dsec.paths import Paths


def pss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def exec_ok(sock: Path, cmd: str = "true", timeout: float = 240) -> str:
    res = await agent_client.call(sock, {"op": "exec", "cmd": cmd}, timeout=timeout)
    assert res.result.get("exit_code") == 0, (cmd, res.final, res.stderr)
    return res.stdout.decode()


async def run(runs: int, execs: int, memory_mb: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="dsec-fullvmbench-"))
    run_dir = Path(tempfile.mkdtemp(prefix="dfb", dir="/tmp"))
    mem = Path(tempfile.mkdtemp(prefix="dsec-fullvmbench-", dir="/dev/shm"))
    paths = Paths(home=root / "home", data=Paths.from_env().data, run=run_dir)
    (run_dir / "sbx").mkdir()
    parent = f"dsecbench-{os.urandom(3).hex()}"
    be = VmBackend(
        paths, "e0b2", image_store=ImageStore(root / "images"), cgroup_parent=parent, mem_dir=mem
    )
    avail = be.availability()
    if not avail.available:
        raise SystemExit(f"vm backend unavailable: {avail.reason}")
    spec = SandboxSpec(backend="vm", memory_mb=memory_mb, cpu=1.0)
    out: dict[str, Any] = {
        "backend": "vm",
        "accel": avail.reason,
        "memory_mb": memory_mb,
        "load_before": os.getloadavg()[0],
        "note": "TCG (no usable KVM here): these are not KVM figures",
    }
    live: list[tuple[str, SandboxPaths]] = []

    def sandbox() -> tuple[str, SandboxPaths]:
        sid = new_sandbox_id("e0b2", os.urandom(13))
        sp = SandboxPaths(be.sandboxes_dir / sid, run_dir / "sbx" / f"{sid}.sock")
        live.append((sid, sp))
        return sid, sp

    try:
        create: list[float] = []
        rtt: list[float] = []
        resume: list[float] = []
        pss: list[float] = []
        for _ in range(runs):
            sid, p = sandbox()
            t0 = time.perf_counter()
            await be.create(sid, spec, p)
            await exec_ok(p.agent_socket)
            create.append(time.perf_counter() - t0)
            state = await exec_ok(p.agent_socket, "systemctl is-system-running --wait || true")
            out.setdefault("system_state", state.strip())
            await asyncio.sleep(2)
            pss.append(pss_mib(be._vms[sid].vmm.pid))
            for _ in range(execs):
                t0 = time.perf_counter()
                await exec_ok(p.agent_socket)
                rtt.append(time.perf_counter() - t0)
            await be.pause(sid)
            t0 = time.perf_counter()
            await be.resume(sid)
            await exec_ok(p.agent_socket)
            resume.append(time.perf_counter() - t0)
            await be.destroy(sid, p)
            live.clear()
        out["create_to_first_exec"] = summary(create)
        out["exec_rtt"] = summary(rtt)
        out["resume_to_first_exec"] = summary(resume)
        out["idle_pss_mib"] = round(statistics.median(pss), 1)
        out["load_after"] = os.getloadavg()[0]
    finally:
        for s, sp in reversed(live):
            await be.destroy(s, sp)
        cgroups.remove(cgroups.detect(), "/" + parent)
        for d in (root, run_dir, mem):
            shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--execs", type=int, default=50)
    ap.add_argument("--memory-mb", type=int, default=512)
    a = ap.parse_args()
    res = asyncio.run(run(a.runs, a.execs, a.memory_mb))
    text = json.dumps(res, indent=2)
    print(text)
    out = Path(__file__).parent / "results" / "vm.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
