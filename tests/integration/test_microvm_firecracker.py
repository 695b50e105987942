"""The microVM backend on Firecracker, end to end at the backend level.

Here Firecracker is the fake (tests/fakes/firecracker.py): it checks every request against
the published API spec, keeps Firecracker's state rules and plays the guest's channel
multiplexer on the agent vsock port (each channel echoes). Everything else is real: image
layers as erofs, the writable disk, cgroups, the keeper, the host mux over hybrid vsock.
The same lifecycle runs with the real binary where one and a working KVM exist
(``test_lifecycle_on_real_firecracker``, skipped here with the reason).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsec.core.errors import SandboxFailed
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import RuntimeState, SandboxPaths
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.microvm import kernel, kvm, snapshots
from dsec.edge.backends.microvm.backend import MicrovmBackend
from dsec.edge.backends.microvm.firecracker import pid_alive
from dsec.paths import Paths
from tests.fakes.swagger import find_spec
from tests.integration import vmkit
from tests.integration.vmkit import node_skip_reason as _skip_reason

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Env(vmkit.Env[MicrovmBackend]):
    record: Path
    mem: Path

    def seen(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def calls(self) -> list[tuple[str, str]]:
        return [(r["method"], r["path"]) for r in self.seen() if "method" in r]


def _make_env(kernel_image: Path) -> Iterator[Env]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with vmkit.node("dsec-fctest-", "dsf") as n:
        be = n.microvm("e0f1", kernel_image=kernel_image, vmm="firecracker")
        yield Env(n.paths, be, n.cgroup_parent, "e0f1", n.root / "requests.jsonl", n.mem)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    spec = find_spec()
    if spec is None:
        pytest.skip("shared/specs/firecracker-api.yaml not found beside the checkout")
    bins = Path(tempfile.mkdtemp(prefix="dsec-fcbin-"))
    exe = bins / "firecracker"
    exe.write_text(
        f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m tests.fakes.firecracker "$@"\n'
    )
    exe.chmod(0o755)
    (bins / "vmlinux").write_bytes(b"not booted by the fake")
    monkeypatch.setenv("PATH", f"{bins}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_FC_SPEC", str(spec))
    try:
        for e in _make_env(bins / "vmlinux"):
            monkeypatch.setenv("FAKE_FC_RECORD", str(e.record))
            # KVM cannot run guests here; the fake needs none (the choice itself is
            # covered in tests/unit/test_vmm_choice.py)
            e.backend._vmm_choice = ("firecracker", "the spec-checking fake")
            yield e
    finally:
        shutil.rmtree(bins, ignore_errors=True)


async def _echo(sock: Path, payload: bytes) -> bytes:
    """A call through the sandbox's agent socket: host mux -> hybrid vsock -> guest."""
    reader, writer = await asyncio.open_unix_connection(str(sock))
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), 10)
    finally:
        writer.close()


def _fc_pids(env: Env) -> set[int]:
    return {int(r["pid"]) for r in env.seen() if "pid" in r}


BOOT_HEAD = [("PUT", "/machine-config"), ("PUT", "/boot-source")]
BOOT_TAIL = [("PUT", "/vsock"), ("PUT", "/balloon"), ("PUT", "/actions"), ("GET", "/")]


def _restore_calls(drives: list[str]) -> list[tuple[str, str]]:
    return [
        ("PUT", "/snapshot/load"),
        *(("PATCH", f"/drives/{d}") for d in drives),
        ("PATCH", "/vm"),
        ("GET", "/"),
    ]


