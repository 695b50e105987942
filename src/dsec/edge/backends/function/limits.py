"""The cgroups of function workers: one per worker, reused, limits written per call.

Each worker gets ``<parent>/w<n>`` in the memory, pids and cpu hierarchies (v1, hybrid or
v2, as :mod:`dsec.edge.backends.container.cgroups` detects them); each call's child is
born in it. The pool writes the call's limits just before it hands the call over (only
those that differ from what the cgroup already has: back-to-back calls of one sandbox
write nothing); once a worker has exited and its cgroup is empty the cgroup serves the
next worker, so starting a worker costs no mkdir/rmdir.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from dsec.edge.backends.container import cgroups

CONTROLLERS = ("memory", "pids", "cpu")


class WorkerCgroups:
    def __init__(self, layout: cgroups.CgroupLayout, parent: str) -> None:
        self.layout = layout
        self.parent = "/" + parent.strip("/")
        self._limits: dict[str, tuple[int, float, int]] = {}  # cgroup -> limits it holds

    def dirs(self, rel: str) -> list[Path]:
        out: list[Path] = []
        for ctl in CONTROLLERS:
            d = self.layout.controller_dir(ctl, rel)
            if d is not None and d not in out:
                out.append(d)
        return out

    def make(self, name: str) -> str:
        """Create ``<parent>/<name>`` in every hierarchy; return its path."""
        rel = f"{self.parent}/{name}"
        for d in self.dirs(rel):
            if self.layout.mode is cgroups.CgroupMode.V2:
                _enable_v2(self.layout.root, d)
            d.mkdir(parents=True, exist_ok=True)
        return rel

    def place(self, rel: str, pid: int) -> None:
        for d in self.dirs(rel):
            _write(d / "cgroup.procs", str(pid))

    def is_empty(self, rel: str) -> bool:
        return not any(_has_procs(d) for d in self.dirs(rel))

    def oom_file(self, rel: str) -> str:
        """The file whose ``oom_kill`` line counts the cgroup's OOM kills."""
        d = self.layout.controller_dir("memory", rel)
        if d is None:
            return ""
        return str(d / ("memory.oom_control" if "memory" in self.layout.v1 else "memory.events"))

    def set_limits(self, rel: str, memory_mb: int, cpu: float, pids: int) -> None:
        if self._limits.get(rel) == (memory_mb, cpu, pids):
            return
        self._limits.pop(rel, None)  # unknown until every write below succeeded
        mem = self.layout.controller_dir("memory", rel)
        if mem is not None:
            limit = str(memory_mb * 1024 * 1024)
            if "memory" in self.layout.v1:
                # v1 wants memory <= memory+swap at every step, and a reused cgroup may hold
                # a lower limit from its last call: lift memsw first, then set both.
                _write(mem / "memory.memsw.limit_in_bytes", "-1", optional=True)
                _write(mem / "memory.limit_in_bytes", limit)
                _write(mem / "memory.memsw.limit_in_bytes", limit, optional=True)
            else:
                _write(mem / "memory.max", limit)
                _write(mem / "memory.swap.max", "0", optional=True)
        pd = self.layout.controller_dir("pids", rel)
        if pd is not None:
            _write(pd / "pids.max", str(pids))
        cd = self.layout.controller_dir("cpu", rel)
        if cd is not None:
            quota = max(1000, int(cpu * 100_000))
            if "cpu" in self.layout.v1:
                _write(cd / "cpu.cfs_period_us", "100000", optional=True)
                _write(cd / "cpu.cfs_quota_us", str(quota), optional=True)
            else:
                _write(cd / "cpu.max", f"{quota} 100000", optional=True)
        self._limits[rel] = (memory_mb, cpu, pids)

    def remove(self, rel: str) -> list[Path]:
        """Kill what is left in it and remove it; return what could not be removed."""
        self._limits.pop(rel, None)
        return cgroups.remove(self.layout, rel)

    def remove_stale(self) -> None:
        """Workers of an earlier pool that died without cleaning up (killed with -9)."""
        for d in cgroups.list_children(self.layout, self.parent):
            cgroups.remove(self.layout, f"{self.parent}/{d.name}")

    def remove_parent(self) -> None:
        cgroups.remove_if_empty(self.layout, self.parent)


def _has_procs(d: Path) -> bool:
    try:
        return bool((d / "cgroup.procs").read_text().strip())
    except OSError:
        return False


def _enable_v2(root: Path, d: Path) -> None:
    """Enable memory, pids and cpu for the children of every ancestor of ``d`` (v2)."""
    parent = root
    for part in d.relative_to(root).parts[:-1]:
        with contextlib.suppress(OSError):
            (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        parent = parent / part
        parent.mkdir(exist_ok=True)
    with contextlib.suppress(OSError):
        (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")


def _write(path: Path, value: str, *, optional: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError:
        if not optional:
            raise
