"""The kept-stream mechanism on its own (``dsec.rpc.kept_stream`` calling
``dsec.rpc.stream_pump`` on a real grpc.aio server on loopback): replies matched to their
requests whatever their order, the unary fallback on UNIMPLEMENTED and its retry, a stream
broken mid-flight, deadlines with and without a cancel message, a retired stream
finishing its requests, and the serving end cancelling its work when the caller goes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import pytest_asyncio

from dsec.core.errors import DeadlineExceeded, DsecError, NodeFull, PermissionDenied, Unavailable
from dsec.rpc import kept_stream
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.kept_stream import KeptStream
from dsec.rpc.stream_pump import Pump
from tests.waits import auntil

pytestmark = pytest.mark.timeout(60)
METHOD = "/test.Kept/Stream"


@dataclass
class Peer:
    """Serves METHOD: a request's ``create.owner`` picks its answer: a number of
    milliseconds to wait and answer, ``full`` (NodeFull), ``hang`` (never). The ids in
    ``turns`` answer in that order, once all of them have come. Its method ``Refused``
    refuses the stream before serving it."""

    turns: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # ids as answered
    cancelled: list[str] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)  # a stream's handler ended
    streams: int = 0

    async def answer(self, msg: pb.CreateStreamRequest) -> pb.CreateStreamReply:
        sid, owner = msg.create.sandbox_id, msg.create.owner
        self.started.append(sid)
        try:
            if sid in self.turns:
                await auntil(lambda: self._my_turn(sid))
            await asyncio.sleep(3600 if owner == "hang" else int(owner.isdigit() and owner) / 1000)
        except asyncio.CancelledError:
            self.cancelled.append(sid)
            raise
        self.order.append(sid)
        if owner == "full":
            err = NodeFull("full")
            return pb.CreateStreamReply(id=msg.id, error_code=err.code, error_message=err.message)
        return pb.CreateStreamReply(id=msg.id, info=pb.SandboxInfo(id=sid))

    def _my_turn(self, sid: str) -> bool:
        return set(self.turns) <= set(self.started) and self.turns[len(self.order)] == sid

    async def handle(
        self, requests: AsyncIterator[pb.CreateStreamRequest], context: Any
    ) -> AsyncIterator[pb.CreateStreamReply]:
        self.streams += 1
        pump: Pump[pb.CreateStreamReply] = Pump()

        def take(msg: pb.CreateStreamRequest) -> None:
            if msg.cancel:
                pump.cancel(msg.id)
            else:
                pump.start(self.answer(msg), msg.id)

        try:
            async for reply in pump.serve(requests, context, take):
                yield reply
        finally:
            self.ended.append(True)

    async def refuse(self, requests: Any, context: Any) -> AsyncIterator[pb.CreateStreamReply]:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not you")
        yield pb.CreateStreamReply()


@dataclass
class Served:
    peer: Peer
    server: grpc.aio.Server
    target: str


async def _serve(peer: Peer, port: int = 0) -> Served:
    server = grpc.aio.server()
    handlers = {
        name: grpc.stream_stream_rpc_method_handler(
            fn,
            request_deserializer=pb.CreateStreamRequest.FromString,
            response_serializer=pb.CreateStreamReply.SerializeToString,
        )
        for name, fn in (("Stream", peer.handle), ("Refused", peer.refuse))
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Kept", handlers),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return Served(peer, server, f"127.0.0.1:{port}")


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    s = await _serve(Peer())
    yield s
    await s.server.stop(None)


_Kept = KeptStream[pb.CreateStreamRequest, pb.SandboxInfo]


@pytest_asyncio.fixture
async def kept(served: Served) -> AsyncIterator[_Kept]:
    k = _kept(served.target)
    yield k
    await k.aclose()


def _kept(
    target: str, *, cancel: bool = True, method: str = METHOD, said: list[str] | None = None
) -> _Kept:
    said = [] if said is None else said
    return KeptStream(
        grpc.aio.insecure_channel(target), method, pb.CreateStreamRequest,
        pb.CreateStreamReply, lambda r: r.info, component="peer p", name="test stream",
        unimplemented=lambda: said.append("unary"),
        cancel=(lambda rid: pb.CreateStreamRequest(id=rid, cancel=True)) if cancel else None,
    )  # fmt: skip


async def _ask(kept: _Kept, sid: str, owner: str = "", timeout_s: float = 10.0) -> pb.SandboxInfo:
    deadline = asyncio.get_running_loop().time() + timeout_s
    stream = await kept.get(deadline)
    assert stream is not None
    msg = pb.CreateStreamRequest(create=pb.CreateSandboxRequest(sandbox_id=sid, owner=owner))
    return await stream.ask(msg, deadline)


async def _hanging(kept: _Kept, served: Served, names: list[str]) -> list[asyncio.Task[Any]]:
    """Requests that never get an answer, once they all run on the peer."""
    asked = [asyncio.ensure_future(_ask(kept, name, "hang")) for name in names]
    await auntil(lambda: set(names) <= set(served.peer.started))
    return asked


@pytest.mark.asyncio
async def test_replies_out_of_order_reach_their_own_requests(served: Served, kept: _Kept) -> None:
    n = 20  # s5 answers first, then the last asked down to the first
    served.peer.turns = ["s5"] + [f"s{i}" for i in reversed(range(n)) if i != 5]
    got = await asyncio.gather(
        *(_ask(kept, f"s{i}", "full" if i == 5 else "") for i in range(n)),
        return_exceptions=True,
    )
    assert served.peer.order == served.peer.turns
    for i, g in enumerate(got):
        if i == 5:
            assert isinstance(g, NodeFull)
        else:
            assert isinstance(g, pb.SandboxInfo), g
            assert g.id == f"s{i}"
    assert served.peer.streams == 1


@pytest.mark.asyncio
async def test_a_peer_without_the_stream_gets_unary_calls_then_is_asked_again(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    kept = _kept(served.target, method="/test.Kept/Unknown", said=said)
    deadline = asyncio.get_running_loop().time() + 5
    assert await kept.get(deadline) is None
    assert await kept.get(deadline) is None  # not asked again within UNARY_FOR_S
    assert said == ["unary"]
    monkeypatch.setattr(kept_stream, "UNARY_FOR_S", 0.0)
    kept._unary_until = 0.0
    assert await kept.get(deadline) is None
    assert said == ["unary", "unary"]  # asked again after it
    # a refusal other than UNIMPLEMENTED is the error the call would raise
    refusing = _kept(served.target, method="/test.Kept/Refused", said=said)
    with pytest.raises(PermissionDenied, match="not you"):
        await refusing.get(deadline)
    assert said == ["unary", "unary"]
    await kept.aclose()
    await refusing.aclose()


@pytest.mark.asyncio
async def test_a_stream_broken_mid_flight_fails_its_requests_and_is_opened_again(
    served: Served, kept: _Kept
) -> None:
    assert (await _ask(kept, "s0")).id == "s0"
    first = kept.current
    inflight = await _hanging(kept, served, ["s1", "s2", "s3"])
    await served.server.stop(None)  # the peer goes away
    for f in inflight:
        with pytest.raises(Unavailable, match="peer p"):
            await f
    assert first is not None
    assert first.broken
    with pytest.raises(DsecError):  # down: refused as a call is
        await _ask(kept, "s4")
    again = await _serve(Peer(), int(served.target.rpartition(":")[2]))
    try:
        for _ in range(100):  # the channel reconnects with backoff
            try:
                assert (await _ask(kept, "s5")).id == "s5"
                break
            except Unavailable:
                await asyncio.sleep(0.1)
        assert kept.current is not None
        assert kept.current is not first
        assert again.peer.streams == 1
    finally:
        await again.server.stop(None)


@pytest.mark.asyncio
@pytest.mark.parametrize("cancel", [True, False])
async def test_a_deadline_stops_the_request_or_gives_the_stream_up(
    served: Served, cancel: bool
) -> None:
    kept = _kept(served.target, cancel=cancel)
    assert (await _ask(kept, "first")).id == "first"  # the deadline below times no opening
    other = asyncio.ensure_future(_ask(kept, "other", "1000"))  # after "slow" times out
    with pytest.raises(DeadlineExceeded, match="peer p did not answer in time"):
        await _ask(kept, "slow", "hang", timeout_s=0.2)
    stream = kept.current
    assert stream is not None
    if cancel:  # the peer stops that one, the rest goes on
        await auntil(lambda: "slow" in served.peer.cancelled)
        assert (await other).id == "other"
        assert not stream.broken
    else:  # a stuck peer: the stream goes with everything on it
        with pytest.raises(DeadlineExceeded):
            await other
        assert stream.broken
        await auntil(lambda: served.peer.ended == [True])
        assert (await _ask(kept, "next")).id == "next"
        assert kept.current is not stream
    await kept.aclose()


@pytest.mark.asyncio
async def test_a_cancelled_caller_stops_its_request_on_the_peer(
    served: Served, kept: _Kept
) -> None:
    (waiting,) = await _hanging(kept, served, ["w"])
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await auntil(lambda: "w" in served.peer.cancelled)
    assert (await _ask(kept, "after")).id == "after"  # the stream is still fine


@pytest.mark.asyncio
async def test_a_retired_stream_finishes_its_requests_then_ends(
    served: Served, kept: _Kept
) -> None:
    slow = asyncio.ensure_future(_ask(kept, "slow", "200"))
    await auntil(lambda: served.peer.started == ["slow"])
    stream = kept.current
    assert stream is not None
    stream.retire()  # as when the certificates change: half-closed
    with pytest.raises(Unavailable, match="closed"):
        await stream.ask(pb.CreateStreamRequest(), asyncio.get_running_loop().time() + 5)
    assert (await slow).id == "slow"  # answered before the stream ended
    await auntil(lambda: served.peer.ended == [True])
    await auntil(lambda: stream.error is not None)
    assert isinstance(stream.error, Unavailable)
    assert "peer p ended the test stream" in stream.error.message


@pytest.mark.asyncio
async def test_the_pump_ends_and_cancels_its_answers_when_the_caller_goes(
    served: Served, kept: _Kept
) -> None:
    inflight = await _hanging(kept, served, ["h0", "h1", "h2"])
    await kept.aclose()  # the caller goes away
    for f in inflight:
        with pytest.raises(Unavailable, match="the test stream to peer p was closed"):
            await f
    await auntil(lambda: sorted(served.peer.cancelled) == ["h0", "h1", "h2"])
    await auntil(lambda: served.peer.ended == [True])
    assert served.peer.order == []  # none answered


class _Context:
    async def send_initial_metadata(self, _: object) -> None:
        pass


@pytest.mark.asyncio
async def test_the_pump_ends_with_the_error_that_ended_the_requests() -> None:
    async def requests() -> AsyncIterator[int]:
        yield 1
        await asyncio.sleep(0.05)
        raise PermissionDenied("no longer trusted")

    pump: Pump[int] = Pump()

    async def double(n: int) -> int:
        return 2 * n

    got: list[int] = []

    async def serve() -> None:
        ctx: Any = _Context()
        async for r in pump.serve(requests(), ctx, lambda n: pump.start(double(n))):
            got.append(r)  # noqa: PERF401

    with pytest.raises(PermissionDenied, match="no longer trusted"):
        await serve()
    assert got == [2]  # answered before the error


@pytest.mark.asyncio
async def test_the_pump_keeps_answers_by_id_and_ends_when_all_are_sent() -> None:
    pump: Pump[int] = Pump()
    gate = asyncio.Event()

    async def wait(n: int) -> int:
        await gate.wait()
        return n

    async def none() -> AsyncIterator[int]:
        return
        yield

    pump.start(wait(1), 1)
    pump.start(wait(2), 2)
    pump.start(wait(3))
    assert pump.running(1)
    assert pump.running(2)
    assert not pump.running(3)  # kept by itself, not by an id
    pump.cancel(2)
    pump.cancel(7)  # not running: nothing
    gate.set()
    ctx: Any = _Context()
    got = [r async for r in pump.serve(none(), ctx, lambda _: None)]
    assert sorted(got) == [1, 3]  # the cancelled one unanswered; then the stream ended
    assert not pump.running(1)
