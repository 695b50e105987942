"""Creates sent to an edge as messages of one kept ``CreateStream`` (one per edge, over the
edge's mTLS channel), not as a unary ``CreateSandbox`` call each: a message costs about
half the gRPC CPU of a call on both ends. ``dsec.edge.create_stream`` is the edge's end.

A create is the unary call it replaces, with the same outcomes:

* the edge's answer, or the DsecError it raised (rebuilt from its code, as from a status's
  ``x-dsec-code``), matched to its request by an id;
* the stream breaking while creates are in flight (the edge died, a network cut) fails each
  of them with the error the broken call gives: ``Unavailable`` for a lost connection, as a
  unary call to a dead edge gets. Nothing is sent again: the caller (``admission``)
  releases the admission and places the sandbox on another edge under a new id;
* the deadline: when it passes the create fails ``DeadlineExceeded`` and the edge is told
  to stop it; a caller that is cancelled tells the edge the same;
* identity: the stream is authorized by the edge as a call is, and each message again
  (``dsec.rpc.server.authorize_each_message``); when this apiserver's certificates change,
  new creates open a new stream with them while the old one finishes its creates.

The stream is opened by the first create and again by the first create after it ended
(so it reconnects when an edge comes back). An edge that predates ``CreateStream``
answers UNIMPLEMENTED before any create is sent; its creates then go as unary calls (the
only caller of ``CreateSandbox`` left), and the stream is tried again after
:data:`UNARY_FOR_S`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from typing import cast

import grpc

from dsec.core.errors import DeadlineExceeded, DsecError, Unavailable, error_from_wire
from dsec.obs import log
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.errors import error_from_rpc, error_from_status
from dsec.rpc.reload import ReloadingChannel

_log = logging.getLogger("dsec.apiserver.edge_stream")
METHOD = "/dsec.v1.Edge/CreateStream"
_Call = grpc.aio.StreamStreamCall[pb.CreateStreamRequest, pb.CreateStreamReply]
UNARY_FOR_S = 60.0  # an edge without CreateStream gets unary creates this long, then is asked again


class _Stream:
    """One open ``CreateStream`` call and the creates waiting for their replies."""

    def __init__(self, call: _Call, channel: grpc.aio.Channel, component: str) -> None:
        self.call = call
        self.channel = channel  # the inner channel it runs on (certificates of that time)
        self.component = component
        self.broken = False
        self.error: DsecError | None = None  # what broke it
        self._waiting: dict[int, asyncio.Future[pb.SandboxInfo]] = {}
        self._ids = itertools.count(1)
        self._out: asyncio.Queue[pb.CreateStreamRequest | None] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    async def create(self, req: pb.CreateSandboxRequest, metadata: Sequence[tuple[str, str]],
                     deadline: float) -> pb.SandboxInfo:  # fmt: skip
        if self.broken:  # it broke (or was retired) since it was handed out
            raise self.error or Unavailable(f"the create stream to {self.component} was closed")
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        fut: asyncio.Future[pb.SandboxInfo] = loop.create_future()
        self._waiting[rid] = fut
        left = deadline - loop.time()
        self._out.put_nowait(
            pb.CreateStreamRequest(id=rid, create=req, metadata=dict(metadata), timeout_s=left)
        )
        timer = loop.call_at(deadline, self._expire, rid)
        try:
            return await fut
        except asyncio.CancelledError:
            if self._waiting.pop(rid, None) is not None:
                self._out.put_nowait(pb.CreateStreamRequest(id=rid, cancel=True))
            raise
        finally:
            timer.cancel()

    def _expire(self, rid: int) -> None:
        fut = self._waiting.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(DeadlineExceeded(f"{self.component} did not answer in time"))
            self._out.put_nowait(pb.CreateStreamRequest(id=rid, cancel=True))

    async def _write(self) -> None:
        try:
            while (msg := await self._out.get()) is not None:
                await self.call.write(msg)
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the call ended: the reader reports how

    async def _read(self) -> None:
        err: DsecError
        try:
            while (reply := await self.call.read()) is not grpc.aio.EOF:
                assert isinstance(reply, pb.CreateStreamReply)
                fut = self._waiting.pop(reply.id, None)
                if fut is None or fut.done():
                    continue  # it gave up on it (deadline, cancelled)
                if reply.error_code:
                    fut.set_exception(error_from_wire(reply.error_code, reply.error_message))
                else:
                    fut.set_result(reply.info)
            err = Unavailable(f"{self.component} ended the create stream")
        except grpc.aio.AioRpcError as exc:
            err = error_from_rpc(exc, self.component)
        except asyncio.CancelledError:
            err = Unavailable(f"the create stream to {self.component} was closed")
        self._fail(err)

    def _fail(self, err: DsecError) -> None:
        self.broken, self.error = True, err
        self._out.put_nowait(None)
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(err)

    def retire(self) -> None:
        """No new creates: the edge ends the stream once it has answered those in flight."""
        self.broken = True
        self._out.put_nowait(None)

    async def aclose(self) -> None:
        self.call.cancel()
        for task in (self._reader, self._writer):
            task.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)


class EdgeStream:
    """The creates of one edge (at one address), over a kept stream."""

    def __init__(self, channel: grpc.aio.Channel, component: str) -> None:
        self._channel = channel
        self.component = component
        self._stub = pb_grpc.EdgeStub(channel)  # for an edge without CreateStream
        self._stream: _Stream | None = None
        self._old: list[_Stream] = []  # retired, finishing their creates
        self._opening: asyncio.Future[_Stream | None] | None = None
        self._unary_until = 0.0

    def _current_channel(self) -> grpc.aio.Channel:
        ch = self._channel
        return ch.current() if isinstance(ch, ReloadingChannel) else ch

    async def create(
        self, req: pb.CreateSandboxRequest, metadata: Sequence[tuple[str, str]], timeout_s: float
    ) -> pb.SandboxInfo:
        """Create ``req`` on the edge: its SandboxInfo, or the DsecError the unary call would
        raise (the edge's, ``Unavailable`` when it cannot be reached or the stream broke,
        ``DeadlineExceeded`` after ``timeout_s`` seconds)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        stream = self._stream
        if stream is not None and (stream.broken or stream.channel is not self._current_channel()):
            self._retire(stream)
            stream = None
        if stream is None:
            stream = await self._open(deadline)
            if stream is None:  # an edge without CreateStream
                call = self._stub.CreateSandbox(req, metadata=tuple(metadata),
                                                timeout=deadline - loop.time())  # fmt: skip
                try:
                    info: pb.SandboxInfo = await call
                except grpc.aio.AioRpcError as exc:
                    raise error_from_rpc(exc, self.component) from None
                return info
        return await stream.create(req, metadata, deadline)

    def _retire(self, stream: _Stream) -> None:
        if self._stream is stream:
            self._stream = None
        if not stream.broken:
            stream.retire()
        self._old = [s for s in self._old if not s.call.done()]
        self._old.append(stream)

    async def _open(self, deadline: float) -> _Stream | None:
        """The open stream (opened now, once for every create that finds none), or None
        while the edge is known not to serve it."""
        if time.monotonic() < self._unary_until:
            return None
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._start())
            self._opening.add_done_callback(self._started)
        try:
            return await asyncio.wait_for(
                asyncio.shield(self._opening), deadline - asyncio.get_running_loop().time()
            )
        except TimeoutError:
            raise DeadlineExceeded(f"{self.component} did not answer in time") from None

    def _started(self, fut: asyncio.Future[_Stream | None]) -> None:
        self._opening = None
        if not fut.cancelled() and fut.exception() is None:
            self._stream = fut.result()

    async def _start(self) -> _Stream | None:
        channel = self._current_channel()
        opened = channel.stream_stream(
            METHOD,
            request_serializer=pb.CreateStreamRequest.SerializeToString,
            response_deserializer=pb.CreateStreamReply.FromString,
        )()
        call = cast(_Call, opened)
        try:
            await call.initial_metadata()  # sent by the edge as it starts serving the stream
            ended = call.done()  # refused (not authorized, unreachable) or not served
            code = await call.code() if ended else grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            ended, code = True, exc.code()
        if not ended:
            return _Stream(call, channel, self.component)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            log(_log, "edge has no create stream: unary creates", edge=self.component)
            self._unary_until = time.monotonic() + UNARY_FOR_S
            return None
        trailing = await call.trailing_metadata()
        pairs = tuple((str(k), v) for k, v in trailing) if trailing else None
        raise error_from_status(code, await call.details() or "", pairs, self.component)

    async def aclose(self, *, channel: bool = False) -> None:
        """End its streams (their creates fail ``Unavailable``); ``channel``: and close the
        channel."""
        if self._opening is not None:
            self._opening.cancel()
        streams = [*self._old, *([self._stream] if self._stream else [])]
        self._stream, self._old = None, []
        for s in streams:
            await s.aclose()
        if channel:
            await self._channel.close()
