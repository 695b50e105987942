"""Find what a sandbox left on the host: mounts, cgroups, crun state, socket, state dir.

Used by tests after destroy() and by ``dsec doctor``. Everything here only reads.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container import cgroups, mounts


def _ns_mountinfo(ns_file: Path) -> list[mounts.MountEntry]:
    if not mounts.mounts_at(ns_file):
        return []
    try:
        proc = subprocess.run(
            ["nsenter", f"--mount={ns_file}", "--", "cat", "/proc/self/mountinfo"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return mounts.parse_mountinfo(proc.stdout) if proc.returncode == 0 else []


def find_leaks(
    sandbox_id: str,
    paths: SandboxPaths | None,
    *,
    layout: cgroups.CgroupLayout,
    cgroup_path: str,
    crun_root: Path,
    ns_file: Path | None = None,
) -> list[str]:
    """Describe every leftover of ``sandbox_id``; an empty list means it is gone.

    Without ``paths`` the mount check matches mount points naming the sandbox id, and
    the socket and state dir are not checked.
    """
    out: list[str] = []
    tables = [("host", mounts.read_mountinfo())]
    if ns_file is not None:
        tables.append(("crun namespace", _ns_mountinfo(ns_file)))
    for where, table in tables:
        for m in table:
            hit = sandbox_id in m.mount_point
            if paths is not None:
                sd = os.fspath(paths.state_dir)
                hit = hit or m.mount_point == sd or m.mount_point.startswith(sd + "/")
            if hit:
                out.append(f"mount ({where}): {m.fstype} at {m.mount_point}")
    out.extend(f"cgroup: {d}" for d in cgroups.sandbox_cgroups(layout, cgroup_path))
    if (crun_root / sandbox_id).exists():
        out.append(f"crun state: {crun_root / sandbox_id}")
    if paths is not None:
        if paths.agent_socket.exists() or paths.agent_socket.is_symlink():
            out.append(f"socket: {paths.agent_socket}")
        if paths.state_dir.exists():
            out.append(f"state dir: {paths.state_dir}")
    return out
