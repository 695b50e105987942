"""The calling end of a kept stream (:mod:`dsec.rpc.stream_pump` serves it): unary calls
to one peer sent as messages of one long-lived bidirectional stream, with the unary call as
the fallback. A message costs a fraction of a call's gRPC work, on both ends.

A request gets an ``id``; its reply names it and carries the answer, or the DsecError the
call would raise as its code and message. The stream breaking fails the requests in flight
with the error the broken call gives (``Unavailable`` for a lost connection); nothing is
sent again. A request past its deadline fails ``DeadlineExceeded``: the peer is told to
stop it when the method has a ``cancel`` message (as when its caller is cancelled), else
the stream is given up with it (a stuck peer). The stream is opened at first use (once
for every caller that finds none), again after it broke or when the channel's certificates
changed (the old one finishes what it carries). A peer that answers UNIMPLEMENTED (it
predates the stream) gets unary calls for :data:`UNARY_FOR_S`, then is asked again.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from dsec.core.errors import DeadlineExceeded, DsecError, Unavailable, error_from_wire
from dsec.rpc.errors import error_from_rpc, error_from_status
from dsec.rpc.reload import ReloadingChannel

UNARY_FOR_S = 60.0  # a peer without the stream gets unary calls this long, then is asked again


class _Message(Protocol):
    id: int


Req = TypeVar("Req", bound=_Message)
Out = TypeVar("Out")


class StreamCall(Generic[Req, Out]):
    """One open stream and the requests waiting for their replies."""

    def __init__(self, call: Any, channel: grpc.aio.Channel, kept: KeptStream[Req, Out]) -> None:
        self.call: grpc.aio.StreamStreamCall[Req, Any] = call
        self.channel = channel  # the inner channel it runs on (certificates of that time)
        self._kept = kept
        self.broken = False  # takes no new requests (it broke, or was retired)
        self.error: DsecError | None = None  # what broke it
        self._waiting: dict[int, asyncio.Future[Out]] = {}
        self._ids = itertools.count(1)
        self._out: asyncio.Queue[Req | None] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    async def ask(self, msg: Req, deadline: float) -> Out:
        """Send ``msg`` (its id set here); its answer, by ``deadline`` (loop time)."""
        kept = self._kept
        if self.broken:  # it broke (or was retired) since it was handed out
            raise self.error or Unavailable(f"the {kept.name} to {kept.peer} was closed")
        loop = asyncio.get_running_loop()
        msg.id = rid = next(self._ids)
        fut: asyncio.Future[Out] = loop.create_future()
        self._waiting[rid] = fut
        self._out.put_nowait(msg)
        timer = loop.call_at(deadline, self._expire, rid)
        try:
            return await fut
        except asyncio.CancelledError:
            if self._waiting.pop(rid, None) is not None and kept.cancel is not None:
                self._out.put_nowait(kept.cancel(rid))
            raise
        finally:
            timer.cancel()

    def _expire(self, rid: int) -> None:
        if (fut := self._waiting.get(rid)) is None or fut.done():
            return
        err = DeadlineExceeded(f"{self._kept.peer} did not answer in time")
        if self._kept.cancel is None:  # stuck: give it up, with the stream
            return self._fail(err)
        del self._waiting[rid]
        fut.set_exception(err)
        self._out.put_nowait(self._kept.cancel(rid))

    async def _write(self) -> None:
        try:
            while (msg := await self._out.get()) is not None:
                await self.call.write(msg)
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the call ended: the reader reports how

    async def _read(self) -> None:
        kept = self._kept
        err: DsecError
        try:
            while (got := await self.call.read()) is not grpc.aio.EOF:
                reply: Any = got  # the method's reply: id, error_code, error_message
                fut = self._waiting.pop(reply.id, None)
                if fut is None or fut.done():
                    continue  # given up on (deadline, cancelled)
                if reply.error_code:
                    fut.set_exception(error_from_wire(reply.error_code, reply.error_message))
                else:
                    fut.set_result(kept.answer(reply))
            err = Unavailable(f"{kept.peer} ended the {kept.name}")
        except grpc.aio.AioRpcError as exc:
            err = error_from_rpc(exc, kept.component)
        except asyncio.CancelledError:
            err = Unavailable(f"the {kept.name} to {kept.peer} was closed")
        self._fail(err)

    def _fail(self, err: DsecError) -> None:
        if self.error is None:
            self.error = err
        self.broken = True
        self.call.cancel()
        self._out.put_nowait(None)
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(err)

    def retire(self) -> None:
        """No new requests: the peer ends the stream once it has answered those in flight."""
        self.broken = True
        self._out.put_nowait(None)

    async def aclose(self) -> None:
        self.call.cancel()
        for task in (self._reader, self._writer):
            task.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)


class KeptStream(Generic[Req, Out]):
    """The kept stream of ``method`` to one peer, over ``channel`` (a ReloadingChannel: the
    stream follows its certificates).

    ``answer`` reads a reply's answer; ``cancel(id)`` is the message that stops request
    ``id`` (None: the method has none); ``component`` is who is called, as errors name it,
    ``peer`` the same in prose (default ``component``), ``name`` what the stream is called
    in messages; ``unimplemented`` is called when the peer turns out not to serve it."""

    def __init__(
        self, channel: grpc.aio.Channel, method: str, request: type[Message],
        reply: type[Message], answer: Callable[[Any], Out], *, component: str, name: str,
        unimplemented: Callable[[], None], peer: str = "",
        cancel: Callable[[int], Req] | None = None,
    ) -> None:  # fmt: skip
        self._channel = channel
        self._method, self._request, self._reply = method, request, reply
        self.answer, self.cancel, self.name = answer, cancel, name
        self.component, self.peer = component, peer or component
        self._unimplemented = unimplemented
        self.current: StreamCall[Req, Out] | None = None
        self._old: list[StreamCall[Req, Out]] = []  # retired, finishing their requests
        self._opening: asyncio.Future[StreamCall[Req, Out] | None] | None = None
        self._unary_until = 0.0

    def _current_channel(self) -> grpc.aio.Channel:
        ch = self._channel
        return ch.current() if isinstance(ch, ReloadingChannel) else ch

    async def get(self, deadline: float) -> StreamCall[Req, Out] | None:
        """The open stream (opened now if there is none, it broke or the certificates
        changed), or None while the peer is known not to serve it: make the unary call.
        Raises the error the opening met, ``DeadlineExceeded`` at ``deadline``."""
        stream = self.current
        if stream is not None:
            if not stream.broken and stream.channel is self._current_channel():
                return stream
            self._retire(stream)
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
            raise DeadlineExceeded(f"{self.peer} did not answer in time") from None

    def _retire(self, stream: StreamCall[Req, Out]) -> None:
        if self.current is stream:
            self.current = None
        if not stream.broken:
            stream.retire()
        self._old = [s for s in self._old if not s.call.done()]
        self._old.append(stream)

    def _started(self, fut: asyncio.Future[StreamCall[Req, Out] | None]) -> None:
        self._opening = None
        if not fut.cancelled() and fut.exception() is None:
            self.current = fut.result()

    async def _start(self) -> StreamCall[Req, Out] | None:
        channel = self._current_channel()
        call = channel.stream_stream(
            self._method,
            request_serializer=self._request.SerializeToString,
            response_deserializer=self._reply.FromString,
        )()
        try:
            await call.initial_metadata()  # sent by the peer as it starts serving the stream
            ended = call.done()  # refused (not authorized, unreachable) or not served
            code = await call.code() if ended else grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            ended, code = True, exc.code()
        if not ended:
            return StreamCall(call, channel, self)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            self._unimplemented()
            self._unary_until = time.monotonic() + UNARY_FOR_S
            return None
        trailing = await call.trailing_metadata()
        pairs = tuple((str(k), v) for k, v in trailing) if trailing else None
        raise error_from_status(code, await call.details() or "", pairs, self.component)

    async def aclose(self) -> None:
        """End its streams (their requests fail ``Unavailable``)."""
        if self._opening is not None:
            self._opening.cancel()
        streams = [*self._old, *([self.current] if self.current else [])]
        self.current, self._old = None, []
        for s in streams:
            await s.aclose()
