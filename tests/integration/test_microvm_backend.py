"""The microVM backend on real QEMU (TCG here) with the guest kernel `dsec setup` built.

Few VMs on purpose (each TCG boot costs ~1 core-second): one sandbox goes through create,
runtime calls, pause/resume, fork and destroy; the fault tests use the failure paths.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.core.errors import DeadlineExceeded, SandboxFailed
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.api import RuntimeState, SandboxPaths
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.microvm import backend as vmbackend
from dsec.edge.backends.microvm import kernel, snapshots
from dsec.edge.backends.microvm.backend import MicrovmBackend
from dsec.paths import Paths
from tests.integration import vmkit
from tests.integration.vmkit import microvm_skip_reason as _skip_reason
from tests.integration.vmkit import qemu_pids_under as _qemu_pids_under
from tests.integration.vmkit import sh as _sh

pytestmark = pytest.mark.guest_kernel
Env = vmkit.Env[MicrovmBackend]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with vmkit.node("dsec-vmtest-", "dsv") as n:
        be = n.microvm("e0a1", kernel_image=kernel.current_kernel(Paths.from_env().data))
        yield Env(n.paths, be, n.cgroup_parent, "e0a1")


async def _shell(sock: Path, cmd: str, session: str = "s1") -> dict[str, Any]:
    res = await agent_client.call(
        sock, {"op": "shell.run", "cmd": cmd, "session": session}, timeout=30
    )
    return {**res.result, "stdout": res.stdout.decode()}


@pytest.mark.asyncio
@pytest.mark.timeout(400)  # six TCG restores; minutes when other jobs load the 2 cores
async def test_lifecycle_pause_resume_fork_destroy(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = env.backend
    moves: list[str] = []
    move = be._move_memory_cgroup

    def recording(pid: int, cgroup_path: str) -> bool:
        moves.append(cgroup_path)
        return move(pid, cgroup_path)

    monkeypatch.setattr(be, "_move_memory_cgroup", recording)
    sid, paths = env.sandbox()
    spec = SandboxSpec(backend="microvm", memory_mb=256)
    started = await be.create(sid, spec, paths)
    children: list[tuple[str, SandboxPaths]] = []
    try:
        assert started.pid > 0
        assert (await be.state(sid)) == (RuntimeState.RUNNING, started.pid)
        sock = paths.agent_socket
        assert (await _sh(sock, "hostname")).strip() == sid
        assert "Debian" in await _sh(sock, "cat /etc/os-release")
        await _sh(sock, "echo hello > /root/f && echo shm > /dev/shm/x")
        # A persistent shell and a background process, which must outlive pause/resume.
        await _shell(sock, "export KEEP=kept; cd /tmp")
        await _sh(sock, "nohup sleep 1000 >/dev/null 2>&1 & echo $! > /root/sleeper")
        concurrent = await asyncio.gather(*(_sh(sock, f"echo {i}") for i in range(8)))
        assert [c.strip() for c in concurrent] == [str(i) for i in range(8)]
        usage = await be.usage(sid)
        assert usage.get("memory_bytes", 0) > 0

        scratch = paths.state_dir / "scratch.qcow2"
        allocated = scratch.stat().st_blocks * 512
        await _sh(sock, "head -c 4M /dev/urandom > /root/blob")
        qemu_pid = be._vms[sid].vmm.pid
        await be.pause(sid)
        assert (await be.state(sid))[0] is RuntimeState.PAUSED
        # the guest synced before the snapshot: what it wrote is on its disk (not dirty in
        # its page cache, to be written out, journal commit and all, after each restore)
        assert scratch.stat().st_blocks * 512 - allocated >= 4 << 20
        assert not Path(f"/proc/{qemu_pid}").exists(), "pause frees the VMM"
        assert (paths.state_dir / "snapshots" / "current" / "manifest.json").exists()
        await be.resume(sid)
        assert (await be.state(sid))[0] is RuntimeState.RUNNING
        pid = (await _sh(sock, "cat /root/sleeper")).strip()
        assert (await _sh(sock, f"cat /proc/{pid}/comm")).strip() == "sleep"
        assert (await _sh(sock, "cat /dev/shm/x /root/f")) == "shm\nhello\n"
        sh = await _shell(sock, "echo $KEEP $(pwd)")
        assert sh["stdout"].strip() == "kept /tmp"

        # Fork: two children from one snapshot; each its own hostname and writable layer.
        children = [env.sandbox(), env.sandbox()]
        kids = await be.fork(sid, children)
        assert len(kids) == 2
        assert all(k.pid > 0 for k in kids)
        machine_ids = {await _sh(sock, "cat /etc/machine-id")}
        for (cid, cp), i in zip(children, range(2), strict=True):
            assert (await _sh(cp.agent_socket, "cat /root/f")) == "hello\n"
            assert (await _sh(cp.agent_socket, "hostname")).strip() == cid
            # the identity files (on a tmpfs in the guest) are the child's own too
            assert (await _sh(cp.agent_socket, "cat /etc/hostname")) == f"{cid}\n"
            assert f"127.0.1.1\t{cid}\n" in await _sh(cp.agent_socket, "cat /etc/hosts")
            assert sid not in await _sh(cp.agent_socket, "cat /etc/hosts")
            machine_ids.add(await _sh(cp.agent_socket, "cat /etc/machine-id"))
            await _sh(cp.agent_socket, f"echo child{i} > /root/f")
        assert (await _sh(sock, "cat /root/f")) == "hello\n"  # the parent is untouched
        assert len(machine_ids) == 3
        assert (await _sh(sock, "cat /etc/hostname")) == f"{sid}\n"
        assert (await _sh(children[1][1].agent_socket, "cat /root/f")) == "child1\n"
        assert (await _shell(children[0][1].agent_socket, "echo $KEEP"))["stdout"].strip() == "kept"

        # A fork of a child (its RAM is copy-on-write from the template): while it writes
        # its snapshot, its VMM is charged to the edge's template cgroup, not to the child.
        assert moves == []  # the first fork's parent owned its RAM file
        grand = env.sandbox()
        children.append(grand)
        await be.fork(children[0][0], [grand])
        assert (await _sh(grand[1].agent_socket, "cat /root/f")) == "child0\n"
        assert (await _sh(children[0][1].agent_socket, "cat /root/f")) == "child0\n"
        tpl = f"/{env.cgroup_parent}/vm-templates"
        mem_cg = cgroups.detect().controller_dir("memory", tpl)
        if mem_cg is not None:  # a host with a memory controller (this one has)
            assert moves[0] == tpl
            assert not mem_cg.exists()  # removed once the snapshot was written
    finally:
        for cid, cp in children:
            await be.destroy(cid, cp)
        await be.destroy(sid, paths)
    assert (await be.state(sid))[0] is RuntimeState.MISSING
    assert not paths.state_dir.exists()
    assert not paths.agent_socket.exists()
    assert not be.run_dir(sid).exists()
    assert _qemu_pids_under(be.sandboxes_dir) == []
    assert not be.mem_dir.exists() or list(be.mem_dir.iterdir()) == []
    assert not be.templates_dir.exists() or list(be.templates_dir.iterdir()) == []
    assert cgroups.list_children(cgroups.detect(), env.cgroup_parent) == []


@pytest.mark.asyncio
async def test_corrupt_snapshot_is_refused(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    be = env.backend
    sid, paths = env.sandbox()
    await be.create(sid, SandboxSpec(backend="microvm", memory_mb=128), paths)
    try:
        await be.pause(sid)
        state = paths.state_dir / "snapshots" / "current" / "state"
        data = state.read_bytes()
        state.write_bytes(data[: len(data) // 2])  # truncated
        with pytest.raises(snapshots.SnapshotCorrupt, match="state"):
            await be.resume(sid)
        assert _qemu_pids_under(paths.state_dir) == []
        state.write_bytes(data)  # repaired: the same snapshot restores
        # QEMU inherits the state file opened before the check ran: a file put in its
        # place meanwhile (here: the same bytes, a new inode) is not loaded unchecked
        check = vmbackend._check_snapshot

        def replaced_then_checked(snap: Any, private: bool) -> None:
            copy = state.with_name("state.copy")
            copy.write_bytes(data)
            copy.replace(state)
            check(snap, private)

        monkeypatch.setattr(vmbackend, "_check_snapshot", replaced_then_checked)
        with pytest.raises(SandboxFailed, match="replaced"):
            await be.resume(sid)
        monkeypatch.undo()
        assert _qemu_pids_under(paths.state_dir) == []
        await be.resume(sid)
        assert (await _sh(paths.agent_socket, "echo ok")).strip() == "ok"
    finally:
        await be.destroy(sid, paths)
    assert not paths.state_dir.exists()


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_a_snapshot_that_carries_its_paused_state_resumes(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A QEMU started before ``store-global-state=off`` (a VM booted by an older edge)
    writes "paused" into its snapshot: the restored QEMU stops after the load and gets
    its ``cont``."""
    from dsec.edge.backends.microvm import qemu

    argv = qemu.QemuVmm.argv

    def older(self: qemu.QemuVmm, *a: Any, **kw: Any) -> list[str]:
        out = argv(self, *a, **kw)
        i = out.index("migration.store-global-state=off")
        return out[: i - 1] + out[i + 1 :]

    be = env.backend
    sid, paths = env.sandbox()
    monkeypatch.setattr(qemu.QemuVmm, "argv", older)
    await be.create(sid, SandboxSpec(backend="microvm", memory_mb=128), paths)
    try:
        await be.pause(sid)
        monkeypatch.undo()
        await be.resume(sid)
        vmm = be._vms[sid].vmm
        assert isinstance(vmm, qemu.QemuVmm)
        assert await vmm.status() == "running"
        assert (await _sh(paths.agent_socket, "echo ok")).strip() == "ok"
    finally:
        await be.destroy(sid, paths)


