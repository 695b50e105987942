"""Where a new sandbox goes: filter, score, order; the edge still has the final say.

Filter: healthy edges that offer the backend and, by their last report, have room for the
memory asked for. Score: the memory left after what the edge reported plus what this
apiserver placed there since that report (so a burst between two heartbeats does not pile
onto one edge). Order: ``spread`` puts the emptiest edge first, ``pack`` the fullest that
still fits (to keep whole nodes free); ties are broken at random so several apiservers do
not all pick the same edge. The caller tries them in order and moves on when an edge
answers "node full".
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsec.core.errors import BackendUnavailable, InvalidArgument, NodeFull, Unavailable

if TYPE_CHECKING:
    from dsec.apiserver.upstream import EdgeEntry

POLICIES = ("spread", "pack")
MEMORY_OVERCOMMIT = 4.0
_FORGET_S = 30.0


@dataclass
class Placement:
    policy: str = "spread"
    _recent: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidArgument(f"placement policy must be one of {POLICIES}")

    def placed(self, edge_id: str, memory_mb: int) -> None:
        """Remember a placement until the edge's reports include it."""
        self._recent.setdefault(edge_id, []).append((time.time(), memory_mb))

    def _pending(self, e: EdgeEntry) -> int:
        recent = self._recent.get(e.edge_id)
        if not recent:
            return 0
        seen = e.view.last_seen
        recent[:] = [r for r in recent if r[0] > seen and r[0] > time.time() - _FORGET_S]
        return sum(m for _, m in recent)

    def order(self, edges: list[EdgeEntry], backend: str, memory_mb: int) -> list[EdgeEntry]:
        healthy = [e for e in edges if e.healthy]
        if not healthy:
            raise Unavailable("no healthy edge is reporting to the watcher")
        offer = [e for e in healthy if backend in e.view.status.backends]
        if not offer:
            offered = sorted({b for e in healthy for b in e.view.status.backends})
            raise BackendUnavailable(
                f"no edge offers backend {backend!r} (offered: {', '.join(offered) or 'none'})"
            )

        def free(e: EdgeEntry) -> float:
            s = e.view.status
            total = s.memory_total_mb * MEMORY_OVERCOMMIT
            return total - s.memory_allocated_mb - self._pending(e)

        scored = [(free(e), random.random(), e) for e in offer]
        fit = [t for t in scored if t[0] >= memory_mb]
        if not fit:
            raise NodeFull(f"no edge has {memory_mb} MiB free for this sandbox")
        fit.sort(key=lambda t: (t[0], t[1]), reverse=self.policy == "spread")
        return [e for _, _, e in fit]