@pytest.mark.asyncio
async def test_create_pause_resume_fork_kill_on_firecracker(env: Env) -> None:
    be = env.backend
    assert be.availability().reason.startswith("Firecracker")
    sid, paths = env.sandbox()
    started = await be.create(sid, SandboxSpec(backend="microvm", memory_mb=256), paths)
    children: list[tuple[str, SandboxPaths]] = []
    try:
        assert (await be.state(sid)) == (RuntimeState.RUNNING, started.pid)
        assert await _echo(paths.agent_socket, b"hello vm") == b"hello vm"
        calls = env.calls()
        drives = [p.removeprefix("/drives/") for m, p in calls if p.startswith("/drives/")]
        assert drives[:2] == ["config", "bundle"]
        assert drives[-1] == "scratch"
        assert calls == [*BOOT_HEAD, *(("PUT", f"/drives/{d}") for d in drives), *BOOT_TAIL]
        body = {(r["method"], r["path"]): r["body"] for r in env.seen() if "method" in r}
        boot = body[("PUT", "/boot-source")]
        assert boot["boot_args"].startswith("console=ttyS0 reboot=k panic=1 pci=off")
        assert boot["boot_args"].endswith(" dsec.disks=" + ",".join(drives))  # vda, vdb...
        assert boot["initrd_path"].endswith(".cpio")
        scratch = body[("PUT", "/drives/scratch")]
        assert scratch["path_on_host"] == str(paths.state_dir / "scratch.raw")
        assert not scratch["is_read_only"]
        assert body[("PUT", "/machine-config")] == {"vcpu_count": 1, "mem_size_mib": 256}
        assert body[("PUT", "/vsock")]["uds_path"] == str(be.run_dir(sid) / "vsock.sock")
        assert (paths.state_dir / "scratch.raw").stat().st_blocks * 512 < 64 << 20  # sparse

        # pause: snapshot, then the VMM quits; resume: a fresh process loads it
        first = _fc_pids(env)
        await be.pause(sid)
        assert (await be.state(sid))[0] == RuntimeState.PAUSED
        assert not any(pid_alive(p) for p in first)
        current = paths.state_dir / "snapshots" / "current"
        assert (current / snapshots.MANIFEST).is_file()
        assert env.calls()[-2:] == [("PATCH", "/vm"), ("PUT", "/snapshot/create")]
        n = len(env.calls())
        await be.resume(sid)
        assert env.calls()[n:] == _restore_calls(drives)
        assert (await be.state(sid)) == (RuntimeState.RUNNING, started.pid)
        assert await _echo(paths.agent_socket, b"after resume") == b"after resume"
        assert not current.exists()

        # fork: a template snapshot; the parent and two children restore from it, each
        # on its own drive files and vsock socket, each child with its own identity
        children = [env.sandbox(), env.sandbox()]
        n = len(env.calls())
        forked = await be.fork(sid, children)
        assert len(forked) == 2
        assert env.calls()[n : n + 2] == [("PATCH", "/vm"), ("PUT", "/snapshot/create")]
        loads = [r for r in env.seen() if r.get("path") == "/snapshot/load"][-3:]
        assert len({r["pid"] for r in loads}) == 3
        mems = {r["body"]["mem_backend"]["backend_path"] for r in loads}
        assert len(mems) == 1  # one frozen RAM file, mapped by all three
        assert Path(mems.pop()).parent == env.mem
        socks = {r["body"]["vsock_override"]["uds_path"] for r in loads}
        assert socks == {
            str(be.run_dir(i) / "vsock.sock") for i in (sid, *(c for c, _ in children))
        }
        repointed = {
            r["body"]["path_on_host"]
            for r in env.seen()
            if r.get("method") == "PATCH" and r.get("path") == "/drives/scratch"
        }
        for cid, cp in children:
            assert str(cp.state_dir / "scratch.raw") in repointed
            assert (await be.state(cid))[0] == RuntimeState.RUNNING
            assert await _echo(cp.agent_socket, cid.encode()) == cid.encode()
        hellos = [r["hello"] for r in env.seen() if "hello" in r]
        assert {h.get("hostname") for h in hellos} >= {c for c, _ in children}
        assert await _echo(paths.agent_socket, b"parent") == b"parent"

        # the edge restarts: a new backend adopts the running Firecracker (its API socket,
        # the vsock) and calls go through again
        for cid, cp in children:
            await be.destroy(cid, cp)
        children = []
        vmm_pid = be._vms[sid].vmm.pid
        await be._detach(be._vms.pop(sid))
        be = MicrovmBackend(
            env.paths, "e0f1", image_store=be.images, cgroup_parent=be.cgroup_parent,
            mem_dir=env.mem, kernel_image=be.kernel_image, vmm="firecracker",
        )  # fmt: skip
        be._vmm_choice = ("firecracker", "the spec-checking fake")
        assert (await be.state(sid)) == (RuntimeState.RUNNING, started.pid)
        assert be._vms[sid].vmm.pid == vmm_pid
        assert await _echo(paths.agent_socket, b"adopted") == b"adopted"
        assert [e for r in env.seen() for e in r.get("errors", [])] == []
    finally:
        for cid, cp in children:
            await be.destroy(cid, cp)
        await be.destroy(sid, paths)
    assert not any(pid_alive(p) for p in _fc_pids(env))
    assert not paths.state_dir.exists()
    assert not be.run_dir(sid).exists()
    assert not env.mem.exists()  # removed once empty
    assert not be.templates_dir.exists() or list(be.templates_dir.iterdir()) == []


