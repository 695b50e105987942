"""Resource limits of container sandboxes: pids, memory, CPU (root only).

Each test provokes the limit from inside a sandbox and checks the sandbox's cgroup (and the
host) from outside.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import RuntimeState
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.container.backend import ContainerBackend
from dsec.edge.backends.container.testkit import ContainerTestEnv

pytestmark = pytest.mark.root


@pytest.mark.asyncio
async def test_fork_bomb_hits_pids_max(cenv: ContainerTestEnv, backend: ContainerBackend) -> None:
    sid, paths = cenv.sandbox()
    await backend.create(sid, SandboxSpec(pids=64, cpu=1.0), paths)
    try:
        bomb = "bash -c 'f() { f | f & }; f' </dev/null >/dev/null 2>&1"
        res = await backend.crun.exec(sid, ["/bin/sh", "-c", bomb], time_limit=30)
        assert res.returncode == 0
        deadline = time.monotonic() + 20
        usage = await backend.usage(sid)
        while usage.get("pids_limit_hits", 0) == 0:
            assert time.monotonic() < deadline, usage
            await asyncio.sleep(0.1)
            usage = await backend.usage(sid)
        assert usage["pids"] <= 64
        # The host stays responsive while the bomb keeps retrying.
        t0 = time.monotonic()
        await asyncio.to_thread(subprocess.run, ["true"], check=True)
        assert time.monotonic() - t0 < 2.0
        assert (await backend.state(sid))[0] is RuntimeState.RUNNING
    finally:
        t0 = time.monotonic()
        await backend.destroy(sid, paths)
        destroy_s = time.monotonic() - t0
    assert destroy_s < 10
    assert backend.leaked(sid, paths) == []


@pytest.mark.asyncio
async def test_memory_hog_is_oom_killed_and_sandbox_survives(
    cenv: ContainerTestEnv, backend: ContainerBackend
) -> None:
    sid, paths = cenv.sandbox()
    await backend.create(sid, SandboxSpec(memory_mb=64), paths)
    try:
        hog = "python3 -c 'x = b\"x\" * (300 * 2**20)'; echo rc=$?"
        res = await backend.crun.exec(sid, ["/bin/sh", "-c", hog], time_limit=60)
        assert res.stdout.decode().strip() == "rc=137", res
        usage = await backend.usage(sid)
        assert usage["memory_limit_bytes"] == 64 * 2**20
        layout = cgroups.detect()
        mem = layout.controller_dir("memory", backend.cgroup_path(sid))
        assert mem is not None
        # The kernel's own OOM record of the sandbox's memory cgroup.
        events = mem / ("memory.oom_control" if "memory" in layout.v1 else "memory.events")
        fields = dict(line.split() for line in events.read_text().splitlines())
        assert int(fields["oom_kill"]) == 1
        assert usage["oom_kills"] == 1
        # Only the hog died: init and the sandbox are fine.
        assert (await backend.state(sid))[0] is RuntimeState.RUNNING
        ok = await backend.crun.exec(sid, ["/bin/sh", "-c", "echo alive"])
        assert ok.stdout == b"alive\n"
    finally:
        await backend.destroy(sid, paths)
    assert backend.leaked(sid, paths) == []


@pytest.mark.asyncio
async def test_cpu_quota_throttles(cenv: ContainerTestEnv, backend: ContainerBackend) -> None:
    sid, paths = cenv.sandbox()
    await backend.create(sid, SandboxSpec(cpu=0.2), paths)
    try:
        before = await backend.usage(sid)
        spin = "timeout 2 sh -c 'while :; do :; done'; true"
        await backend.crun.exec(sid, ["/bin/sh", "-c", spin], time_limit=30)
        after = await backend.usage(sid)
        used = after["cpu_seconds"] - before["cpu_seconds"]
        # 2 s of wall time at 0.2 CPU: about 0.4 s, never anywhere near 2 s.
        assert 0.1 < used < 0.8, used
        assert after["cpu_throttled_periods"] > before.get("cpu_throttled_periods", 0)
    finally:
        await backend.destroy(sid, paths)
    assert backend.leaked(sid, paths) == []
