"""The host's cgroup layout (v1, hybrid or v2) and a sandbox cgroup's usage and cleanup.

crun creates and removes the sandbox cgroups; this module only looks at them: which mode
the host runs (crun 1.8 refuses to run on a hybrid host whose cgroup2 ``unified`` mount
holds controllers), how much memory, CPU and pids a sandbox uses, and which cgroups are
left behind. Detection reads the tree under ``/sys/fs/cgroup`` only, so unit tests can
point it at a fake tree::

    v2       <root>/cgroup.controllers
    v1       <root>/<ctrl[,ctrl]>/cgroup.procs  (and symlinks such as cpu -> cpu,cpuacct)
    hybrid   v1 hierarchies plus <root>/unified/cgroup.controllers
"""

from __future__ import annotations

import enum
import errno
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dsec.core.errors import BackendUnavailable

DEFAULT_ROOT = Path("/sys/fs/cgroup")


class CgroupMode(enum.Enum):
    V1 = "v1"
    HYBRID = "hybrid"
    V2 = "v2"


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """Where the cgroup hierarchies of this host are mounted."""

    mode: CgroupMode
    root: Path
    v1: Mapping[str, Path] = field(default_factory=dict)  # controller -> hierarchy dir
    unified: Path | None = None  # the cgroup2 mount (v2: root; hybrid: root/unified)
    unified_controllers: tuple[str, ...] = ()

    @property
    def crun_needs_private_ns(self) -> bool:
        """crun 1.8 refuses hybrid hosts whose cgroup2 mount holds controllers."""
        return self.mode is CgroupMode.HYBRID and bool(self.unified_controllers)

    def hierarchies(self) -> tuple[Path, ...]:
        """Every distinct hierarchy directory (v1 ones first, then cgroup2)."""
        seen: dict[str, Path] = {}
        for p in self.v1.values():
            seen.setdefault(os.path.realpath(p), p)
        out = list(seen.values())
        if self.unified is not None:
            out.append(self.unified)
        return tuple(out)

    def controller_dir(self, controller: str, cgroup_path: str) -> Path | None:
        """Directory of ``cgroup_path`` in the hierarchy that holds ``controller``."""
        rel = cgroup_path.strip("/")
        if controller in self.v1:
            return self.v1[controller] / rel
        if self.unified is not None and (
            controller in self.unified_controllers or self.mode is CgroupMode.V2
        ):
            return self.unified / rel
        return None

    def describe(self) -> str:
        extra = ""
        if self.mode is CgroupMode.HYBRID:
            ctl = ",".join(self.unified_controllers) or "none"
            extra = f", unified controllers: {ctl}"
        return f"cgroup mode {self.mode.value}{extra}"


def detect(root: Path = DEFAULT_ROOT) -> CgroupLayout:
    """Detect the cgroup mode from the tree under ``root``.

    Raises:
        BackendUnavailable: no cgroup hierarchy is mounted there.
    """
    if (root / "cgroup.controllers").is_file():
        return CgroupLayout(
            mode=CgroupMode.V2,
            root=root,
            unified=root,
            unified_controllers=_read_words(root / "cgroup.controllers"),
        )
    v1: dict[str, Path] = {}
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise BackendUnavailable(f"cannot read the cgroup tree at {root}: {exc}") from None
    for name in names:
        d = root / name
        if name == "unified" or not (d / "cgroup.procs").is_file():
            continue
        for ctl in name.split(","):
            v1.setdefault(ctl, d)
    unified = root / "unified"
    if (unified / "cgroup.controllers").is_file():
        return CgroupLayout(
            mode=CgroupMode.HYBRID,
            root=root,
            v1=v1,
            unified=unified,
            unified_controllers=_read_words(unified / "cgroup.controllers"),
        )
    if not v1:
        raise BackendUnavailable(f"no cgroup hierarchy is mounted under {root}")
    return CgroupLayout(mode=CgroupMode.V1, root=root, v1=v1)


def _read_words(path: Path) -> tuple[str, ...]:
    try:
        return tuple(path.read_text().split())
    except OSError:
        return ()


