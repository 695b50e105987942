"""microVM benchmark (QEMU microvm, the accelerator the backend picks: TCG on this machine).

Drives :class:`MicrovmBackend` directly in a temp node (no apiserver hop) and measures:

* cold boot -> first ``exec("true")`` returns (create + one runtime call);
* restore -> first exec: ``resume()`` of a paused (snapshotted, VMM quit) sandbox + one exec,
  split into its phases (the manifest check, VMM start + state load + ``cont``, the agent
  channel's handshake, from the backend's "microvm resumed" log line; then the first exec);
* fork of 1 and of 10 children -> every child answered an exec (``fork_N_all_ready``), and
  beside it how long the ``fork()`` call itself took (``fork_N_call_returned``: every child
  restored and its agent channel handshaken, i.e. usable, before its first exec);
* the CPU time each restored QEMU used until its first exec returned (all its threads:
  mostly TCG translating the code the guest runs again), and under TCG how many blocks
  of guest code it translated by then (``info jit``), which load changes far less than
  the wall times (neither at all, the block counts); with ``--phase-blocks`` also how
  many of them by the time the guest ran again (``cont``) and by its multiplexer's READY
  (each count is a QMP call inside the agent phase: a few ms more there);
* host memory (PSS from ``/proc/<qemu>/smaps_rollup``) of the parent and of each child right
  after the fork, and the children's growth after each writes 32 MiB in its guest.

    .venv/bin/python -m bench.microvm [--runs 5] [--memory-mb 512] [--phase-blocks]

Prints JSON and writes ``bench/results/microvm.json``. TCG numbers are not KVM numbers: under
KVM the guest runs at native speed and boots several times faster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.foundation import summary
from dsec.agent.bundle import build_bundle
from dsec.core.ids import new_sandbox_id
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container import cgroups, testkit
from dsec.edge.backends.microvm import kernel
from dsec.edge.backends.microvm.backend import MicrovmBackend
from dsec.paths import Paths

MiB = 1 << 20


class Phases(logging.Handler):
    """Collects the phase fields of the backend's "microvm resumed" log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[dict[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "microvm resumed":
            fields = getattr(record, "fields", {})
            self.seen.append({k: v for k, v in fields.items() if k.endswith("_ms")})


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def cpu_ms(pid: int) -> float:
    """CPU time (user + system, all threads) process ``pid`` used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


async def tcg_blocks(be: MicrovmBackend, sid: str) -> int | None:
    """Blocks of guest code the sandbox's QEMU translated so far (None: not QEMU TCG)."""
    return await vm_tcg_blocks(be._vms[sid])


async def vm_tcg_blocks(vm: Any) -> int | None:
    qmp = getattr(vm.vmm, "_qmp", None)
    if qmp is None:
        return None
    out = await qmp.cmd("human-monitor-command", {"command-line": "info jit"})
    m = re.search(r"TB count\s+(\d+)", str(out))
    return int(m.group(1)) if m else None


def count_phase_blocks(be: MicrovmBackend) -> dict[str, tuple[int, int]]:
    """Wrap the backend's attach (agent mux start until READY): per sandbox, the blocks
    translated when it began (the guest runs again) and when READY came."""
    marks: dict[str, tuple[int, int]] = {}
    attach = be._attach

    async def counted(sandbox_id: str, vm: Any, *args: Any, **kw: Any) -> None:
        before = await vm_tcg_blocks(vm)
        await attach(sandbox_id, vm, *args, **kw)
        after = await vm_tcg_blocks(vm)
        if before is not None and after is not None:
            marks[sandbox_id] = (before, after)

    be._attach = counted  # type: ignore[method-assign]
    return marks


def split_blocks(
    marks: dict[str, tuple[int, int]], totals: dict[str, int]
) -> dict[str, float] | None:
    """Median blocks per phase: until the guest ran, until READY, until the first exec."""
    rows = [(*marks[s], n) for s, n in totals.items() if s in marks]
    if not rows:
        return None
    return {
        "until_cont": statistics.median(r[0] for r in rows),
        "handshake": statistics.median(r[1] - r[0] for r in rows),
        "first_exec": statistics.median(r[2] - r[1] for r in rows),
    }


