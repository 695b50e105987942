"""What the microVM backend needs from a virtual machine monitor (QEMU microvm, Firecracker).

The backend builds a ``VmConfig`` (kernel, drives, memory file, agent channel), asks a
driver to boot it, and later to pause, snapshot, restore or kill it. A driver owns exactly
one VMM process; every path it touches is under ``VmConfig.run_dir``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Drive:
    drive_id: str  # "rootfs-layer-0", "bundle", "scratch"...
    path: Path  # a raw block image (erofs/ext4) on the host
    read_only: bool


@dataclass(frozen=True, slots=True)
class NetIface:
    iface_id: str  # "eth0"
    tap: str  # host TAP device name (inside the sandbox's network namespace)
    mac: str


@dataclass(frozen=True, slots=True)
class VmConfig:
    """Everything a driver needs to boot one guest."""

    vcpus: int
    memory_mib: int
    kernel: Path  # uncompressed vmlinux with a PVH note (both drivers boot it)
    cmdline: str  # kernel command line, without the devices a driver adds itself
    run_dir: Path  # the driver's sockets, logs and pid file live here
    mem_file: Path  # guest RAM, a file (tmpfs) so snapshots need not copy it
    drives: tuple[Drive, ...] = ()
    net: tuple[NetIface, ...] = ()
    agent_socket: Path = Path()  # host unix socket of the agent channel (vsock or serial)
    netns: str | None = None  # run the VMM in this network namespace (a name or a file path)
    cgroup: Path | None = None  # put the VMM process in this cgroup (limits cap the VMM too)
    extra: dict[str, str] = field(default_factory=dict)  # driver-specific knobs


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A memory snapshot on disk: guest RAM (``mem_file``) plus device ``state``."""

    dir: Path
    mem_file: Path
    state: Path


class Vmm(Protocol):
    name: str  # "qemu" | "firecracker"

    @property
    def pid(self) -> int:
        """Host pid of the VMM process (0 when not running)."""
        ...

    async def boot(self, config: VmConfig, timeout_s: float) -> None:
        """Start the VMM and the guest; on failure kill the VMM, leave nothing, raise."""
        ...

    async def pause(self) -> None:
        """Stop the vCPUs (the VMM stays, memory stays resident)."""
        ...

    async def resume(self) -> None: ...

    async def snapshot(self, dest: Path) -> Snapshot:
        """Pause if needed and write device state (+ RAM unless it is already a file)."""
        ...

    async def restore(
        self, config: VmConfig, snap: Snapshot, *, private: bool, timeout_s: float
    ) -> None:
        """Start a VMM from ``snap``; ``private`` maps RAM copy-on-write (fork children)."""
        ...

    async def kill(self) -> None:
        """Kill the VMM process (by the pid it started) and remove its sockets. Idempotent."""
        ...
