"""The ``dsec.v1.Watcher`` gRPC servicer over an :class:`EdgeRegistry`.

``Report`` is for edges only, and only about themselves: the ``edge_id`` in the report must
be the name in the caller's certificate (``spiffe://dsec/edge/<edge_id>``). ``ListEdges``
is for the apiserver and admins.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeAlias

import grpc

from dsec.obs import Metrics
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.server import require_peer
from dsec.watcher.registry import EdgeRegistry

_Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

ALLOWED_ROLES: dict[str, set[str]] = {
    "/dsec.v1.Watcher/Report": {"edge"},
    "/dsec.v1.Watcher/ListEdges": {"apiserver", "admin"},
}


class WatcherService(pb_grpc.WatcherServicer):
    """Serves Report and ListEdges; keeps the edge-count gauges of ``metrics`` current."""

    def __init__(
        self,
        registry: EdgeRegistry,
        *,
        metrics: Metrics | None = None,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.metrics = metrics or Metrics("dsec_watcher")
        self._wall = wall
        self._mono = mono

    async def Report(self, request: pb.EdgeStatus, context: _Ctx) -> pb.Empty:
        require_peer(context, "edge", request.edge_id)
        if self.registry.report(request, self._wall(), self._mono()):
            self.update_gauges()  # otherwise the sweep (every second) and ListEdges do
        self.metrics.inc("reports", edge=request.edge_id)
        return pb.Empty()

    async def ListEdges(self, request: pb.Empty, context: _Ctx) -> pb.EdgeViewList:
        self.update_gauges()
        return pb.EdgeViewList(edges=self.registry.views(self._mono()))

    def update_gauges(self) -> None:
        total, healthy = self.registry.counts(self._mono())
        self.metrics.set("edges", float(total))
        self.metrics.set("edges_healthy", float(healthy))
