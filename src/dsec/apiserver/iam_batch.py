"""One call to the iam for many creates: concurrent admissions and audit entries of this
apiserver are queued while a call is in flight and go together in the next ``AdmitMany``
(a burst of creates then costs the iam one RPC and one transaction, not two RPCs each).

Each caller still gets its own answer: an admission its verdict (the DsecError the iam
raised, rebuilt from its code), an audit entry the call's outcome.

Given the channel, the calls go as messages of one kept ``AdmitStream``
(:mod:`dsec.rpc.kept_stream`; the iam's end is ``dsec.iam.admit_stream``), with the call's
outcomes: the stream breaking, or no reply within the call's timeout, fails the batch in
flight as a failed call does (``Unavailable``, ``DeadlineExceeded``: the iam may or may not
have decided it; an admission left behind is freed by its edge's reconcile) and the next
batch opens a new stream. An iam without ``AdmitStream`` gets unary calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from dsec.core.batching import Batcher
from dsec.core.errors import error_from_wire
from dsec.obs import log
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.errors import error_from_rpc
from dsec.rpc.kept_stream import KeptStream

_log = logging.getLogger("dsec.apiserver.iam_batch")
MAX_BATCH = 256  # items per call
METHOD = "/dsec.v1.Iam/AdmitStream"
_Item = pb.AdmitRequest | pb.AuditEntry


class IamBatch:
    def __init__(
        self, iam: pb_grpc.IamAsyncStub, *, channel: grpc.aio.Channel | None = None,
        timeout_s: float = 10.0,
    ) -> None:  # fmt: skip
        """``iam``: a stub on a channel without TranslateErrors (a hot path); ``channel``:
        that channel, to send the calls as messages of a kept stream (None: unary calls)."""
        self._iam = iam
        self._timeout = timeout_s
        self._queue: Batcher[_Item, None] = Batcher(self._send, max_batch=MAX_BATCH)
        self._kept: KeptStream[pb.AdmitStreamRequest, pb.AdmitBatchReply] | None = None
        if channel is not None:
            self._kept = KeptStream(
                channel, METHOD, pb.AdmitStreamRequest, pb.AdmitStreamReply, lambda r: r.reply,
                component="iam", peer="the iam", name="admission stream",
                unimplemented=lambda: log(_log, "iam has no admission stream: unary AdmitMany "
                                              "calls"),
            )  # fmt: skip
        self.calls = 0  # AdmitMany calls made, and the items they carried (for /metrics)
        self.items = 0

    async def admit(self, request: pb.AdmitRequest) -> None:
        """Admit one sandbox (raises the iam's error, e.g. QuotaExceeded)."""
        await self._queue.submit(request)

    async def audit(self, entry: pb.AuditEntry) -> None:
        """Append one audit entry (raises when the call failed)."""
        await self._queue.submit(entry)

    async def _send(self, items: Sequence[_Item]) -> list[Exception | None]:
        call = pb.AdmitBatch(
            admissions=[i for i in items if isinstance(i, pb.AdmitRequest)],
            audit=[i for i in items if isinstance(i, pb.AuditEntry)],
        )
        self.calls += 1
        self.items += len(items)
        loop = asyncio.get_running_loop()
        stream = await self._kept.get(loop.time() + self._timeout) if self._kept else None
        if stream is not None:
            msg = pb.AdmitStreamRequest(batch=call)
            reply = await stream.ask(msg, loop.time() + self._timeout)
        else:
            try:
                reply = await self._iam.AdmitMany(call, timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:  # a channel without TranslateErrors
                raise error_from_rpc(exc, "iam") from None
        verdicts = iter(reply.verdicts)
        out: list[Exception | None] = []
        for i in items:
            v = next(verdicts) if isinstance(i, pb.AdmitRequest) else None
            failed = v is not None and v.error_code
            out.append(error_from_wire(v.error_code, v.error_message) if v and failed else None)
        return out

    async def wait_idle(self) -> None:
        await self._queue.wait_idle()

    async def aclose(self) -> None:
        """End the stream (after the queue is idle)."""
        await self._queue.wait_idle()
        if self._kept is not None:
            await self._kept.aclose()