@pytest.mark.asyncio
async def test_a_refused_boot_is_a_clear_error_and_leaves_nothing(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_FC_MODE", "refuse:PUT /boot-source")
    be = env.backend
    sid, paths = env.sandbox()
    with pytest.raises(SandboxFailed, match=r"boot failed: .*PUT /boot-source: 400 .*refused"):
        await be.create(sid, SandboxSpec(backend="microvm", memory_mb=256), paths)
    pids = _fc_pids(env)
    assert pids
    assert not any(pid_alive(p) for p in pids)
    assert not paths.state_dir.exists()
    assert not be.run_dir(sid).exists()
    assert not paths.agent_socket.exists()
    assert (await be.state(sid))[0] == RuntimeState.MISSING
    assert cgroups.list_children(cgroups.detect(), be.cgroup_parent) == []


@pytest.mark.asyncio
async def test_a_refused_restore_fails_clearly_and_keeps_the_snapshot(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = env.backend
    sid, paths = env.sandbox()
    await be.create(sid, SandboxSpec(backend="microvm", memory_mb=256), paths)
    try:
        await be.pause(sid)
        monkeypatch.setenv("FAKE_FC_MODE", "refuse:PUT /snapshot/load")
        with pytest.raises(SandboxFailed, match=r"restore failed: .*snapshot/load: 400 .*refused"):
            await be.resume(sid)
        assert not any(pid_alive(p) for p in _fc_pids(env))
        assert not (be.run_dir(sid) / "firecracker.sock").exists()
        assert (await be.state(sid))[0] == RuntimeState.PAUSED  # still resumable
        monkeypatch.delenv("FAKE_FC_MODE")
        await be.resume(sid)
        assert await _echo(paths.agent_socket, b"second try") == b"second try"
    finally:
        await be.destroy(sid, paths)
    assert not any(pid_alive(p) for p in _fc_pids(env))
    assert not paths.state_dir.exists()


@pytest.mark.asyncio
async def test_a_corrupt_snapshot_is_refused_before_firecracker_loads_it(env: Env) -> None:
    be = env.backend
    sid, paths = env.sandbox()
    await be.create(sid, SandboxSpec(backend="microvm", memory_mb=256), paths)
    try:
        await be.pause(sid)
        ram = paths.state_dir / "snapshots" / "current" / "mem"
        ram.write_bytes(ram.read_bytes().upper())  # same size, other pages
        with pytest.raises(snapshots.SnapshotCorrupt, match="ram digest mismatch"):
            await be.resume(sid)
        assert ("PUT", "/snapshot/load") not in env.calls()
        assert not any(pid_alive(p) for p in _fc_pids(env))
    finally:
        await be.destroy(sid, paths)
    assert not paths.state_dir.exists()


# --- the same lifecycle on the real binary --------------------------------------------------


@pytest.fixture
def real_env() -> Iterator[Env]:
    binary = shutil.which("firecracker")
    if binary is None:
        pytest.skip("firecracker binary not found (see README: Firecracker on a KVM host)")
    ok, why = kvm.usable()
    if not ok:
        pytest.skip(f"KVM cannot run guests here: {why}")
    kern = kernel.current_kernel(Paths.from_env().data)
    if kern is None:
        pytest.skip("no guest kernel: run `dsec setup`")
    yield from _make_env(kern)


@pytest.mark.guest_kernel
@pytest.mark.asyncio
async def test_lifecycle_on_real_firecracker(real_env: Env) -> None:
    from dsec.edge import agent_client

    async def sh(sock: Path, cmd: str) -> str:
        res = await agent_client.call(sock, {"op": "exec", "cmd": cmd}, timeout=30)
        assert res.result.get("exit_code") == 0, (cmd, res.result, res.stderr)
        return res.stdout.decode()

    be = real_env.backend
    assert be.vmm_choice()[0] == "firecracker"
    sid, paths = real_env.sandbox()
    await be.create(sid, SandboxSpec(backend="microvm", memory_mb=256), paths)
    children: list[tuple[str, SandboxPaths]] = []
    try:
        await sh(paths.agent_socket, "echo kept > /root/f")
        await be.pause(sid)
        await be.resume(sid)
        assert (await sh(paths.agent_socket, "cat /root/f")).strip() == "kept"
        children = [real_env.sandbox()]
        await be.fork(sid, children)
        cid, cp = children[0]
        assert (await sh(cp.agent_socket, "hostname")).strip() == cid
        assert (await sh(cp.agent_socket, "cat /root/f")).strip() == "kept"
    finally:
        for cid, cp in children:
            await be.destroy(cid, cp)
        await be.destroy(sid, paths)
    assert not paths.state_dir.exists()
