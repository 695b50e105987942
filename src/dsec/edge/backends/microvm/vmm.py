"""What the microVM backend needs from a virtual machine monitor (QEMU microvm, Firecracker).

The backend builds a ``VmConfig`` (kernel, drives, memory file, agent channel), asks a
driver to boot it, and later to pause, snapshot, restore or kill it. A driver owns exactly
one VMM process; every path it touches is under ``VmConfig.run_dir``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from dsec.core.errors import DeadlineExceeded, SandboxFailed

if TYPE_CHECKING:
    from dsec.edge.backends.microvm.mux import GuestLink

T = TypeVar("T")


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
    """A memory snapshot on disk: guest RAM (``mem_file``) plus device ``state``.

    ``ram_in_file``: the guest RAM is in ``mem_file`` (QEMU's shared RAM file, or the file
    Firecracker writes beside its state); False when it went into the ``state`` stream
    (QEMU running copy-on-write from a template: ``mem_file`` is that template's, not this
    snapshot's)."""

    dir: Path
    mem_file: Path
    state: Path
    ram_in_file: bool = True


class Vmm(Protocol):
    """One VMM process, driven by the microVM backend through these calls only.

    Implemented by :class:`~dsec.edge.backends.microvm.qemu.QemuVmm` and
    :class:`~dsec.edge.backends.microvm.firecracker.FirecrackerVmm`; which one an edge
    uses is :func:`~dsec.edge.backends.microvm.choice.choose_vmm`'s answer to ``--vmm``.
    """

    name: str  # "qemu" | "firecracker"
    disk_format: str  # the writable disk a driver opens: "qcow2" (overlay) or "raw"
    shared_ram: bool  # guest RAM is written back to ``mem_file`` (not copy-on-write)

    @property
    def pid(self) -> int:
        """Host pid of the VMM process (0 when not running)."""
        ...

    def alive(self) -> bool: ...

    def channel_socket(self, run_dir: Path) -> Path:
        """Where the VMM serves the agent channel's host end (``VmConfig.agent_socket``)."""
        ...

    def link(self, config: VmConfig) -> GuestLink:
        """The runtime channel to the guest's multiplexer, for :class:`mux.HostMux`."""
        ...

    def cmdline(self, base: str) -> str:
        """The kernel command line for ``base`` plus what this VMM's guests need."""
        ...

    async def boot(self, config: VmConfig, timeout_s: float) -> None:
        """Start the VMM and the guest; on failure kill the VMM, leave nothing, raise."""
        ...

    async def snapshot(self, dest: Path) -> Snapshot:
        """Pause the guest and write its snapshot under ``dest`` (the VMM stays paused)."""
        ...

    async def own_ram(self, config: VmConfig, timeout_s: float) -> dict[str, float] | None:
        """Give a guest whose RAM is mapped copy-on-write a RAM file of its own
        (``config.mem_file``, ``shared_ram`` from then on) so a snapshot need not write its
        RAM; the guest is left stopped. Returns how long it took (phases, ms), or None
        when there is nothing to do (RAM already shared, or the VMM cannot)."""
        ...

    def saved_snapshot(self, dest: Path, mem_file: Path) -> Snapshot:
        """The snapshot ``snapshot(dest)`` wrote, for a VMM that has quit since
        (``mem_file``: the guest RAM file of the VM it was taken of)."""
        ...

    async def restore(
        self,
        config: VmConfig,
        snap: Snapshot,
        *,
        private: bool,
        timeout_s: float,
        check: Callable[[], None] | None = None,
        on_listening: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Start a VMM from ``snap`` and run it. ``private`` maps RAM copy-on-write: a
        fork child from a snapshot. ``check`` (blocking: run in a thread while the VMM
        starts) must pass before any state is loaded. ``on_listening`` is awaited once
        the VMM serves the agent channel (QEMU: before the guest runs, so the link is
        up when it does; Firecracker: after it resumed). On failure nothing is left."""
        ...

    async def adopt(self, run_dir: Path, mem_file: Path, shared_ram: bool) -> bool:
        """Re-attach to the VMM an earlier edge started in ``run_dir``; False when gone."""
        ...

    async def resume(self) -> None:
        """Let a guest stopped by :meth:`snapshot` run on in the same VMM."""
        ...

    async def kill(self) -> None:
        """Kill the VMM process (by the pid it started) and remove its sockets. Idempotent."""
        ...

    def failure(self, what: str) -> SandboxFailed:
        """A clear error for ``what`` with the guest's console and the VMM's log."""
        ...

    def console(self) -> str:
        """The last lines of the guest's console."""
        ...

    def panicked(self) -> str | None:
        """The guest kernel's panic line, if it panicked."""
        ...


async def watched(vmm: Vmm, aw: Awaitable[T], timeout_s: float) -> T:
    """Await ``aw`` unless the VMM exits first or ``timeout_s`` passes (then raise)."""
    task: asyncio.Future[T] = asyncio.ensure_future(aw)
    deadline = time.monotonic() + timeout_s
    try:
        while not task.done():
            if not vmm.alive():
                raise vmm.failure(f"{vmm.name} exited")
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"microVM not up after {timeout_s:.0f} s; console:\n{vmm.console()}"
                )
            await asyncio.wait({task}, timeout=0.02)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def netns_path(netns: str) -> str:
    """A network namespace given as a file path or as a name under /var/run/netns."""
    return netns if "/" in netns else f"/var/run/netns/{netns}"
