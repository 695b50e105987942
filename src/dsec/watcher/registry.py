"""The watcher's view of the edges: the latest status of each, when it came, and health.

An edge is healthy while its last report is at most ``timeout_s`` old. An edge that stops
reporting stays in the view, marked unhealthy, until someone forgets it on purpose; the
view is saved to a JSON file so a restarted watcher still lists edges that went silent
while it was down (as unhealthy until they report again).

Time comes in as parameters: ``now`` (wall clock, shown to clients as ``last_seen``) and
``mono`` (monotonic, used for health so clock jumps cannot revive or kill an edge).
"""

from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from dsec.core.errors import InvalidArgument
from dsec.core.ids import validate_edge_id
from dsec.rpc._gen import dsec_pb2 as pb

DEFAULT_TIMEOUT_S = 6.0


@dataclass(frozen=True, slots=True)
class EdgeEntry:
    """One edge as last seen; ``status`` must not be mutated."""

    status: pb.EdgeStatus
    last_seen: float  # wall clock of the last report
    last_seen_mono: float  # monotonic clock of the last report; -inf if none since start

    def healthy(self, mono: float, timeout_s: float) -> bool:
        return mono - self.last_seen_mono <= timeout_s


@dataclass(frozen=True, slots=True)
class Transition:
    """An edge whose health changed between two sweeps."""

    edge_id: str
    healthy: bool
    last_seen: float


class EdgeRegistry:
    """The latest report of every edge ever seen; not thread-safe (one event loop)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise InvalidArgument("health timeout must be > 0")
        self.timeout_s = timeout_s
        self._edges: dict[str, EdgeEntry] = {}
        self._healthy: dict[str, bool] = {}
        self.dirty = False

    def report(self, status: pb.EdgeStatus, now: float, mono: float) -> bool:
        """Store ``status`` as the edge's latest; returns whether the edge is new to the view.
        Raises InvalidArgument for a bad edge id."""
        validate_edge_id(status.edge_id)
        copy = pb.EdgeStatus()
        copy.CopyFrom(status)
        new = status.edge_id not in self._edges
        self._edges[status.edge_id] = EdgeEntry(copy, now, mono)
        self.dirty = True
        return new

    def forget(self, edge_id: str) -> bool:
        """Drop an edge from the view on purpose; returns whether it was there."""
        self._healthy.pop(edge_id, None)
        self.dirty = True
        return self._edges.pop(edge_id, None) is not None

    def entries(self) -> list[EdgeEntry]:
        return [self._edges[k] for k in sorted(self._edges)]

    def views(self, mono: float) -> list[pb.EdgeView]:
        """Every edge, sorted by id, with its health at ``mono``."""
        return [
            pb.EdgeView(
                status=e.status, healthy=e.healthy(mono, self.timeout_s), last_seen=e.last_seen
            )
            for e in self.entries()
        ]

    def counts(self, mono: float) -> tuple[int, int]:
        """(edges known, edges healthy) at ``mono``."""
        healthy = sum(e.healthy(mono, self.timeout_s) for e in self._edges.values())
        return len(self._edges), healthy

    def sweep(self, mono: float) -> list[Transition]:
        """Edges whose health changed since the previous sweep (new edges count as changed)."""
        out: list[Transition] = []
        for edge_id, e in sorted(self._edges.items()):
            now_ok = e.healthy(mono, self.timeout_s)
            if self._healthy.get(edge_id) != now_ok:
                self._healthy[edge_id] = now_ok
                out.append(Transition(edge_id, now_ok, e.last_seen))
        return out

    def save(self, path: Path) -> None:
        """Write the view to ``path`` atomically and clear ``dirty``."""
        doc = {
            "edges": [
                {"status": json_format.MessageToDict(e.status), "last_seen": e.last_seen}
                for e in self.entries()
            ]
        }
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            tmp.write_text(json.dumps(doc, separators=(",", ":")))  # C encoder: no indent
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.dirty = False

    def load(self, path: Path) -> int:
        """Add the edges saved in ``path`` as not seen since start; returns how many.

        A missing file is an empty view; a damaged one raises InvalidArgument.
        """
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"cannot read watcher state {path}: {e}") from e
        n = 0
        for item in doc.get("edges", []):
            try:
                status = json_format.ParseDict(item["status"], pb.EdgeStatus())
                validate_edge_id(status.edge_id)
                last_seen = float(item["last_seen"])
            except (KeyError, TypeError, ValueError, json_format.ParseError, InvalidArgument):
                continue
            if status.edge_id not in self._edges:
                self._edges[status.edge_id] = EdgeEntry(status, last_seen, -math.inf)
                n += 1
        return n
