"""What the edge says about its backends: every known one, available or not, and why.

A backend this edge was built without (no implementation yet) is listed as unavailable
with that reason, so ``dsec backends`` always shows the four substrates of the switch.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dsec.core.spec import BACKENDS
from dsec.edge.backends.api import Availability, Backend, Capabilities, capabilities_of
from dsec.rpc._gen import dsec_pb2 as pb


@dataclass(frozen=True, slots=True)
class BackendReport:
    name: str
    availability: Availability
    capabilities: Capabilities


class CreateTimes:
    """How long this edge's last creates of each backend took (create -> agent answered;
    not restores or forks): their median replaces a backend's own ``create_seconds``
    estimate once there are ``least`` of them, so the hint says what creates take here."""

    def __init__(self, keep: int = 16, least: int = 3) -> None:
        self._keep = keep
        self._least = least
        self._seen: dict[str, deque[float]] = {}

    def note(self, backend: str, seconds: float) -> None:
        self._seen.setdefault(backend, deque(maxlen=self._keep)).append(seconds)

    def median(self, backend: str) -> float | None:
        seen = self._seen.get(backend, ())
        return statistics.median(seen) if len(seen) >= self._least else None


def report(
    candidates: Sequence[Backend], measured: CreateTimes | None = None
) -> list[BackendReport]:
    """One entry per known backend name (in ``BACKENDS`` order), then any others;
    ``measured``: the edge's create times (see :class:`CreateTimes`)."""
    by_name = {b.name: b for b in candidates}
    names = list(BACKENDS) + sorted(set(by_name) - set(BACKENDS))
    out: list[BackendReport] = []
    for name in names:
        backend = by_name.get(name)
        if backend is None:
            missing = Availability(False, "not implemented on this edge")
            out.append(BackendReport(name, missing, Capabilities()))
            continue
        try:
            avail = backend.availability()
        except Exception as exc:  # a broken check must not hide the other backends
            avail = Availability(False, f"availability check failed: {exc}")
        caps = capabilities_of(backend)
        took = measured.median(name) if measured is not None else None
        if took is not None:
            caps = replace(caps, create_seconds=round(took, 2))
        out.append(BackendReport(name, avail, caps))
    return out


def caps_to_pb(c: Capabilities) -> pb.BackendCapabilities:
    return pb.BackendCapabilities(
        pause=c.pause,
        fork=c.fork,
        snapshot=c.snapshot,
        pty=c.pty,
        persistent_processes=c.persistent_processes,
        persistent_filesystem=c.persistent_filesystem,
        network_policy=c.network_policy,
        max_vcpus=c.max_vcpus,
        max_memory_mb=c.max_memory_mb,
        min_memory_mb=c.min_memory_mb,
        min_vcpus=c.min_vcpus,
        create_seconds=c.create_seconds,
        notes=c.notes,
    )


def to_pb(edge_id: str, reports: Sequence[BackendReport]) -> pb.BackendList:
    return pb.BackendList(
        edge_id=edge_id,
        backends=[
            pb.BackendInfo(
                name=r.name,
                available=r.availability.available,
                reason=r.availability.reason,
                capabilities=caps_to_pb(r.capabilities),
            )
            for r in reports
        ],
    )