def pss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Node:
    def __init__(self, root: Path, run: Path, mem: Path) -> None:
        self.paths = Paths(home=root / "home", data=root / "data", run=run)
        (run / "sbx").mkdir(parents=True, exist_ok=True)
        build_bundle(self.paths.agent_bundle)
        self.cgroup_parent = f"dsec-microvm-bench-{os.urandom(3).hex()}"
        self.backend = MicrovmBackend(
            self.paths,
            "e0b1",
            image_store=testkit.installed_store(),
            cgroup_parent=self.cgroup_parent,
            mem_dir=mem,
            kernel_image=kernel.current_kernel(Paths.from_env().data),
        )

    def sandbox(self) -> tuple[str, SandboxPaths]:
        sid = new_sandbox_id("e0b1", os.urandom(13))
        return sid, SandboxPaths(
            state_dir=self.backend.sandboxes_dir / sid,
            agent_socket=self.paths.run / "sbx" / f"{sid}.sock",
        )


async def exec_ok(sock: Path, cmd: str = "true", timeout: float = 120) -> None:
    res = await agent_client.call(sock, {"op": "exec", "cmd": cmd}, timeout=timeout)
    assert res.result.get("exit_code") == 0, (cmd, res.final, res.stderr)


async def run(
    runs: int, memory_mb: int, out: dict[str, Any], phase_blocks: bool = False
) -> dict[str, Any]:
    """Fills ``out`` as it goes (what was measured stays there if a later step fails)."""
    root = Path(tempfile.mkdtemp(prefix="dsec-vmbench-"))
    run_dir = Path(tempfile.mkdtemp(prefix="dvb", dir="/tmp"))
    mem = Path(tempfile.mkdtemp(prefix="dsec-vmbench-", dir="/dev/shm"))
    node = Node(root, run_dir, mem)
    be = node.backend
    spec = SandboxSpec(backend="microvm", memory_mb=memory_mb, cpu=1.0)
    out.update({
        "accel": (be.availability().reason),
        "memory_mb": memory_mb,
        "note": "TCG (no usable KVM here): these are not KVM figures",
    })  # fmt: skip
    live: list[tuple[str, SandboxPaths]] = []
    phases = Phases()
    vm_log = logging.getLogger("dsec.edge.backends.microvm.backend")
    vm_log.setLevel(logging.INFO)
    vm_log.addHandler(phases)
    loads = [loadavg()]
    marks = count_phase_blocks(be) if phase_blocks else None
    try:
        # Warm the shared images (erofs of the layers, bundle image, initramfs).
        sid, p = node.sandbox()
        live.append((sid, p))
        await be.create(sid, spec, p)
        await exec_ok(p.agent_socket)
        await be.destroy(sid, p)
        live.clear()

        cold: list[float] = []
        restore: list[float] = []
        pause: list[float] = []
        first_exec: list[float] = []
        restore_cpu: list[float] = []
        restore_tbs: list[int] = []
        restore_tb_of: dict[str, int] = {}
        for _ in range(runs):
            sid, p = node.sandbox()
            live.append((sid, p))
            t0 = time.perf_counter()
            await be.create(sid, spec, p)
            await exec_ok(p.agent_socket)
            cold.append(time.perf_counter() - t0)
            await exec_ok(p.agent_socket, "head -c 64M /dev/urandom > /dev/shm/fill")
            t0 = time.perf_counter()
            await be.pause(sid)
            pause.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await be.resume(sid)
            t1 = time.perf_counter()
            await exec_ok(p.agent_socket)
            restore.append(time.perf_counter() - t0)
            first_exec.append(time.perf_counter() - t1)
            restore_cpu.append(cpu_ms(be._vms[sid].vmm.pid))
            if (n := await tcg_blocks(be, sid)) is not None:
                restore_tbs.append(n)
                restore_tb_of[sid] = n
            loads.append(loadavg())
            await be.destroy(sid, p)
            live.clear()
        out["cold_boot_to_first_exec"] = summary(cold)
        out["pause_snapshot"] = summary(pause)
        out["restore_to_first_exec"] = summary(restore)
        out["cold_over_restore"] = round(statistics.median(cold) / statistics.median(restore), 1)
        out["restore_phases_p50_ms"] = {
            **{k: statistics.median(p[k] for p in phases.seen) for k in phases.seen[0]},
            "first_exec_ms": round(statistics.median(first_exec) * 1000, 1),
        }
        out["restore_to_first_exec_qemu_cpu_ms"] = statistics.median(restore_cpu)
        if restore_tbs:
            out["restore_to_first_exec_tcg_blocks"] = statistics.median(restore_tbs)
        if marks is not None and (split := split_blocks(marks, restore_tb_of)):
            out["restore_tcg_blocks_by_phase"] = split

        for count in (1, 10):
            samples: list[float] = []
            returned: list[float] = []
            child_cpu: list[float] = []
            child_tbs: list[int] = []
            child_tb_of: dict[str, int] = {}
            for _ in range(max(1, runs // 2)):
                sid, p = node.sandbox()
                live.append((sid, p))
                await be.create(sid, spec, p)
                await exec_ok(p.agent_socket, "head -c 64M /dev/urandom > /dev/shm/fill")
                kids = [node.sandbox() for _ in range(count)]
                live.extend(kids)
                t0 = time.perf_counter()
                await be.fork(sid, kids)
                returned.append(time.perf_counter() - t0)
                await asyncio.gather(*(exec_ok(kp.agent_socket) for _, kp in kids))
                samples.append(time.perf_counter() - t0)
                child_cpu += [cpu_ms(be._vms[k].vmm.pid) for k, _ in kids]
                for k, _ in kids:
                    if (n := await tcg_blocks(be, k)) is not None:
                        child_tbs.append(n)
                        child_tb_of[k] = n
                if count == 10 and "pss" not in out:
                    out["pss"] = await measure_pss(be, sid, kids)
                for s, sp in reversed(live):
                    await be.destroy(s, sp)
                live.clear()
            out[f"fork_{count}_all_ready"] = summary(samples)
            out[f"fork_{count}_call_returned"] = summary(returned)
            out[f"fork_{count}_child_qemu_cpu_ms"] = statistics.median(child_cpu)
            if child_tbs:
                out[f"fork_{count}_child_tcg_blocks"] = statistics.median(child_tbs)
            if marks is not None and (split := split_blocks(marks, child_tb_of)):
                out[f"fork_{count}_child_tcg_blocks_by_phase"] = split
            loads.append(loadavg())
        one = out["fork_1_all_ready"]["p50_ms"]
        ten = out["fork_10_all_ready"]["p50_ms"]
        out["fork_10_over_fork_1"] = round(ten / one, 2)
        # the same ratio for the fork() call alone (children usable, none has run an exec)
        out["fork_10_over_fork_1_call_returned"] = round(
            out["fork_10_call_returned"]["p50_ms"] / out["fork_1_call_returned"]["p50_ms"], 2
        )
        out["loadavg_1min"] = {"min": min(loads), "median": statistics.median(loads),
                               "max": max(loads)}  # fmt: skip
    finally:
        vm_log.removeHandler(phases)
        for s, sp in reversed(live):
            await be.destroy(s, sp)
        cgroups.remove(cgroups.detect(), "/" + node.cgroup_parent)
        for d in (root, run_dir, mem):
            shutil.rmtree(d, ignore_errors=True)
    return out


async def measure_pss(
    be: MicrovmBackend, parent: str, kids: list[tuple[str, SandboxPaths]]
) -> dict[str, Any]:
    await asyncio.sleep(1)
    parent_pss = pss_mib(be._vms[parent].vmm.pid)
    child = [pss_mib(be._vms[k].vmm.pid) for k, _ in kids]
    await asyncio.gather(
        *(
            exec_ok(kp.agent_socket, "head -c 32M /dev/zero | tr '\\0' x > /dev/shm/w", 900)
            for _, kp in kids
        )
    )
    after = [pss_mib(be._vms[k].vmm.pid) for k, _ in kids]
    return {
        "parent_mib": round(parent_pss, 1),
        "children_mib": [round(c, 1) for c in child],
        "child_median_mib": round(statistics.median(child), 1),
        "children_after_32mib_write_median_mib": round(statistics.median(after), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--phase-blocks", action="store_true", help="TCG blocks per restore phase")
    ap.add_argument("--out", default="microvm.json", help="file name under bench/results")
    a = ap.parse_args()
    res: dict[str, Any] = {}
    try:
        asyncio.run(run(a.runs, a.memory_mb, res, a.phase_blocks))
    except BaseException as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"  # the figures before it still count
        raise
    finally:
        text = json.dumps(res, indent=2)
        print(text)
        out = Path(__file__).parent / "results" / a.out
        out.parent.mkdir(exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
