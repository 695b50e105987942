"""Node-level admission: may this edge take one more sandbox?

The edge has the final say (the apiserver tries another edge on :class:`NodeFull`). Limits
are caps, not reservations, so CPU and memory may be overcommitted by configured factors;
a single sandbox may never ask for more than the whole node.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsec.core.errors import InvalidArgument, NodeFull
from dsec.core.spec import SandboxSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCapacity:
    cpu_total: float
    memory_total_mb: int
    max_sandboxes: int = 2000
    cpu_overcommit: float = 16.0
    memory_overcommit: float = 4.0


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLoad:
    sandboxes: int
    cpu: float
    memory_mb: int


def admit(cap: NodeCapacity, load: NodeLoad, spec: SandboxSpec) -> None:
    """Raise InvalidArgument if the spec can never fit this node, NodeFull if not now."""
    if spec.cpu > cap.cpu_total:
        raise InvalidArgument(f"cpu={spec.cpu:g} exceeds this node's {cap.cpu_total:g} cores")
    if spec.memory_mb > cap.memory_total_mb:
        raise InvalidArgument(
            f"memory_mb={spec.memory_mb} exceeds this node's {cap.memory_total_mb} MiB"
        )
    if load.sandboxes + 1 > cap.max_sandboxes:
        raise NodeFull(f"node runs its maximum of {cap.max_sandboxes} sandboxes")
    if load.cpu + spec.cpu > cap.cpu_total * cap.cpu_overcommit:
        raise NodeFull(
            f"node cpu allocation would reach {load.cpu + spec.cpu:g} of "
            f"{cap.cpu_total * cap.cpu_overcommit:g} (overcommit {cap.cpu_overcommit:g}x)"
        )
    if load.memory_mb + spec.memory_mb > cap.memory_total_mb * cap.memory_overcommit:
        raise NodeFull(
            f"node memory allocation would reach {load.memory_mb + spec.memory_mb} MiB of "
            f"{int(cap.memory_total_mb * cap.memory_overcommit)} MiB"
        )
