"""The iam's end of ``AdmitStream``: ``AdmitMany`` calls that come as messages of one kept
stream (an apiserver keeps one; ``dsec.apiserver.iam_batch`` is the other end).

A message is the call it stands for and gets the call's answer, or the DsecError it would
raise (as its code and message), in a reply naming it. Messages are decided concurrently,
as concurrent calls are (they join the iam's admission queue together), and answered as
they are decided. The server's guard authorizes every message again, as it would each call
(:func:`dsec.rpc.server.authorize_each_message`). A message costs a fraction of the gRPC
work of a unary call, on both ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from dsec.core.errors import DsecError, Internal
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.server import authorize_each_message, peer_identity

_log = logging.getLogger("dsec.iam")
_Ctx = grpc.aio.ServicerContext[Any, Any]


class AdmitStreamRpc:
    """``AdmitStream``, mixed into :class:`dsec.iam.service.IamService`."""

    async def admit_batch(self, request: pb.AdmitBatch, peer: str) -> pb.AdmitBatchReply:
        raise NotImplementedError

    async def _answer(self, msg: pb.AdmitStreamRequest, peer: str) -> pb.AdmitStreamReply:
        try:
            return pb.AdmitStreamReply(id=msg.id, reply=await self.admit_batch(msg.batch, peer))
        except DsecError as exc:
            err = exc
        except Exception as exc:  # as the guard answers for a unary handler's bug
            _log.error("AdmitStream batch raised %r", exc, exc_info=exc)
            err = Internal(f"internal error in Iam/AdmitMany: {type(exc).__name__}")
        return pb.AdmitStreamReply(id=msg.id, error_code=err.code, error_message=err.message)

    @authorize_each_message
    async def AdmitStream(
        self, request_iterator: AsyncIterator[pb.AdmitStreamRequest], context: _Ctx
    ) -> AsyncIterator[pb.AdmitStreamReply]:
        peer = peer_identity(context).spiffe_id
        # replies; None once the caller has half-closed and every batch is answered, or the
        # exception that ended the requests (e.g. a message no longer authorized)
        replies: asyncio.Queue[pb.AdmitStreamReply | BaseException | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def answer(msg: pb.AdmitStreamRequest) -> None:
            replies.put_nowait(await self._answer(msg, peer))

        async def take() -> None:
            try:
                async for msg in request_iterator:
                    task = asyncio.create_task(answer(msg))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:
                    await asyncio.wait(list(running))
                replies.put_nowait(None)
            except Exception as exc:
                replies.put_nowait(exc)

        await context.send_initial_metadata(())  # "served" (an iam without it: UNIMPLEMENTED)
        pump = asyncio.create_task(take())
        try:
            while (item := await replies.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            pump.cancel()
            for task in list(running):  # decisions already queued stand (the queue keeps them)
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(pump, *running, return_exceptions=True)