def _read_int(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_keyed(path: Path | None) -> dict[str, int]:
    """Parse ``key value`` lines (memory.stat, cpu.stat, memory.events ...)."""
    out: dict[str, int] = {}
    if path is None:
        return out
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _file(d: Path | None, name: str) -> Path | None:
    return None if d is None else d / name


def read_usage(layout: CgroupLayout, cgroup_path: str) -> dict[str, float]:
    """Return live usage of one cgroup, best effort (missing files are left out).

    Keys: ``memory_bytes`` (usage minus inactive page cache, like ``docker stats``),
    ``memory_limit_bytes``, ``memory_failcnt`` (v1), ``oom_kills``, ``cpu_seconds``,
    ``cpu_throttled_periods``, ``cpu_throttled_seconds``, ``pids``, ``pids_limit_hits``.
    """
    out: dict[str, float] = {}
    v2 = layout.mode is CgroupMode.V2
    mem = layout.controller_dir("memory", cgroup_path)
    if mem is not None and "memory" in layout.v1:
        usage = _read_int(_file(mem, "memory.usage_in_bytes"))
        stat = _read_keyed(_file(mem, "memory.stat"))
        if usage is not None:
            out["memory_bytes"] = float(max(0, usage - stat.get("total_inactive_file", 0)))
        limit = _read_int(_file(mem, "memory.limit_in_bytes"))
        if limit is not None:
            out["memory_limit_bytes"] = float(limit)
        failcnt = _read_int(_file(mem, "memory.failcnt"))
        if failcnt is not None:
            out["memory_failcnt"] = float(failcnt)
        oom = _read_keyed(_file(mem, "memory.oom_control"))
        if "oom_kill" in oom:
            out["oom_kills"] = float(oom["oom_kill"])
    elif mem is not None:
        usage = _read_int(_file(mem, "memory.current"))
        stat = _read_keyed(_file(mem, "memory.stat"))
        if usage is not None:
            out["memory_bytes"] = float(max(0, usage - stat.get("inactive_file", 0)))
        limit = _read_int(_file(mem, "memory.max"))
        if limit is not None:
            out["memory_limit_bytes"] = float(limit)
        events = _read_keyed(_file(mem, "memory.events"))
        if "oom_kill" in events:
            out["oom_kills"] = float(events["oom_kill"])
    cpu = layout.controller_dir("cpu", cgroup_path)
    if not v2 and "cpu" in layout.v1:
        acct = layout.controller_dir("cpuacct", cgroup_path)
        ns = _read_int(_file(acct, "cpuacct.usage"))
        if ns is not None:
            out["cpu_seconds"] = ns / 1e9
        st = _read_keyed(_file(cpu, "cpu.stat"))
        if "nr_throttled" in st:
            out["cpu_throttled_periods"] = float(st["nr_throttled"])
            out["cpu_throttled_seconds"] = st.get("throttled_time", 0) / 1e9
    elif cpu is not None:
        st = _read_keyed(_file(cpu, "cpu.stat"))
        if "usage_usec" in st:
            out["cpu_seconds"] = st["usage_usec"] / 1e6
        if "nr_throttled" in st:
            out["cpu_throttled_periods"] = float(st["nr_throttled"])
            out["cpu_throttled_seconds"] = st.get("throttled_usec", 0) / 1e6
    pids = layout.controller_dir("pids", cgroup_path)
    current = _read_int(_file(pids, "pids.current"))
    if current is not None:
        out["pids"] = float(current)
    events = _read_keyed(_file(pids, "pids.events"))
    if "max" in events:
        out["pids_limit_hits"] = float(events["max"])
    return out


def sandbox_cgroups(layout: CgroupLayout, cgroup_path: str) -> list[Path]:
    """Return the directories of ``cgroup_path`` that exist, in every hierarchy."""
    rel = cgroup_path.strip("/")
    return [h / rel for h in layout.hierarchies() if (h / rel).is_dir()]


def list_children(layout: CgroupLayout, parent: str) -> list[Path]:
    """Return every cgroup directly under ``parent``, in every hierarchy (for leak checks)."""
    out: list[Path] = []
    rel = parent.strip("/")
    for h in layout.hierarchies():
        try:
            entries = sorted(os.scandir(h / rel), key=lambda e: e.name)
        except OSError:
            continue
        out.extend(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))
    return out


def thaw(layout: CgroupLayout, cgroup_path: str) -> bool:
    """Thaw a frozen (paused) sandbox cgroup; frozen tasks cannot die. Blocking.

    Returns:
        True if it was frozen.
    """
    was_frozen = False
    for d in sandbox_cgroups(layout, cgroup_path):
        for name, frozen, thawed in (
            ("freezer.state", "FROZEN", "THAWED"),
            ("cgroup.freeze", "1", "0"),
        ):
            f = d / name
            try:
                if f.read_text().strip() != thawed:
                    was_frozen = was_frozen or f.read_text().strip() == frozen
                    f.write_text(thawed)
            except OSError:
                continue
    return was_frozen


def _procs(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def remove_if_empty(layout: CgroupLayout, cgroup_path: str) -> bool:
    """Remove a parent cgroup from every hierarchy if nothing is in it; never kills.

    rmdir(2) of a cgroup fails while it has child cgroups or tasks, so another edge's
    sandboxes under the same parent are never touched. Returns whether it is gone.
    """
    gone = True
    for d in sandbox_cgroups(layout, cgroup_path):
        try:
            os.rmdir(d)
        except OSError:
            gone = False
    return gone


def remove(layout: CgroupLayout, cgroup_path: str, *, timeout: float = 5.0) -> list[Path]:
    """Kill what is left in a sandbox cgroup and remove it from every hierarchy.

    This is the fallback for a container crun no longer knows: every process in these
    cgroups belongs to the sandbox, so it is killed by pid (a frozen cgroup is thawed
    first, or the kill would wait). Blocking; call it in a thread.

    Returns:
        The directories that could not be removed.
    """
    dirs = sandbox_cgroups(layout, cgroup_path)
    thaw(layout, cgroup_path)
    left: list[Path] = []
    for d in dirs:
        # Children first (nothing in a sandbox can create them, but be thorough).
        subdirs = sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        left.extend(sub for sub in [*subdirs, d] if not _rmdir_cgroup(sub, timeout))
    return left


def _rmdir_cgroup(d: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        for pid in _procs(d):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        time.sleep(0.01)
