"""Creates over the apiserver's kept ``CreateStream`` to an edge (``dsec.apiserver.edge_stream``
against ``dsec.edge.create_stream``), on a real grpc.aio server with mTLS on loopback: many
creates share one stream and each gets its own answer; deadlines and cancellation reach
the edge; an edge gone mid-create fails its creates ``Unavailable`` and the stream comes
back with the edge; an edge without the stream gets unary creates; the stream is
authorized like a call, and each message again."""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from dsec.apiserver.edge_stream import EdgeStream
from dsec.core.errors import (
    DeadlineExceeded,
    Internal,
    NodeFull,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from dsec.edge.create_stream import CreateStreamServicer
from dsec.edge.service import caller_of
from dsec.obs import Metrics
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.client import secure_channel
from dsec.rpc.server import authorize_each_message, make_server, server_port
from dsec.rpc.tls import Identity, ensure_pki
from tests.waits import auntil

pytestmark = pytest.mark.timeout(120)
EDGE = "e0a1"
ROLES = {"dsec.v1.Edge": {"apiserver"}}


@dataclass
class Edge(CreateStreamServicer):
    """A create handler whose behaviour each create's ``owner`` picks: ``""`` creates (after
    a random moment), ``full`` answers node full, ``hang`` never answers, ``bug`` raises."""

    started: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    streams: int = 0

    async def CreateSandbox(self, request: pb.CreateSandboxRequest, context: Any) -> pb.SandboxInfo:
        caller = caller_of(context)  # what EdgeService.CreateSandbox reads of its call
        self.started.append(request.sandbox_id)
        try:
            if request.owner == "hang":
                await asyncio.sleep(3600)
            await asyncio.sleep(random.random() * 0.02)
        except asyncio.CancelledError:
            self.cancelled.append(request.sandbox_id)
            raise
        if request.owner == "full":
            raise NodeFull(f"edge {EDGE} runs its maximum of sandboxes")
        if request.owner == "bug":
            raise KeyError("a bug")
        return pb.SandboxInfo(id=request.sandbox_id, project=caller.project,
                              owner=caller.subject, state="running", edge_id=EDGE)  # fmt: skip

    @authorize_each_message
    async def CreateStream(
        self, request_iterator: AsyncIterator[pb.CreateStreamRequest], context: Any
    ) -> AsyncIterator[pb.CreateStreamReply]:
        self.streams += 1
        async for reply in super().CreateStream(request_iterator, context):
            yield reply


class OldEdge:
    """An edge from before CreateStream: its Edge service has no such method."""

    async def CreateSandbox(self, request: pb.CreateSandboxRequest, context: Any) -> pb.SandboxInfo:
        return pb.SandboxInfo(id=request.sandbox_id, state="running", edge_id=EDGE)

    def register(self, server: grpc.aio.Server) -> None:
        create = grpc.unary_unary_rpc_method_handler(
            self.CreateSandbox,
            request_deserializer=pb.CreateSandboxRequest.FromString,
            response_serializer=pb.SandboxInfo.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("dsec.v1.Edge", {"CreateSandbox": create}),)
        )


@dataclass
class Served:
    pki: Path  # the apiserver's
    server_pki: Path
    edge: Any = field(init=False)
    metrics: Metrics = field(init=False)
    server: grpc.aio.Server = field(init=False)
    port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, edge: Any, port: int = 0) -> None:
        self.edge, self.metrics = edge, Metrics("edge")
        self.server = make_server(self.server_pki, EDGE, f"127.0.0.1:{port}", ROLES,
                                  metrics=self.metrics)  # fmt: skip
        if isinstance(edge, OldEdge):
            edge.register(self.server)
        else:
            pb_grpc.add_EdgeServicer_to_server(edge, self.server)
        await self.server.start()
        self.port = server_port(self.server)

    def calls(self, method: str) -> float:
        prefix = f'edge_rpc_requests_total{{code="OK",method="Edge/{method}"}} '
        for line in self.metrics.render().splitlines():
            if line.startswith(prefix):
                return float(line.removeprefix(prefix))
        return 0.0


async def _serve(tmp_path: Path, edge: Any) -> Served:
    pki = tmp_path / "pki"
    ensure_pki(pki, [Identity.singleton("apiserver"), Identity.singleton("watcher"),
                     Identity.edge(EDGE)])  # fmt: skip
    server_pki = tmp_path / "edge-pki"  # its own copy, as on another machine
    shutil.copytree(pki, server_pki)
    served = Served(pki, server_pki)
    await served.start(edge)
    return served


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    s = await _serve(tmp_path, Edge())  # type: ignore[abstract]
    yield s
    await s.server.stop(None)


def _stream(s: Served, name: str = "apiserver") -> EdgeStream:
    return EdgeStream(secure_channel(s.pki, name, s.target, translate=False), f"edge {EDGE}")


def _req(n: int, owner: str = "") -> pb.CreateSandboxRequest:
    return pb.CreateSandboxRequest(sandbox_id=f"sbx-{EDGE}-{n:020d}", owner=owner,
                                   spec=pb.SandboxSpec(cpu=0.1, memory_mb=64))  # fmt: skip


def _md(n: int) -> tuple[tuple[str, str], ...]:
    return (("x-dsec-project", f"p{n}"), ("x-dsec-subject", f"user{n}"), ("x-dsec-role", "member"))


