"""Which guest code a restored (or forked) microVM translates again before its first exec.

Under TCG a restored QEMU starts with an empty translation cache: every block of guest code
the guest runs after the restore is translated again, and that is most of the restore's
CPU. This runs one sandbox like ``bench.microvm`` (create, fill /dev/shm, pause), then a
resume and a fork of one child, each QEMU started with ``-d in_asm`` (every block it
translates, in order, to a log of its own), and counts the blocks of each phase (until the
agent channel's READY; READY until the first ``exec("true")`` answered) by where their
code lives: guest kernel functions (the symbols of the kernel the VM booted) and user space
files (by path: the executable mappings of the guest's processes, read from ``/proc/*/maps``
in the guest afterwards; the guest runs with ``norandmaps`` under TCG, so addresses
repeat; two processes with code at one address are counted under both names, ``a|b``).

    .venv/bin/python -m bench.microvm_trace [--top 40] [--out microvm-trace.json]

Logging slows the QEMU down several times: only the block counts mean something here, not
the times.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.microvm import Node, exec_ok, tcg_blocks
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.microvm import qemu

MAPS_CMD = 'for p in /proc/[0-9]*; do echo "== $p"; cat $p/maps; done 2>/dev/null'
KERNEL_BASE = 0xFFFF800000000000


def traced_argv(log_dir: Path) -> None:
    """Every QEMU started for a restore logs the blocks it translates to its own file."""
    argv = qemu.QemuVmm.argv

    def with_log(self: qemu.QemuVmm, c: Any, **kw: Any) -> list[str]:
        out = argv(self, c, **kw)
        if kw.get("incoming"):
            out += ["-d", "in_asm", "-D", str(log_dir / "tb-%d.log")]
        return out

    qemu.QemuVmm.argv = with_log  # type: ignore[method-assign]


def block_addresses(log: Path) -> list[int]:
    """The guest address of each translated block, in translation order."""
    out: list[int] = []
    want = False
    with log.open(errors="replace") as f:
        for line in f:
            if line.startswith("IN:"):
                want = True
            elif want and (m := re.match(r"0x([0-9a-f]+):", line)):
                out.append(int(m.group(1), 16))
                want = False
    return out


def kernel_functions(vmlinux: Path) -> list[tuple[int, str]]:
    """``(address, name)`` of the kernel image's code symbols, by address."""
    nm = subprocess.run(["nm", "-n", str(vmlinux)], capture_output=True, text=True, check=True)
    syms = [ln.split() for ln in nm.stdout.splitlines()]
    return sorted((int(s[0], 16), s[2]) for s in syms if len(s) == 3 and s[1] in "tTwW")


class Where:
    """Names an address: a kernel function or the file of a user mapping."""

    def __init__(self, ksyms: list[tuple[int, str]], maps: str) -> None:
        self.ksyms = ksyms
        self.kaddrs = [a for a, _ in ksyms]
        self.user: list[tuple[int, int, str]] = []
        for line in maps.splitlines():
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)", line)
            if m and "x" in m.group(3):
                name = m.group(4).strip() or "anon"
                self.user.append((int(m.group(1), 16), int(m.group(2), 16), name))

    def kernel(self, addr: int) -> str:
        i = bisect.bisect_right(self.kaddrs, addr) - 1
        return self.ksyms[i][1] if i >= 0 else "?"

    def user_file(self, addr: int) -> str:
        return "|".join(sorted({n for s, e, n in self.user if s <= addr < e})) or "?"


def classify(blocks: list[int], where: Where, top: int) -> dict[str, Any]:
    kernel: collections.Counter[str] = collections.Counter()
    user: collections.Counter[str] = collections.Counter()
    for a in blocks:
        if a >= KERNEL_BASE:
            kernel[where.kernel(a)] += 1
        else:
            user[where.user_file(a)] += 1
    return {
        "blocks": len(blocks),
        "kernel": sum(kernel.values()),
        "user": sum(user.values()),
        "user_by_file": dict(user.most_common()),
        "kernel_top_functions": dict(kernel.most_common(top)),
    }


async def first_exec(be: Any, sid: str, sock: Path) -> tuple[int, int, int]:
    """QEMU's pid, its blocks at READY (the restore returned) and after the first exec."""
    ready = await tcg_blocks(be, sid)
    await exec_ok(sock)
    done = await tcg_blocks(be, sid)
    if ready is None or done is None:
        raise SystemExit("not QEMU under TCG: nothing to trace")
    return be._vms[sid].vmm.pid, ready, done


async def run(top: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="dsec-vmtrace-"))
    run_dir = Path(tempfile.mkdtemp(prefix="dvt", dir="/tmp"))
    mem = Path(tempfile.mkdtemp(prefix="dsec-vmtrace-", dir="/dev/shm"))
    logs = Path(tempfile.mkdtemp(prefix="dsec-vmtrace-logs-"))
    traced_argv(logs)
    node = Node(root, run_dir, mem)
    be = node.backend
    spec = SandboxSpec(backend="microvm", memory_mb=512, cpu=1.0)
    live = []
    marks: dict[str, tuple[int, int, int]] = {}
    try:
        sid, p = node.sandbox()
        live.append((sid, p))
        await be.create(sid, spec, p)
        await exec_ok(p.agent_socket)
        await exec_ok(p.agent_socket, "head -c 64M /dev/urandom > /dev/shm/fill")
        await be.pause(sid)
        await be.resume(sid)
        marks["restore"] = await first_exec(be, sid, p.agent_socket)
        res = await agent_client.call(p.agent_socket, {"op": "exec", "cmd": MAPS_CMD})
        maps = res.stdout.decode(errors="replace")
        kid, kp = node.sandbox()
        live.append((kid, kp))
        await be.fork(sid, [(kid, kp)])
        marks["fork_child"] = await first_exec(be, kid, kp.agent_socket)
        if be.kernel_image is None:
            raise SystemExit("no guest kernel built (dsec setup)")
        where = Where(kernel_functions(be.kernel_image), maps)
        out: dict[str, Any] = {}
        for name, (pid, ready, done) in marks.items():
            blocks = block_addresses(logs / f"tb-{pid}.log")
            out[name] = {
                "info_jit_blocks": {"ready": ready, "first_exec_done": done},
                "until_ready": classify(blocks[:ready], where, top),
                "first_exec": classify(blocks[ready:done], where, top),
            }
        return out
    finally:
        for s, sp in reversed(live):
            await be.destroy(s, sp)
        cgroups.remove(cgroups.detect(), "/" + node.cgroup_parent)
        for d in (root, run_dir, mem, logs):
            shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=40, help="kernel functions listed per phase")
    ap.add_argument("--out", default="microvm-trace.json", help="file name under bench/results")
    a = ap.parse_args()
    res = asyncio.run(run(a.top))
    text = json.dumps(res, indent=2)
    print(text)
    out = Path(__file__).parent / "results" / a.out
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
