"""The apiserver's view of its peers: iam, the watcher, and every edge (gRPC over mTLS).

Edges are found through the watcher (cached for a second, and fetched once when it expires,
however many requests find it expired); a sandbox id names its edge, so forwarding a call
needs no per-sandbox table.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from dsec.apiserver.edge_stream import EdgeStream
from dsec.apiserver.iam_batch import IamBatch
from dsec.apiserver.placement import Placement
from dsec.core.errors import SandboxNotFound, Unavailable
from dsec.core.ids import edge_of
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.client import secure_channel
from dsec.rpc.errors import translate_rpc_error

T = TypeVar("T")

EDGE_VIEW_TTL_S = 1.0


@dataclass(frozen=True, slots=True)
class EdgeEntry:
    edge_id: str
    address: str
    healthy: bool
    view: pb.EdgeView


async def rpc(component: str, call: Awaitable[T]) -> T:
    """Await a gRPC call, turning its failure into the DsecError the peer meant."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise translate_rpc_error(exc, component) from None


class Upstream:
    def __init__(
        self, pki: Path, *, iam: str, watcher: str, name: str = "apiserver",
        placement: str = "spread",
    ) -> None:  # fmt: skip
        self._pki = pki
        self._name = name
        self._iam_ch = secure_channel(pki, name, iam)
        self._watcher_ch = secure_channel(pki, name, watcher)
        self.iam = pb_grpc.IamStub(self._iam_ch)
        # the hot paths (every create's admission, audit entry and edge create) go over
        # channels without the error-translating interceptor and translate themselves, as
        # messages of kept streams (iam_batch, edge_stream)
        self._iam_plain = secure_channel(pki, name, iam, translate=False)
        self.iam_batch = IamBatch(pb_grpc.IamStub(self._iam_plain), channel=self._iam_plain)
        self.watcher = pb_grpc.WatcherStub(self._watcher_ch)
        self._edge_channels: dict[str, tuple[str, grpc.aio.Channel, pb_grpc.EdgeAsyncStub]] = {}
        self._streams: dict[str, tuple[str, EdgeStream]] = {}
        self._closing: set[asyncio.Future[None]] = set()
        self._view: list[EdgeEntry] = []
        self._view_at = 0.0
        self._fetching: asyncio.Future[list[EdgeEntry]] | None = None
        self.placement = Placement(placement)

    async def edges(self, *, fresh: bool = False) -> list[EdgeEntry]:
        """The edges as the watcher last reported them (``fresh``: asked now)."""
        if fresh:
            return await self._fetch_view()
        if time.monotonic() - self._view_at <= EDGE_VIEW_TTL_S:
            return self._view
        if self._fetching is None:  # one ListEdges for every request that finds it expired
            self._fetching = asyncio.ensure_future(self._fetch_view())
            self._fetching.add_done_callback(self._fetched)
        return await asyncio.shield(self._fetching)

    def _fetched(self, fut: asyncio.Future[list[EdgeEntry]]) -> None:
        self._fetching = None
        if not fut.cancelled():
            fut.exception()  # its waiters got it; not "never retrieved" when none was left

    async def _fetch_view(self) -> list[EdgeEntry]:
        asked = time.monotonic()
        views = await rpc("watcher", self.watcher.ListEdges(pb.Empty(), timeout=5))
        self._view = [
            EdgeEntry(v.status.edge_id, v.status.address, v.healthy, v) for v in views.edges
        ]
        self._view_at = asked
        return self._view

    async def edge_for(self, sandbox_id: str) -> pb_grpc.EdgeAsyncStub:
        edge_id = edge_of(sandbox_id)
        for attempt in (False, True):
            for e in await self.edges(fresh=attempt):
                if e.edge_id == edge_id:
                    if not e.healthy:
                        raise Unavailable(f"edge {edge_id} of sandbox {sandbox_id} is down")
                    return self.edge_stub(e)
        raise SandboxNotFound(f"no sandbox {sandbox_id} (its edge {edge_id} is unknown)")

    def edge_stream(self, entry: EdgeEntry) -> EdgeStream:
        """The edge's creates (:mod:`dsec.apiserver.edge_stream`): one kept stream per edge,
        over a channel without the error-translating interceptor."""
        cached = self._streams.get(entry.edge_id)
        if cached is not None and cached[0] == entry.address:
            return cached[1]
        if cached is not None:  # the edge came back at another address
            closing = asyncio.ensure_future(cached[1].aclose(channel=True))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        channel = secure_channel(self._pki, self._name, entry.address, translate=False)
        stream = EdgeStream(channel, f"edge {entry.edge_id}")
        self._streams[entry.edge_id] = (entry.address, stream)
        return stream

    def edge_stub(self, entry: EdgeEntry) -> pb_grpc.EdgeAsyncStub:
        """The edge's stub (its unary calls raise DsecErrors)."""
        cached = self._edge_channels.get(entry.edge_id)
        if cached is not None and cached[0] == entry.address:
            return cached[2]
        ch = secure_channel(self._pki, self._name, entry.address)
        stub = pb_grpc.EdgeStub(ch)
        self._edge_channels[entry.edge_id] = (entry.address, ch, stub)
        return stub

    async def aclose(self) -> None:
        await self.iam_batch.aclose()
        for _, stream in self._streams.values():
            await stream.aclose(channel=True)
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self._iam_ch.close()
        await self._iam_plain.close()
        await self._watcher_ch.close()
        for _, ch, _ in self._edge_channels.values():
            await ch.close()
