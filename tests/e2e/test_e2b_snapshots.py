"""The unmodified E2B SDK's snapshots and fork through the gateway, written as E2B user code:
``create_snapshot``, ``list_snapshots``, ``Sandbox.create(<snapshot id or name>)``,
``delete_snapshot`` and ``fork``, sync and async, on containers (filesystem snapshots) and
microVMs (full snapshots, fork)."""

from __future__ import annotations

import uuid

import pytest

from dsec.testing.platform import RunningPlatform
from tests.e2e.test_microvm import _qemu_count, _skip_reason

e2b = pytest.importorskip("e2b", reason="the e2b SDK is a dev dependency (pip install -e .[dev])")

from e2b import AsyncSandbox, Sandbox, SandboxException, SandboxNotFoundException  # noqa: E402

pytestmark = pytest.mark.platform
UNKNOWN_SNAPSHOT = "snp-zzzz-aaaaaaaaaaaaaaaaaaaa"


@pytest.fixture
def e2b_env(platform: RunningPlatform, monkeypatch: pytest.MonkeyPatch) -> str:
    gateway = f"http://{platform.layout.gateway}"
    monkeypatch.setenv("E2B_API_URL", gateway)
    monkeypatch.setenv("E2B_SANDBOX_URL", gateway)
    monkeypatch.setenv("E2B_API_KEY", platform.admin_key)
    return gateway


def test_container_snapshot_list_create_from_delete(e2b_env: str) -> None:
    name = f"fs-{uuid.uuid4().hex[:8]}"
    sbx = Sandbox.create(timeout=120)
    made: list[Sandbox] = []
    try:
        sbx.files.write("/root/notes.txt", "before")
        snap = sbx.create_snapshot(name=name)  # containers: a filesystem snapshot
        assert snap.names == [name]
        sbx.files.write("/root/notes.txt", "after")  # the sandbox keeps running
        with pytest.raises(SandboxException, match="container backend") as full:
            sbx.create_snapshot(mode="full")
        assert full.value.status_code == 400

        listed = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id]
        assert [s.snapshot_id for s in Sandbox.list_snapshots(name=name).next_items()] == [
            snap.snapshot_id
        ]

        made.append(Sandbox.create(snap.snapshot_id, timeout=60))
        assert made[-1].files.read("/root/notes.txt") == "before"
        made.append(Sandbox.create(name, timeout=60))  # by name too
        assert made[-1].commands.run("cat /root/notes.txt").stdout == "before"

        with pytest.raises(SandboxException, match="cannot fork") as fork:
            sbx.fork()
        assert fork.value.status_code == 400

        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        assert Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == []
        for template in (snap.snapshot_id, UNKNOWN_SNAPSHOT):
            with pytest.raises(SandboxException) as gone:
                Sandbox.create(template)
            assert gone.value.status_code == 404
        with pytest.raises(SandboxNotFoundException):
            Sandbox.create_snapshot("sbx-zzzz-aaaaaaaaaaaaaaaaaaaa")
        with pytest.raises(SandboxNotFoundException):
            Sandbox.fork("sbx-zzzz-aaaaaaaaaaaaaaaaaaaa")
    finally:
        for s in (sbx, *made):
            s.kill()


@pytest.mark.asyncio
async def test_async_snapshot_and_create_from(e2b_env: str) -> None:
    sbx = await AsyncSandbox.create(timeout=120)
    child: AsyncSandbox | None = None
    try:
        await sbx.files.write("/root/a.txt", "async")
        snap = await sbx.create_snapshot(mode="filesystem")
        assert snap.names == []
        page = await AsyncSandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
        assert [s.snapshot_id for s in page] == [snap.snapshot_id]
        child = await AsyncSandbox.create(snap.snapshot_id, timeout=60)
        assert (await child.commands.run("cat /root/a.txt")).stdout == "async"
        assert await AsyncSandbox.delete_snapshot(snap.snapshot_id) is True
        assert await AsyncSandbox.delete_snapshot(snap.snapshot_id) is False
    finally:
        for s in (sbx, child):
            if s is not None:
                await s.kill()


@pytest.mark.guest_kernel
@pytest.mark.timeout(300)  # TCG boots under a loaded CI machine
def test_microvm_snapshot_and_fork(e2b_env: str, platform: RunningPlatform) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    sbx = Sandbox.create("microvm", timeout=300)  # one cold boot; the rest are restores
    made: list[Sandbox] = []
    try:
        sbx.files.write("/root/state", "warm")
        sbx.files.write("/dev/shm/m", "in-ram")  # a tmpfs: guest RAM
        snap = sbx.create_snapshot()  # microvm: a full (memory) snapshot
        with pytest.raises(SandboxException, match="microvm backend"):
            sbx.create_snapshot(mode="filesystem")

        made.append(Sandbox.create(snap.snapshot_id, timeout=120))
        child = made[-1]
        assert child.files.read("/root/state") == "warm"
        assert child.files.read("/dev/shm/m") == "in-ram"

        forks = sbx.fork(count=1, timeout=120)
        assert len(forks) == 1
        fork = forks[0]
        assert isinstance(fork, Sandbox)
        made.append(fork)
        assert fork.sandbox_id not in (sbx.sandbox_id, child.sandbox_id)
        assert fork.files.read("/dev/shm/m") == "in-ram"
        assert fork.get_info().end_at < sbx.get_info().end_at  # its own timeout

        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert child.files.read("/root/state") == "warm"  # still running
    finally:
        for s in (*made, sbx):
            s.kill()
    assert _qemu_count(platform.paths.home) == 0
