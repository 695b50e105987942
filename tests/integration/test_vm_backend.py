"""The full-VM backend on real QEMU (q35, TCG here) with the image `dsec setup --vm-image` built.

One VM on purpose: a systemd boot under TCG costs tens of core-seconds on a busy host. It
goes through create, proof that it is a full OS (systemd PID 1, the image's own kernel),
runtime calls (exec, files), pause/resume and destroy, which must leave nothing behind.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.core.errors import ImageNotFound, InvalidArgument
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.api import RuntimeState
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.microvm import qemu
from dsec.edge.backends.vm import image as vm_image
from dsec.edge.backends.vm.backend import VmBackend
from dsec.edge.images.store import ImageStore
from dsec.paths import Paths
from tests.integration import vmkit
from tests.integration.vmkit import qemu_pids_under as _qemu_pids_under


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    why = qemu.available()
    if why:
        return why
    if vm_image.current_image(Paths.from_env().data) is None:
        return "no VM system image: run `dsec setup --vm-image` (scripts/install does)"
    return None


Env = vmkit.Env[VmBackend]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    # The system image (with the agent baked in) is read from the installed data dir.
    with vmkit.node("dsec-fullvm-", "dsf", data=Paths.from_env().data) as n:
        be = VmBackend(
            n.paths,
            "e0f1",
            image_store=ImageStore(n.root / "images"),
            cgroup_parent=n.cgroup_parent,
            sandboxes_dir=n.root / "sandboxes",
            mem_dir=n.mem,
        )
        yield Env(n.paths, be, n.cgroup_parent, "e0f1")


async def _sh(sock: Path, cmd: str, timeout: float = 60) -> str:
    return await vmkit.sh(sock, cmd, timeout)


@pytest.mark.asyncio
@pytest.mark.timeout(1200)  # a systemd boot under TCG: ~10 s idle, minutes on a loaded host
async def test_full_vm_lifecycle(env: Env) -> None:
    be = env.backend
    img = be.system_image()
    assert img is not None
    sid, paths = env.sandbox()
    spec = SandboxSpec(backend="vm", memory_mb=512, env={"GREETING": "hello vm"})
    started = await be.create(sid, spec, paths)
    try:
        assert started.pid > 0
        assert (await be.state(sid)) == (RuntimeState.RUNNING, started.pid)
        sock = paths.agent_socket
        # A full OS: systemd is PID 1 and the kernel is the image's own (Debian's).
        assert (await _sh(sock, "cat /proc/1/comm")).strip() == "systemd"
        assert (await _sh(sock, "uname -r")).strip() == img.kernel_version
        res = await agent_client.call(
            sock, {"op": "exec", "cmd": "systemctl is-system-running --wait"}, timeout=600
        )
        if res.stdout.decode().strip() != "running":
            failed = await _sh(sock, "systemctl --failed --no-legend --plain || true")
            pytest.fail(f"system is {res.stdout.decode().strip()!r}; failed units: {failed}")
        assert (await _sh(sock, "systemctl is-active dsec-aether.service")).strip() == "active"
        # This call came through the C multiplexer (guest/vmport.c), a program of its own.
        mux = "readlink /proc/$(systemctl show -P MainPID dsec-vmport.service)/exe"
        assert (await _sh(sock, mux)).strip() == "/usr/local/sbin/dsec-vmport"
        assert (await _sh(sock, "hostname")).strip() == sid
        assert (await _sh(sock, 'echo "$GREETING/$DSEC_SANDBOX_ID"')).strip() == f"hello vm/{sid}"
        assert (await _sh(sock, "modprobe dummy && grep -c ^dummy /proc/modules")).strip() == "1"
        # Files through the runtime API, on the VM's own copy-on-write disk.
        await agent_client.call(
            sock, {"op": "files.write", "path": "/root/data.txt"}, stdin=b"vm file\n"
        )
        got = await agent_client.call(sock, {"op": "files.read", "path": "/root/data.txt"})
        assert got.stdout == b"vm file\n"
        info = subprocess.run(
            ["qemu-img", "info", "-U", str(paths.state_dir / "scratch.qcow2")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert str(img.disk) in info, info  # an overlay on the shared base, not a copy
        assert (await be.usage(sid)).get("memory_bytes", 0) > 0

        qemu_pid = be._vms[sid].vmm.pid
        await _sh(sock, "nohup sleep 1000 >/dev/null 2>&1 & echo $! > /root/sleeper")
        await be.pause(sid)
        assert (await be.state(sid))[0] is RuntimeState.PAUSED
        assert not Path(f"/proc/{qemu_pid}").exists(), "pause frees the VMM"
        await be.resume(sid)
        assert (await be.state(sid))[0] is RuntimeState.RUNNING
        pid = (await _sh(sock, "cat /root/sleeper")).strip()
        assert (await _sh(sock, f"cat /proc/{pid}/comm")).strip() == "sleep"
        assert (await _sh(sock, "cat /root/data.txt")) == "vm file\n"
    finally:
        await be.destroy(sid, paths)
    assert (await be.state(sid))[0] is RuntimeState.MISSING
    assert not paths.state_dir.exists()
    assert not paths.agent_socket.exists()
    assert not be.run_dir(sid).exists()
    assert _qemu_pids_under(be.sandboxes_dir) == []
    assert not be.mem_dir.exists() or list(be.mem_dir.iterdir()) == []
    assert cgroups.list_children(cgroups.detect(), env.cgroup_parent) == []


@pytest.mark.asyncio
async def test_bad_requests_leave_nothing(env: Env) -> None:
    be = env.backend
    sid, paths = env.sandbox()
    with pytest.raises(ImageNotFound, match="system image"):
        await be.create(sid, SandboxSpec(backend="vm", image="python:3.12"), paths)
    with pytest.raises(InvalidArgument, match="quotes"):
        await be.create(sid, SandboxSpec(backend="vm", env={"A": 'say "hi"'}), paths)
    # Less memory than a Debian system boots in: refused up front, named and advertised.
    with pytest.raises(InvalidArgument, match="memory_mb >= 256"):
        await be.create(sid, SandboxSpec(backend="vm", memory_mb=64), paths)
    assert be.capabilities().min_memory_mb == 256
    # and the sizing hints callers (bench.backends) read instead of the backend's name
    assert be.capabilities().min_vcpus == 1.0
    assert be.capabilities().create_seconds > 0
    assert not paths.state_dir.exists()
    assert _qemu_pids_under(be.sandboxes_dir) == []
    assert cgroups.list_children(cgroups.detect(), env.cgroup_parent) == []