@pytest.mark.asyncio
async def test_concurrent_creates_share_one_stream_and_each_gets_its_own_answer(
    served: Served,
) -> None:
    creates = _stream(served)
    n = 300
    owners = ["full" if i % 10 == 3 else "bug" if i == 7 else "" for i in range(n)]
    results = await asyncio.gather(
        *(creates.create(_req(i, owners[i]), _md(i), 30) for i in range(n)),
        return_exceptions=True,
    )
    for i, got in enumerate(results):
        if owners[i] == "full":
            assert isinstance(got, NodeFull), got
            assert "maximum" in got.message
        elif owners[i] == "bug":
            assert isinstance(got, Internal)
            assert "Edge/CreateSandbox: KeyError" in got.message
        else:  # its own sandbox, created with its own caller's metadata
            assert isinstance(got, pb.SandboxInfo), got
            assert (got.id, got.project, got.owner) == (_req(i).sandbox_id, f"p{i}", f"user{i}")
    assert sorted(served.edge.started) == sorted(_req(i).sandbox_id for i in range(n))  # once each
    assert served.edge.streams == 1
    assert served.calls("CreateSandbox") == 0  # not one unary call
    await creates.aclose(channel=True)


@pytest.mark.asyncio
async def test_deadline_and_cancellation_reach_the_edge(served: Served) -> None:
    creates = _stream(served)
    got = await creates.create(_req(0), _md(0), 10)  # the stream is open: the deadline below
    assert got.id == _req(0).sandbox_id  # times the hanging request alone
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(DeadlineExceeded, match=f"edge {EDGE}"):
        await creates.create(_req(1, "hang"), _md(1), 0.5)
    assert 0.45 < loop.time() - t0 < 5
    await auntil(lambda: _req(1).sandbox_id in served.edge.cancelled)  # stopped there too
    waiting = asyncio.ensure_future(creates.create(_req(2, "hang"), _md(2), 60))
    await auntil(lambda: _req(2).sandbox_id in served.edge.started)
    waiting.cancel()  # e.g. the user's request was dropped
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await auntil(lambda: _req(2).sandbox_id in served.edge.cancelled)
    got = await creates.create(_req(3), _md(3), 10)  # the stream is still fine
    assert got.id == _req(3).sandbox_id
    assert served.edge.streams == 1
    await creates.aclose(channel=True)


@pytest.mark.asyncio
async def test_an_edge_gone_mid_create_fails_them_unavailable_and_the_stream_comes_back(
    served: Served,
) -> None:
    creates = _stream(served)
    assert (await creates.create(_req(0), _md(0), 10)).id == _req(0).sandbox_id
    loop = asyncio.get_running_loop()
    inflight = [asyncio.ensure_future(creates.create(_req(i, "hang"), _md(i), 60))
                for i in range(1, 6)]  # fmt: skip
    await auntil(lambda: len(served.edge.started) == 6)
    t0 = loop.time()
    await served.server.stop(None)  # the edge goes away with five creates running
    for f in inflight:
        with pytest.raises(Unavailable, match=f"edge {EDGE}"):
            await f
    assert loop.time() - t0 < 5  # at once, not at their deadline
    assert sorted(served.edge.started) == sorted(_req(i).sandbox_id for i in range(6))
    with pytest.raises(Unavailable):  # down: refused at once, as a unary call is
        await creates.create(_req(6), _md(6), 10)
    old = served.edge
    await served.start(Edge(), served.port)  # type: ignore[abstract]  # back, same address
    got: pb.SandboxInfo | None = None
    for _ in range(100):  # the channel reconnects (with backoff); each try fails clearly
        try:
            got = await creates.create(_req(7), _md(7), 10)
            break
        except Unavailable:
            await asyncio.sleep(0.1)
    assert got is not None
    assert got.id == _req(7).sandbox_id
    assert served.edge.started == [_req(7).sandbox_id]
    assert served.edge.streams == 1
    assert _req(6).sandbox_id not in old.started  # sent nowhere
    await creates.aclose(channel=True)


@pytest.mark.asyncio
async def test_an_edge_without_the_stream_gets_unary_creates(tmp_path: Path) -> None:
    served = await _serve(tmp_path, OldEdge())
    try:
        creates = _stream(served)
        for i in range(3):
            assert (await creates.create(_req(i), _md(i), 10)).id == _req(i).sandbox_id
        assert served.calls("CreateSandbox") == 3
        await creates.aclose(channel=True)
    finally:
        await served.server.stop(None)


@pytest.mark.asyncio
async def test_the_stream_is_authorized_as_a_call_is_and_each_message_again(
    served: Served,
) -> None:
    watcher = _stream(served, "watcher")  # a role the edge does not take creates from
    for i in range(2):
        with pytest.raises(PermissionDenied, match="spiffe://dsec/watcher/watcher"):
            await watcher.create(_req(i), _md(i), 10)
    assert served.edge.started == []
    await watcher.aclose(channel=True)
    creates = _stream(served)
    assert (await creates.create(_req(2), _md(2), 10)).id == _req(2).sandbox_id
    # The edge's CA bundle no longer holds the CA of the apiserver's certificate (a rotation
    # that dropped it): the open stream is refused from its next create on, as a call is.
    other = served.server_pki.parent / "other-ca"
    ensure_pki(other, [Identity.edge(EDGE)])
    (served.server_pki / "ca.crt").write_bytes((other / "ca.crt").read_bytes())
    await asyncio.sleep(1.2)  # the server looks at its files at most once a second
    with pytest.raises(Unauthenticated, match="not issued by a CA this server trusts"):
        await creates.create(_req(3), _md(3), 10)
    assert served.edge.started == [_req(2).sandbox_id]
    await creates.aclose(channel=True)
