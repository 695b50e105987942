"""The edge's end of ``CreateStream``: creates that come as messages of one kept stream
(an apiserver keeps one per edge; ``dsec.apiserver.edge_stream`` is the other end).

Each message is the ``CreateSandbox`` call it stands for, and runs through the servicer's
own ``CreateSandbox`` handler, so a create does the same on either path; what the handler
reads of its call (the caller's metadata, the time left) comes from the message
(:class:`MessageContext`). Creates run concurrently and are answered as they finish,
each reply naming its request; a DsecError goes back as its code and message, what the
unary call's status and ``x-dsec-code`` trailer carry. The server's guard authorizes every
message again, as it would each unary call (:func:`dsec.rpc.server.authorize_each_message`).

Deadlines and cancellation are the unary call's: a create still running when its
``timeout_s`` ends is cancelled and answered ``deadline_exceeded``; a ``cancel`` message
(the caller gave up) cancels it unanswered; the stream ending (the caller went away)
cancels them all. Once the edge is shutting down (:meth:`CreateStreamServicer.refuse_creates`)
new creates are answered ``unavailable``, as a unary call to a stopping server is, and the
caller places them elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc

from dsec.core.errors import DeadlineExceeded, DsecError, InvalidArgument, Unavailable
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.server import authorize_each_message, call_error
from dsec.rpc.stream_pump import Pump

_Ctx = grpc.aio.ServicerContext[Any, Any]


class MessageContext:
    """What a create handler reads of its call's context, for a create that came as a
    stream message: that message's metadata and deadline, the stream's peer."""

    def __init__(self, stream: _Ctx, metadata: tuple[tuple[str, str], ...], deadline: float | None):
        self._stream = stream
        self._metadata = metadata
        self._deadline = deadline

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    def auth_context(self) -> Any:
        return self._stream.auth_context()

    def peer(self) -> str:
        return self._stream.peer()


def _error_reply(rid: int, err: DsecError) -> pb.CreateStreamReply:
    return pb.CreateStreamReply(id=rid, error_code=err.code, error_message=err.message)


class CreateStreamServicer(pb_grpc.EdgeServicer):
    """An Edge servicer's ``CreateStream``, over its own ``CreateSandbox``."""

    _refusing = ""  # why new creates are refused ("" while they are taken)

    async def CreateSandbox(
        self, request: pb.CreateSandboxRequest, context: _Ctx
    ) -> pb.SandboxInfo:  # each servicer's own
        raise NotImplementedError

    def refuse_creates(self, why: str) -> None:
        """Answer every create from now on ``unavailable: why`` (the edge is stopping)."""
        self._refusing = why

    async def _create(self, msg: pb.CreateStreamRequest, stream: _Ctx) -> pb.CreateStreamReply:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + msg.timeout_s if msg.timeout_s > 0 else None
        context = MessageContext(stream, tuple(msg.metadata.items()), deadline)
        try:
            async with asyncio.timeout_at(deadline) as limit:
                info = await self.CreateSandbox(msg.create, cast(_Ctx, context))
        except TimeoutError:
            if not limit.expired():
                raise
            return _error_reply(msg.id, DeadlineExceeded("the create ran past its deadline"))
        return pb.CreateStreamReply(id=msg.id, info=info)

    async def _answer(self, msg: pb.CreateStreamRequest, stream: _Ctx) -> pb.CreateStreamReply:
        try:
            return await self._create(msg, stream)
        except Exception as exc:  # answered as the unary call would be
            err = call_error(exc, "Edge/CreateSandbox", sandbox=msg.create.sandbox_id)
            return _error_reply(msg.id, err)

    @authorize_each_message
    async def CreateStream(
        self, request_iterator: AsyncIterator[pb.CreateStreamRequest], context: _Ctx
    ) -> AsyncIterator[pb.CreateStreamReply]:
        pump: Pump[pb.CreateStreamReply] = Pump()

        def take(msg: pb.CreateStreamRequest) -> None:
            if msg.cancel:  # its caller gave up on it: stopped, unanswered
                pump.cancel(msg.id)
            elif pump.running(msg.id):
                err = InvalidArgument(f"create {msg.id} is already running")
                pump.reply(_error_reply(msg.id, err))
            elif self._refusing:
                pump.reply(_error_reply(msg.id, Unavailable(self._refusing)))
            else:
                pump.start(self._answer(msg, context), msg.id)

        replies = pump.serve(request_iterator, context, take)
        async with contextlib.aclosing(replies):
            async for reply in replies:
                yield reply
