"""The apiserver's cached view of the edges: one ListEdges however many requests find the
cache expired at once, its failure reported to each of them, and ``fresh`` always asking."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from dsec.apiserver import upstream as upstream_mod
from dsec.apiserver.upstream import Upstream
from dsec.core.errors import Unavailable
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.tls import Identity, ensure_pki


class _Watcher:
    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    async def ListEdges(self, request: pb.Empty, timeout: float) -> pb.EdgeViewList:
        self.calls += 1
        await asyncio.sleep(0.05)
        if self.fail:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down"
            )
        status = pb.EdgeStatus(edge_id=f"e{self.calls}", address="127.0.0.1:1")
        return pb.EdgeViewList(edges=[pb.EdgeView(status=status, healthy=True)])


@pytest.mark.asyncio
async def test_one_list_for_many_callers_and_failures_reach_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ensure_pki(tmp_path, [Identity.singleton("apiserver")])
    up = Upstream(tmp_path, iam="127.0.0.1:1", watcher="127.0.0.1:1")
    watcher = _Watcher()
    up.watcher = watcher  # type: ignore[assignment]
    try:
        views: list[Any] = await asyncio.gather(*(up.edges() for _ in range(32)))
        assert watcher.calls == 1
        assert all(v is views[0] for v in views)
        assert [e.edge_id for e in views[0]] == ["e1"]
        assert await up.edges() is views[0]  # cached: no call
        assert watcher.calls == 1
        assert [e.edge_id for e in await up.edges(fresh=True)] == ["e2"]
        monkeypatch.setattr(upstream_mod, "EDGE_VIEW_TTL_S", 0.0)
        watcher.fail = True
        got = await asyncio.gather(*(up.edges() for _ in range(8)), return_exceptions=True)
        assert watcher.calls == 3
        assert all(isinstance(g, Unavailable) for g in got)
        watcher.fail = False
        assert [e.edge_id for e in await up.edges()] == ["e4"]  # the next caller asks again
    finally:
        await up.aclose()
