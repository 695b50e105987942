"""The interface every execution backend implements.

The edge owns the lifecycle state machine and persistence; a backend only turns a spec into
a running sandbox whose aether listens on ``SandboxPaths.agent_socket``, and takes it
apart again. Every method is idempotent, so the edge can repeat any of them after a crash.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dsec.core.spec import SandboxSpec

# What a backend accepts as a sandbox id: it names cgroups, sockets and directories.
SANDBOX_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class RuntimeState(enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"  # exists but its init has exited
    MISSING = "missing"  # the backend knows nothing of it


@dataclass(frozen=True, slots=True)
class SandboxPaths:
    """Host paths of one sandbox. ``state_dir`` is durable; ``agent_socket`` is short."""

    state_dir: Path  # e.g. <home>/edge/sandboxes/<id>: rootfs mount, upper, work, config
    agent_socket: Path  # e.g. <run>/sbx/<id>.sock: created by the backend, host-only


@dataclass(frozen=True, slots=True)
class Started:
    pid: int  # host pid of the sandbox's init (for pidfd watching)
    # The image's Entrypoint + Cmd when it has an Entrypoint: the edge starts it as the
    # background process tagged "main" once the agent answers (see docs/images.md).
    main: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Availability:
    available: bool
    reason: str  # why not, or a note such as "cgroup mode hybrid, crun via private mntns"


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend's sandboxes can do (the defaults describe a backend that can't).

    ``max_vcpus``/``max_memory_mb`` of 0 mean "bounded by the host only"; ``min_memory_mb``
    is the least memory a sandbox of the backend starts with (0: no minimum of its own).
    Two hints for callers sizing work (benchmarks, schedulers), not enforced:
    ``min_vcpus`` is the least CPU share a sandbox starts in reasonable time with (a full
    VM boots systemd; at a quarter core that took minutes), ``create_seconds`` roughly how
    long a create takes on an idle host (0 for either: no hint, a create is cheap); the
    edge reports the median of its own recent creates instead once it has made a few
    (``backend_report.CreateTimes``).
    """

    pause: bool = False
    fork: bool = False
    snapshot: bool = False
    pty: bool = False
    persistent_processes: bool = False
    persistent_filesystem: bool = False
    network_policy: bool = False
    max_vcpus: float = 0.0
    max_memory_mb: int = 0
    min_memory_mb: int = 0
    min_vcpus: float = 0.0
    create_seconds: float = 0.0
    notes: str = ""

    def to_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def capabilities_of(backend: object) -> Capabilities:
    """A backend's capabilities; one written before ``capabilities()`` existed can't do much."""
    fn = getattr(backend, "capabilities", None)
    caps = fn() if callable(fn) else None
    return caps if isinstance(caps, Capabilities) else Capabilities()


class Backend(Protocol):
    name: str

    def availability(self) -> Availability: ...

    def capabilities(self) -> Capabilities:
        """What this backend's sandboxes can do (see :class:`Capabilities`)."""
        ...

    async def create(self, sandbox_id: str, spec: SandboxSpec, paths: SandboxPaths) -> Started:
        """Build and start the sandbox; on failure leave nothing behind and raise DsecError."""
        ...

    async def state(self, sandbox_id: str) -> tuple[RuntimeState, int]:
        """Return the runtime state and the host pid of init (0 when not running)."""
        ...

    async def pause(self, sandbox_id: str) -> None: ...

    async def resume(self, sandbox_id: str) -> None: ...

    async def destroy(self, sandbox_id: str, paths: SandboxPaths) -> None:
        """Kill every process, remove cgroups, mounts, sockets and state_dir. Idempotent."""
        ...

    async def usage(self, sandbox_id: str) -> dict[str, float]:
        """Live resource usage: memory_bytes, cpu_seconds, pids (best effort)."""
        ...

    def release_host_setup(self) -> None:
        """Undo node-level setup (namespaces, mounts) once the edge leaves no sandbox."""
        ...
