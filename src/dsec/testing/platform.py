"""Start the real platform (iam, watcher, edge, apiserver, gateway) in a throwaway home.

Used by the end-to-end tests and the benchmarks. Shared artefacts (the agent bundle, the
images) come from ``DSEC_DATA`` (what ``dsec setup`` built); everything else - PKI,
databases, sockets, sandboxes - lives under a short temp directory that is removed after
the platform and all its sandboxes are stopped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dsec.core.errors import DsecError
from dsec.paths import Paths
from dsec.supervisor import EDGE_ARGS_ENV, PORTS, Layout, healthy, layout_path
from dsec.testing.ports import free_port_base


def requirements_missing() -> str | None:
    """Why the real platform cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (crun, overlayfs mounts, cgroups)"
    if shutil.which("crun") is None:
        return "crun is not installed (run scripts/install)"
    data = Paths.from_env().data
    if not (data / "images" / "refs" / "base.json").exists():
        return f"the base image is not built in {data} (run scripts/install)"
    if not (data / "agent" / "init").exists():
        return f"the agent bundle is not built in {data} (run scripts/install)"
    return None


@dataclass
class RunningPlatform:
    paths: Paths
    layout: Layout
    api_url: str
    admin_key: str
    process: subprocess.Popen[bytes]
    cgroup_parent: str = ""
    # After the platform stopped (not with keep_sandboxes): the edge's cgroups it left
    # behind, which were then removed (the name is this platform's own).
    cgroups_left: list[str] = field(default_factory=list)

    def sandbox_pids(self, sandbox_id: str) -> list[int]:
        """The processes in a sandbox's cgroup (under this platform's own cgroup parent)."""
        for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
            procs = base / self.cgroup_parent / sandbox_id / "cgroup.procs"
            if procs.exists():
                return sorted(int(x) for x in procs.read_text().split())
        return []

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "DSEC_API_URL": self.api_url,
            "DSEC_API_KEY": self.admin_key,
            "DSEC_HOME": str(self.paths.home),
        }

    def pid(self, component: str) -> int:
        return Layout.load(layout_path(self.paths)).pids[component]

    def wait_component(self, component: str, *, not_pid: int = 0, timeout: float = 60) -> int:
        """Wait until ``component`` is healthy (and, if given, runs under a new pid)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lay = Layout.load(layout_path(self.paths))
            pid = lay.pids.get(component, 0)
            if pid and pid != not_pid and healthy(lay.health_url(component)):
                return pid
            time.sleep(0.05)
        raise TimeoutError(f"{component} did not come back within {timeout} s")


@contextlib.contextmanager
def running_platform(
    *, keep_sandboxes: bool = False, edge_args: Sequence[str] = ()
) -> Iterator[RunningPlatform]:
    top = Path(tempfile.mkdtemp(prefix="dsec-", dir="/tmp"))
    paths = Paths(home=top / "home", data=Paths.from_env().data, run=top / "run")
    paths.home.mkdir()
    paths.logs.mkdir()
    base = free_port_base(PORTS)
    cgroup_parent = f"dsectest-{os.urandom(4).hex()}"  # its own: checked and removed after
    edge_args = ["--cgroup-parent", cgroup_parent, *edge_args]
    argv = [sys.executable, "-m", "dsec.supervisor", str(paths.home), str(base)]
    if keep_sandboxes:
        argv.append("--keep-sandboxes")
    env = {
        **os.environ,
        "DSEC_HOME": str(paths.home),
        "DSEC_RUN": str(paths.run),
        "DSEC_DATA": str(paths.data),
        EDGE_ARGS_ENV: "\n".join(edge_args),
    }
    with open(paths.logs / "supervisor.log", "ab") as logf:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            env=env,
            start_new_session=True,
        )
    running: RunningPlatform | None = None
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError("platform failed to start:\n" + _logs(paths))
            if paths.supervisor_pid.exists():
                break
            if time.monotonic() > deadline:
                raise RuntimeError("platform did not start within 120 s:\n" + _logs(paths))
            time.sleep(0.05)
        lay = Layout.load(layout_path(paths))
        key = (paths.home / "admin.key").read_text().strip()
        running = RunningPlatform(paths, lay, f"http://{lay.apiserver}", key, proc, cgroup_parent)
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if not keep_sandboxes:
            left = _remove_cgroups(cgroup_parent)
            if running is not None:
                running.cgroups_left = left
        shutil.rmtree(top, ignore_errors=True)


def _remove_cgroups(parent: str) -> list[str]:
    """The edge's cgroup parent where it is left (then removed: the name is ours alone)."""
    from dsec.edge.backends.container import cgroups

    try:
        layout = cgroups.detect()
    except DsecError:
        return []
    left = [str(d) for d in cgroups.sandbox_cgroups(layout, "/" + parent)]
    if left:
        cgroups.remove(layout, "/" + parent)
    return left


def _logs(paths: Paths) -> str:
    return "\n".join(
        f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(paths.logs.glob("*.log"))
    )