@pytest.mark.asyncio
async def test_boot_timeout_kills_the_vmm(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vmbackend, "BOOT_TIMEOUT_S", 0.05)
    be = env.backend
    sid, paths = env.sandbox()
    with pytest.raises(DeadlineExceeded, match="not up"):
        await be.create(sid, SandboxSpec(backend="microvm", memory_mb=128), paths)
    assert _qemu_pids_under(paths.state_dir) == []
    assert not paths.state_dir.exists()
    assert not be.run_dir(sid).exists()
    assert cgroups.list_children(cgroups.detect(), env.cgroup_parent) == []


@pytest.mark.asyncio
async def test_guest_panic_is_reported(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """vminit exits when its config disk is bad: PID 1 dies, the kernel panics."""
    from dsec.edge.backends.microvm import disks

    def bad_config(dest: Path, values: object) -> Path:
        dest.write_bytes(b"\0" * 512)
        return dest

    monkeypatch.setattr(disks, "write_config", bad_config)
    be = env.backend
    sid, paths = env.sandbox()
    with pytest.raises(SandboxFailed, match="panicked"):
        await be.create(sid, SandboxSpec(backend="microvm", memory_mb=128), paths)
    assert _qemu_pids_under(paths.state_dir) == []
    assert not paths.state_dir.exists()


@pytest.mark.asyncio
async def test_a_new_edge_readopts_the_vm(env: Env) -> None:
    """The edge restarts: a fresh backend re-attaches QMP and the agent channel."""
    be = env.backend
    sid, paths = env.sandbox()
    started = await be.create(sid, SandboxSpec(backend="microvm", memory_mb=128), paths)
    fresh: MicrovmBackend | None = None
    try:
        await _shell(paths.agent_socket, "export Z=7", session="s")
        await be._detach(be._vms.pop(sid))  # the old edge's mux goes away with it
        fresh = MicrovmBackend(
            env.paths,
            "e0a1",
            image_store=be.images,
            cgroup_parent=env.cgroup_parent,
            mem_dir=be.mem_dir,
            kernel_image=be.kernel_image,
        )
        assert await fresh.state(sid) == (RuntimeState.RUNNING, started.pid)
        assert (await _shell(paths.agent_socket, "echo $Z", session="s"))["stdout"] == "7\n"
    finally:
        await (fresh or be).destroy(sid, paths)
    assert _qemu_pids_under(paths.state_dir) == []


def _pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.asyncio
@pytest.mark.timeout(600)  # seven TCG restores and a re-adoption
async def test_forking_again_is_as_cheap_as_the_first(env: Env) -> None:
    """After a fork the parent's RAM is copy-on-write from the template: its next fork,
    pause or snapshot must not write that RAM into the state stream, and the children of
    its second fork must share clean pages with it as the first fork's do."""
    be = env.backend
    sid, paths = env.sandbox()
    await be.create(sid, SandboxSpec(backend="microvm", memory_mb=256), paths)
    sock = paths.agent_socket
    kids: list[tuple[str, SandboxPaths]] = []
    fresh: MicrovmBackend | None = None
    snap_id = f"s{sid[:20]}"
    try:
        await _sh(sock, "head -c 64M /dev/urandom > /dev/shm/fill && echo 0 > /root/n")
        state: list[int] = []
        pss: list[float] = []
        for i in range(2):
            kid = env.sandbox()
            kids.append(kid)
            await be.fork(sid, [kid])
            tid = vmbackend._load_meta(paths.state_dir)["templates"][-1]
            state.append((be.templates_dir / tid / "state").stat().st_size)
            assert (await _sh(kid[1].agent_socket, "cat /root/n")).strip() == str(i)
            pss.append(_pss_mib(be._vms[kid[0]].vmm.pid))
            await _sh(sock, f"echo {i + 1} > /root/n")
        print(f"state stream: {state} bytes, child PSS {pss} MiB")
        # the device state only (a few hundred KiB); on the old code the second was all RAM
        assert state[1] <= max(4 * state[0], 8 << 20), state
        # a child maps the template copy-on-write: not 64 MiB and more of RAM of its own
        assert pss[1] <= pss[0] + 24, pss
        assert (await _sh(sock, "md5sum < /dev/shm/fill")) == (
            await _sh(kids[1][1].agent_socket, "md5sum < /dev/shm/fill")
        )

        # a named snapshot of the parent (it has its own RAM file now): no RAM in the stream
        await be.snapshot(sid, snap_id)
        assert (be.templates_dir / snap_id / "state").stat().st_size <= 8 << 20
        assert (await _sh(sock, "cat /root/n")).strip() == "2"
        # a sandbox started from it maps its RAM copy-on-write; pausing that one moves it
        # onto its own file, and the snapshot's RAM file stays trusted (stamp kept)
        kid = env.sandbox()
        kids.append(kid)
        await be.create_from_snapshot(snap_id, *kid)
        await be.pause(kid[0])
        assert (kid[1].state_dir / "snapshots" / "current" / "state").stat().st_size <= 8 << 20
        await be.resume(kid[0])
        assert (await _sh(kid[1].agent_socket, "cat /root/n")).strip() == "2"
        assert snapshots.ram_unchanged(be._named(snap_id))
        await be.delete_snapshot(snap_id)

        # a third fork, then pause/resume of the parent
        kid = env.sandbox()
        kids.append(kid)
        await be.fork(sid, [kid])
        await be.pause(sid)
        cur = paths.state_dir / "snapshots" / "current" / "state"
        assert cur.stat().st_size <= 8 << 20
        await be.resume(sid)
        assert (await _sh(sock, "cat /root/n")).strip() == "2"

        # the edge restarts: the parent (on its own RAM file) is re-adopted
        await be._detach(be._vms.pop(sid))
        fresh = MicrovmBackend(
            env.paths, "e0a1", image_store=be.images, cgroup_parent=env.cgroup_parent,
            mem_dir=be.mem_dir, kernel_image=be.kernel_image,
        )  # fmt: skip
        assert (await fresh.state(sid))[0] is RuntimeState.RUNNING
        assert (await _sh(sock, "cat /root/n")).strip() == "2"
        assert fresh._vms[sid].vmm.shared_ram
    finally:
        for cid, cp in kids:
            await be.destroy(cid, cp)
        await (fresh or be).destroy(sid, paths)
    assert _qemu_pids_under(be.sandboxes_dir) == []
    assert not be.mem_dir.exists() or list(be.mem_dir.iterdir()) == []
    assert not be.templates_dir.exists() or list(be.templates_dir.iterdir()) == []
    assert cgroups.list_children(cgroups.detect(), env.cgroup_parent) == []
