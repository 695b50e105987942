"""The Firecracker driver against the real binary: boot, pause/resume, snapshot, restore
(twice from one snapshot, like fork children), kill. Runs only where a ``firecracker``
binary, a KVM that really runs guests (``kvm.usable()``) and a built guest kernel exist;
elsewhere it is skipped with the reason. The same cycle runs against a spec-checking fake
in tests/unit/test_firecracker_driver.py on every machine."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.edge.backends.microvm import kvm
from dsec.edge.backends.microvm.firecracker import FirecrackerVmm
from dsec.edge.backends.microvm.vmm import VmConfig
from dsec.paths import Paths

pytestmark = pytest.mark.guest_kernel
CMDLINE = "console=ttyS0 reboot=k panic=1 pci=off acpi=off"


def guest_kernel() -> Path | None:
    env = os.environ.get("DSEC_GUEST_KERNEL")
    if env:
        return Path(env)
    try:  # built by `dsec setup` (the QEMU microvm helper's kernel module)
        mod = importlib.import_module("dsec.edge.backends.microvm.kernel")
        found = mod.current_kernel(Paths.from_env(None).data)
    except (ImportError, AttributeError, OSError):
        return None
    return found if isinstance(found, Path) else None


@pytest.fixture(scope="module")
def firecracker() -> Path:
    binary = shutil.which("firecracker")
    if binary is None:
        pytest.skip("firecracker binary not found (see README: Firecracker on a KVM host)")
    ok, reason = kvm.usable()
    if not ok:
        pytest.skip(f"KVM cannot run guests here: {reason}")
    return Path(binary)


@pytest.fixture
def run_base() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="fc"))  # short: unix socket paths live under it
    yield base
    shutil.rmtree(base, ignore_errors=True)


def config(base: Path, kernel: Path, name: str) -> VmConfig:
    return VmConfig(
        vcpus=1,
        memory_mib=128,
        kernel=kernel,
        cmdline=CMDLINE,
        run_dir=base / name,
        mem_file=base / name / "mem",
        agent_socket=base / name / "v.sock",
        extra={"vm_id": name},
    )


@pytest.mark.asyncio
async def test_boot_snapshot_restore_fork_with_real_firecracker(
    firecracker: Path, run_base: Path
) -> None:
    kernel = guest_kernel()
    if kernel is None or not kernel.is_file():
        pytest.skip("no guest kernel (run `dsec setup`, or set DSEC_GUEST_KERNEL)")
    vmm = FirecrackerVmm(firecracker)
    await vmm.boot(config(run_base, kernel, "parent"), timeout_s=30)
    try:
        assert (await vmm.describe())["state"] == "Running"
        await vmm.pause()
        assert (await vmm.describe())["state"] == "Paused"
        await vmm.resume()
        snap = await vmm.snapshot(run_base / "snap")
        assert snap.mem_file.stat().st_size >= 128 * 1024 * 1024
    finally:
        await vmm.kill()
    children = [FirecrackerVmm(firecracker) for _ in range(2)]
    try:
        for i, child in enumerate(children):
            await child.restore(
                config(run_base, kernel, f"child{i}"), snap, private=True, timeout_s=30
            )
            assert (await child.describe())["state"] == "Running"
    finally:
        for child in children:
            await child.kill()
    assert all(c.pid == 0 for c in children)
