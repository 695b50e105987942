"""What the microVM and full-VM integration tests share.

A throw-away node for one VM backend (temporary home, run and memory directories, a cgroup
parent of its own, removed after with a check that no sandbox cgroup was left), why the
QEMU microVM tests cannot run here, and small helpers that talk to a guest or look for its
QEMU processes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from dsec.agent.bundle import build_bundle
from dsec.core.ids import new_sandbox_id
from dsec.edge import agent_client
from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container import cgroups, testkit
from dsec.edge.backends.microvm import kernel, qemu
from dsec.edge.backends.microvm.backend import MicrovmBackend
from dsec.edge.images.base import BASE_IMAGE
from dsec.paths import Paths

B = TypeVar("B", bound=MicrovmBackend)


def node_skip_reason() -> str | None:
    """Why a microVM backend's node cannot be made here (cgroups, erofs image layers)."""
    if os.geteuid() != 0:
        return "needs root (cgroups)"
    if shutil.which("mkfs.erofs") is None:
        return "needs mkfs.erofs (apt-get install erofs-utils)"
    if not testkit.installed_store().has(BASE_IMAGE) and testkit.base_tar() is None:
        return "the base image is not built (run `dsec setup`)"
    return None


def microvm_skip_reason() -> str | None:
    """Why QEMU microVMs with the guest kernel `dsec setup` built cannot run here."""
    why = node_skip_reason() or qemu.available()
    if why:
        return why
    if kernel.current_kernel(Paths.from_env().data) is None:
        return "no guest kernel: run `dsec setup` (builds it from linux-source-6.1)"
    return None


@dataclass
class Node:
    """Temporary directories and a private cgroup parent for one VM backend."""

    root: Path
    paths: Paths
    mem: Path
    cgroup_parent: str

    def microvm(self, edge_id: str, **kwargs: Any) -> MicrovmBackend:
        """A microVM backend on this node, its images from the shared ``base`` store."""
        return MicrovmBackend(
            self.paths,
            edge_id,
            image_store=testkit.shared_base_store(),
            cgroup_parent=self.cgroup_parent,
            mem_dir=self.mem,
            **kwargs,
        )


@contextmanager
def node(
    prefix: str, run_prefix: str, *, data: Path | None = None, check_cgroups: bool = True
) -> Iterator[Node]:
    """A :class:`Node` (with its own agent bundle unless ``data`` is given), removed after;
    with ``check_cgroups`` a sandbox cgroup left under its parent fails the caller."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    run = Path(tempfile.mkdtemp(prefix=run_prefix, dir="/tmp"))  # unix socket paths: short
    mem = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    paths = Paths(home=root / "home", data=data or root / "data", run=run)
    (run / "sbx").mkdir()
    if data is None:
        build_bundle(paths.agent_bundle)
    parent = f"dsectest-{os.urandom(4).hex()}"
    try:
        yield Node(root, paths, mem, parent)
    finally:
        left = cgroups.list_children(cgroups.detect(), parent)
        cgroups.remove(cgroups.detect(), "/" + parent)
        for d in (root, run, mem):
            shutil.rmtree(d, ignore_errors=True)
    assert not (check_cgroups and left), f"cgroups left: {left}"


@dataclass
class Env(Generic[B]):
    """A VM backend on a :class:`Node`, and fresh sandbox ids and paths for it."""

    paths: Paths
    backend: B
    cgroup_parent: str
    edge_id: str

    def sandbox(self) -> tuple[str, SandboxPaths]:
        sid = new_sandbox_id(self.edge_id, os.urandom(13))
        return sid, SandboxPaths(
            state_dir=self.backend.sandboxes_dir / sid,
            agent_socket=self.paths.run / "sbx" / f"{sid}.sock",
        )


async def sh(sock: Path, cmd: str, timeout: float = 30) -> str:
    """Run ``cmd`` in the guest; its stdout (it must exit 0)."""
    res = await agent_client.call(sock, {"op": "exec", "cmd": cmd}, timeout=timeout)
    out = res.result
    assert out.get("exit_code") == 0, (cmd, out, res.stdout, res.stderr)
    return res.stdout.decode()


def qemu_pids_under(path: Path) -> list[int]:
    """QEMU processes whose command line names ``path`` (only ours)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if qemu.QEMU in cmd and str(path) in cmd:
                out.append(int(p.name))
    return out
