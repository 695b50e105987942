"""crun's private mount namespace on hybrid-cgroup hosts (root only; skipped elsewhere)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import RuntimeState, SandboxPaths
from dsec.edge.backends.container import cgroups, mounts, testkit
from dsec.edge.backends.container.testkit import ContainerTestEnv

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def cenv() -> Iterator[ContainerTestEnv]:
    reason = testkit.skip_reason()
    if reason:
        pytest.skip(reason)
    if not cgroups.detect().crun_needs_private_ns:
        pytest.skip("only hybrid-cgroup hosts with controllers in cgroup2 need the namespace")
    with testkit.container_test_env() as env:
        yield env


def _inside(ns_file: Path) -> list[mounts.MountEntry]:
    out = subprocess.run(
        ["nsenter", f"--mount={ns_file}", "--", "cat", "/proc/self/mountinfo"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return mounts.parse_mountinfo(out)


@pytest.mark.asyncio
async def test_namespace_is_persistent_and_sees_new_mounts(cenv: ContainerTestEnv) -> None:
    first = cenv.backend()
    sid, paths = cenv.sandbox()
    await first.create(sid, SandboxSpec(), paths)
    try:
        assert first._ns is not None
        ns_file = first._ns.ns_file
        assert ns_file == cenv.paths.run / "crun.mntns"
        inode = os.stat(ns_file).st_ino
        inside = _inside(ns_file)
        # No cgroup2 mount inside, and the rootfs mounted after the namespace is visible.
        assert not mounts.mounts_at(Path("/sys/fs/cgroup/unified"), inside)
        assert mounts.mounts_at(paths.state_dir / "rootfs", inside)
        # The host is unchanged.
        assert mounts.mounts_at(Path("/sys/fs/cgroup/unified"))

        # A restarted edge (a new backend object) reuses the same namespace.
        second = cenv.backend()
        assert await second.state(sid) == (RuntimeState.RUNNING, (await first.state(sid))[1])
        sid2, paths2 = cenv.sandbox()
        await second.create(sid2, SandboxSpec(), paths2)
        assert os.stat(ns_file).st_ino == inode
        await second.destroy(sid2, paths2)
        assert second.leaked(sid2, paths2) == []
    finally:
        await first.destroy(sid, paths)
    # The unmount propagated into the namespace too.
    assert not mounts.mounts_under(paths.state_dir, _inside(ns_file))
    assert first.leaked(sid, paths) == []


@pytest.mark.asyncio
async def test_rootfs_outside_sandboxes_dir_uses_a_fresh_namespace(
    cenv: ContainerTestEnv,
) -> None:
    backend = cenv.backend()
    sid, _ = cenv.sandbox()
    paths = SandboxPaths(
        state_dir=cenv.root / "elsewhere" / sid, agent_socket=cenv.paths.run / f"{sid}.sock"
    )
    started = await backend.create(sid, SandboxSpec(), paths)
    try:
        assert backend._launcher(paths.state_dir / "rootfs").how == "unshare"
        assert await backend.state(sid) == (RuntimeState.RUNNING, started.pid)
        res = await backend.crun.exec(sid, ["hostname"])
        assert res.stdout.decode().strip() == sid
    finally:
        await backend.destroy(sid, paths)
    assert backend.leaked(sid, paths) == []
