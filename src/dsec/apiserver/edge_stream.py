"""Creates sent to an edge as messages of one kept ``CreateStream`` (one per edge, over the
edge's mTLS channel; :mod:`dsec.rpc.kept_stream`), not as a unary ``CreateSandbox`` call
each: a message costs about half the gRPC CPU of a call on both ends.
``dsec.edge.create_stream`` is the edge's end.

A create has the outcomes of the unary call it replaces. A stream broken with creates in
flight fails them (``Unavailable`` for a lost connection, as a unary call to a dead edge
gets) and sends nothing again: the caller (``admission``) releases the admission and
places the sandbox on another edge under a new id. A create past its deadline, or whose
caller is cancelled, is stopped on the edge too. The stream is authorized by the edge as a
call is, and each message again (``dsec.rpc.server.authorize_each_message``). An edge that
predates ``CreateStream`` gets unary creates (the only caller of ``CreateSandbox`` left).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from dsec.obs import log
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.errors import error_from_rpc
from dsec.rpc.kept_stream import KeptStream

_log = logging.getLogger("dsec.apiserver.edge_stream")
METHOD = "/dsec.v1.Edge/CreateStream"


class EdgeStream:
    """The creates of one edge (at one address), over a kept stream."""

    def __init__(self, channel: grpc.aio.Channel, component: str) -> None:
        self._channel = channel
        self.component = component
        self._stub = pb_grpc.EdgeStub(channel)  # for an edge without CreateStream
        self._kept: KeptStream[pb.CreateStreamRequest, pb.SandboxInfo] = KeptStream(
            channel, METHOD, pb.CreateStreamRequest, pb.CreateStreamReply, lambda r: r.info,
            component=component, name="create stream",
            unimplemented=lambda: log(_log, "edge has no create stream: unary creates",
                                      edge=component),
            cancel=lambda rid: pb.CreateStreamRequest(id=rid, cancel=True),
        )  # fmt: skip

    async def create(
        self, req: pb.CreateSandboxRequest, metadata: Sequence[tuple[str, str]], timeout_s: float
    ) -> pb.SandboxInfo:
        """Create ``req`` on the edge: its SandboxInfo, or the DsecError the unary call would
        raise (the edge's, ``Unavailable`` when it cannot be reached or the stream broke,
        ``DeadlineExceeded`` after ``timeout_s`` seconds)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        stream = await self._kept.get(deadline)
        if stream is None:  # an edge without CreateStream
            call = self._stub.CreateSandbox(req, metadata=tuple(metadata),
                                            timeout=deadline - loop.time())  # fmt: skip
            try:
                info: pb.SandboxInfo = await call
            except grpc.aio.AioRpcError as exc:
                raise error_from_rpc(exc, self.component) from None
            return info
        msg = pb.CreateStreamRequest(create=req, metadata=dict(metadata),
                                     timeout_s=deadline - loop.time())  # fmt: skip
        return await stream.ask(msg, deadline)

    async def aclose(self, *, channel: bool = False) -> None:
        """End its streams (their creates fail ``Unavailable``); ``channel``: and close the
        channel."""
        await self._kept.aclose()
        if channel:
            await self._channel.close()
