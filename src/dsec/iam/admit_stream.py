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

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.server import authorize_each_message, call_error, peer_identity
from dsec.rpc.stream_pump import Pump

_Ctx = grpc.aio.ServicerContext[Any, Any]


class AdmitStreamRpc:
    """``AdmitStream``, mixed into :class:`dsec.iam.service.IamService`."""

    async def admit_batch(self, request: pb.AdmitBatch, peer: str) -> pb.AdmitBatchReply:
        raise NotImplementedError

    async def _answer(self, msg: pb.AdmitStreamRequest, peer: str) -> pb.AdmitStreamReply:
        try:
            return pb.AdmitStreamReply(id=msg.id, reply=await self.admit_batch(msg.batch, peer))
        except Exception as exc:  # answered as the unary call would be
            err = call_error(exc, "Iam/AdmitMany", peer=peer)
        return pb.AdmitStreamReply(id=msg.id, error_code=err.code, error_message=err.message)

    @authorize_each_message
    async def AdmitStream(
        self, request_iterator: AsyncIterator[pb.AdmitStreamRequest], context: _Ctx
    ) -> AsyncIterator[pb.AdmitStreamReply]:
        peer = peer_identity(context).spiffe_id
        # a batch cancelled by the stream's end: its decisions already queued stand
        pump: Pump[pb.AdmitStreamReply] = Pump()
        replies = pump.serve(request_iterator, context, lambda m: pump.start(self._answer(m, peer)))
        async with contextlib.aclosing(replies):
            async for reply in replies:
                yield reply
