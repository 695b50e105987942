"""What starting a QEMU costs before it does anything: the full build beside the KVM-only
microvm build the driver uses under KVM (``qemu.QEMU_KVM_MICROVM``).

Each binary runs ``-version`` (exec, dynamic linking, library and QOM set-up, no machine)
``--runs`` times, alternating; the wall time and the CPU time (user + system of the child)
of each run are taken. Every restored microVM and every fork child pays this once. KVM cannot
run guests here, so the start of a whole microvm machine cannot be compared: this is the
part of it that differs between the two builds.

    .venv/bin/python -m bench.qemu_start [--runs 40]

Prints JSON and writes ``bench/results/qemu_start.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from bench.foundation import summary
from dsec.edge.backends.microvm import qemu


def one(binary: str) -> tuple[float, float]:
    """Wall and CPU seconds of one ``binary -version``."""
    before, t0 = os.times(), time.perf_counter()
    subprocess.run([binary, "-version"], stdout=subprocess.DEVNULL, check=True)
    wall, after = time.perf_counter() - t0, os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--out", default="bench/results/qemu_start.json")
    args = ap.parse_args()
    binaries = [b for b in (qemu.QEMU, qemu.QEMU_KVM_MICROVM) if shutil.which(b)]
    walls: dict[str, list[float]] = {b: [] for b in binaries}
    cpus: dict[str, list[float]] = {b: [] for b in binaries}
    for _ in range(args.runs):
        for b in binaries:
            wall, cpu = one(b)
            walls[b].append(wall)
            cpus[b].append(cpu)
    out: dict[str, object] = {
        b: {
            "wall": summary(walls[b]),
            "cpu_ms_mean": round(statistics.fmean(cpus[b]) * 1000, 2),  # (ticks: a mean)
            "shared_libraries": len(
                subprocess.run(["ldd", shutil.which(b) or b], capture_output=True, text=True)
                .stdout.strip()
                .splitlines()
            ),
        }
        for b in binaries
    }
    out["loadavg_1min"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
