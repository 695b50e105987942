"""Where a new sandbox goes: filter, score, order; the edge still has the final say.

Filter: healthy edges that offer the backend and, by their last report, have room for the
memory asked for. Score: the memory left after what the edge reported plus what this
apiserver placed there since that report (so a burst between two heartbeats does not pile
onto one edge; what a report already includes is dropped when a new view of the reports
arrives, so scoring an edge is one lookup). Order: ``spread`` puts the emptiest edge first (of
:data:`SPREAD_SAMPLE` edges picked at random when there are more: the power of K choices,
which spreads nearly as evenly at a fraction of the cost), ``pack`` the fullest that
still fits (to keep whole nodes free); ties are broken at random so several apiservers do
not all pick the same edge. The caller tries them in order and moves on when an edge
answers "node full".
"""

from __future__ import annotations

import operator
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsec.core.errors import BackendUnavailable, InvalidArgument, NodeFull, Unavailable

if TYPE_CHECKING:
    from dsec.apiserver.upstream import EdgeEntry

POLICIES = ("spread", "pack")
MEMORY_OVERCOMMIT = 4.0
_FORGET_S = 30.0
SPREAD_SAMPLE = 16  # spread scores this many edges picked at random, not all of them
_Scored = tuple[float, float, "EdgeEntry"]
_SCORE = operator.itemgetter(0, 1)  # room, then the random tie-break


@dataclass(frozen=True, slots=True)
class _Offer:
    """What one edge's last report says, read once per view (protobuf reads are slow)."""

    entry: EdgeEntry
    backends: frozenset[str]
    room_mb: float  # memory (overcommitted) not allocated at the report
    seen: float


@dataclass
class Placement:
    policy: str = "spread"
    _recent: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    _pending: dict[str, int] = field(default_factory=dict)  # sum of _recent's MiB
    _view: list[EdgeEntry] | None = None
    _offers: list[_Offer] = field(default_factory=list)
    _by_backend: dict[str, list[_Offer]] = field(default_factory=dict)  # of _offers
    _shuffled: dict[str, tuple[list[_Offer], int]] = field(default_factory=dict)  # (of those, next)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidArgument(f"placement policy must be one of {POLICIES}")

    def placed(self, edge_id: str, memory_mb: int) -> None:
        """Remember a placement until the edge's reports include it."""
        self._recent.setdefault(edge_id, deque()).append((time.time(), memory_mb))
        self._pending[edge_id] = self._pending.get(edge_id, 0) + memory_mb

    def _forget_reported(self, seen: dict[str, float], now: float) -> None:
        """Drop the placements a report includes (made before it), or older than _FORGET_S."""
        for edge_id, recent in list(self._recent.items()):
            cutoff = max(seen.get(edge_id, 0.0), now - _FORGET_S)
            total = self._pending[edge_id]
            while recent and recent[0][0] <= cutoff:
                total -= recent.popleft()[1]
            if recent:
                self._pending[edge_id] = total
            else:
                del self._recent[edge_id], self._pending[edge_id]

    def _offers_of(self, edges: list[EdgeEntry]) -> list[_Offer]:
        if edges is not self._view:  # a new view from the watcher
            self._view = edges
            self._offers = [
                _Offer(e, frozenset(e.view.status.backends),
                       e.view.status.memory_total_mb * MEMORY_OVERCOMMIT
                       - e.view.status.memory_allocated_mb, e.view.last_seen)
                for e in edges if e.healthy
            ]  # fmt: skip
            self._by_backend = {}
            self._shuffled = {}
            self._forget_reported({o.entry.edge_id: o.seen for o in self._offers}, time.time())
        return self._offers

    def _fit(self, offer: list[_Offer], memory_mb: int) -> list[_Scored]:
        out = []
        pending, rnd = self._pending, random.random
        for o in offer:
            room = o.room_mb - pending.get(o.entry.edge_id, 0)
            if room >= memory_mb:
                out.append((room, rnd(), o.entry))
        return out

    def _sample(self, backend: str, offer: list[_Offer]) -> list[_Offer]:
        """The next SPREAD_SAMPLE offers of a shuffled copy of ``offer`` (each sample a random
        subset, without drawing SPREAD_SAMPLE random numbers for each create)."""
        shuffled, at = self._shuffled.get(backend, ([], 0))
        if at + SPREAD_SAMPLE > len(shuffled):
            shuffled, at = random.sample(offer, len(offer)), 0
        self._shuffled[backend] = (shuffled, at + SPREAD_SAMPLE)
        return shuffled[at : at + SPREAD_SAMPLE]

    def order(
        self, edges: list[EdgeEntry], backend: str, memory_mb: int, *, limit: int = 0
    ) -> list[EdgeEntry]:
        """The edges to try, best first (the first ``limit`` of them, if given)."""
        healthy = self._offers_of(edges)
        if not healthy:
            raise Unavailable("no healthy edge is reporting to the watcher")
        offer = self._by_backend.get(backend)
        if offer is None:
            offer = self._by_backend[backend] = [o for o in healthy if backend in o.backends]
        if not offer:
            offered = sorted({b for o in healthy for b in o.backends})
            raise BackendUnavailable(
                f"no edge offers backend {backend!r} (offered: {', '.join(offered) or 'none'})"
            )
        fit = []
        if self.policy == "spread" and len(offer) > SPREAD_SAMPLE:
            fit = self._fit(self._sample(backend, offer), memory_mb)
        if not fit:  # pack looks at every edge; so does spread when its sample is full
            fit = self._fit(offer, memory_mb)
        if not fit:
            raise NodeFull(f"no edge has {memory_mb} MiB free for this sandbox")
        fit.sort(key=_SCORE, reverse=self.policy == "spread")  # a few dozen: cheaper than heapq's
        return [e for _, _, e in fit[: limit or len(fit)]]
