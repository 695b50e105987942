"""One call to the iam for many creates: concurrent admissions and audit entries of this
apiserver are queued while a call is in flight and go together in the next ``AdmitMany``
(a burst of creates then costs the iam one RPC and one transaction, not two RPCs each).

Each caller still gets its own answer: an admission its verdict (the DsecError the iam
raised, rebuilt from its code), an audit entry the call's outcome.

Given the channel, the calls go as messages of one kept ``AdmitStream`` (the iam's end is
``dsec.iam.admit_stream``): a message costs a fraction of a unary call's gRPC work on both
ends. A message has the call's outcomes: the iam's answer or the DsecError it raised; the
stream breaking, or no reply within the call's timeout, fails the batch in flight as a
failed call does (``Unavailable``, ``DeadlineExceeded``: the iam may or may not have
decided it; an admission left behind is freed by its edge's reconcile) and the next batch
opens a new stream. The stream is authorized by the iam as a call is, and each message
again; when this apiserver's certificates change the next batch opens a new stream with
them. An iam without ``AdmitStream`` (UNIMPLEMENTED) gets unary calls, and is asked again
after :data:`UNARY_FOR_S`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from typing import cast

import grpc

from dsec.core.batching import Batcher
from dsec.core.errors import DeadlineExceeded, DsecError, Unavailable, error_from_wire
from dsec.obs import log
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.errors import error_from_rpc, error_from_status
from dsec.rpc.reload import ReloadingChannel

_log = logging.getLogger("dsec.apiserver.iam_batch")
MAX_BATCH = 256  # items per call
METHOD = "/dsec.v1.Iam/AdmitStream"
UNARY_FOR_S = 60.0  # an iam without AdmitStream gets unary calls this long, then is asked again
_Item = pb.AdmitRequest | pb.AuditEntry
_Call = grpc.aio.StreamStreamCall[pb.AdmitStreamRequest, pb.AdmitStreamReply]


class _Stream:
    """One open ``AdmitStream`` and the batches waiting for their replies (one at a time
    from the queue's single sender, but nothing here relies on it)."""

    def __init__(self, call: _Call, channel: grpc.aio.Channel) -> None:
        self.call = call
        self.channel = channel  # the inner channel it runs on (certificates of that time)
        self.error: DsecError | None = None  # what broke it
        self._waiting: dict[int, asyncio.Future[pb.AdmitBatchReply]] = {}
        self._ids = itertools.count(1)
        self._reader = asyncio.create_task(self._read())

    @property
    def broken(self) -> bool:
        return self.error is not None

    async def send(self, batch: pb.AdmitBatch, timeout_s: float) -> pb.AdmitBatchReply:
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        fut: asyncio.Future[pb.AdmitBatchReply] = loop.create_future()
        self._waiting[rid] = fut
        timer = loop.call_later(timeout_s, self._expire, rid)
        try:
            try:
                await self.call.write(pb.AdmitStreamRequest(id=rid, batch=batch))
            except grpc.aio.AioRpcError as exc:
                self._fail(error_from_rpc(exc, "iam"))
            except (grpc.aio.UsageError, asyncio.InvalidStateError):
                self._fail(self.error or Unavailable("the iam ended the admission stream"))
            return await fut
        finally:
            timer.cancel()
            self._waiting.pop(rid, None)

    def _expire(self, rid: int) -> None:
        fut = self._waiting.get(rid)
        if fut is not None and not fut.done():  # stuck: give it up, with the stream
            self._fail(DeadlineExceeded("the iam did not answer in time"))

    async def _read(self) -> None:
        err: DsecError
        try:
            while (reply := await self.call.read()) is not grpc.aio.EOF:
                assert isinstance(reply, pb.AdmitStreamReply)
                fut = self._waiting.pop(reply.id, None)
                if fut is None or fut.done():
                    continue
                if reply.error_code:
                    fut.set_exception(error_from_wire(reply.error_code, reply.error_message))
                else:
                    fut.set_result(reply.reply)
            err = Unavailable("the iam ended the admission stream")
        except grpc.aio.AioRpcError as exc:
            err = error_from_rpc(exc, "iam")
        except asyncio.CancelledError:
            err = Unavailable("the admission stream to the iam was closed")
        self._fail(err)

    def _fail(self, err: DsecError) -> None:
        if self.error is None:
            self.error = err
            self.call.cancel()
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(err)

    async def aclose(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class IamBatch:
    def __init__(
        self, iam: pb_grpc.IamAsyncStub, *, channel: grpc.aio.Channel | None = None,
        timeout_s: float = 10.0,
    ) -> None:  # fmt: skip
        """``iam``: a stub on a channel without TranslateErrors (a hot path); ``channel``:
        that channel, to send the calls as messages of a kept stream (None: unary calls)."""
        self._iam = iam
        self._channel = channel
        self._timeout = timeout_s
        self._queue: Batcher[_Item, None] = Batcher(self._send, max_batch=MAX_BATCH)
        self._stream: _Stream | None = None
        self._unary_until = 0.0 if channel is not None else float("inf")
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
        stream = await self._open()
        if stream is not None:
            reply = await stream.send(call, self._timeout)
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

    def _current_channel(self) -> grpc.aio.Channel:
        ch = self._channel
        assert ch is not None
        return ch.current() if isinstance(ch, ReloadingChannel) else ch

    async def _open(self) -> _Stream | None:
        """The open stream (opened now if there is none, it broke, or the certificates
        changed), or None for a unary call."""
        if time.monotonic() < self._unary_until:
            return None
        stream = self._stream
        if stream is not None and not stream.broken and stream.channel is self._current_channel():
            return stream
        self._stream = None
        if stream is not None:
            await stream.aclose()
        channel = self._current_channel()
        opened = channel.stream_stream(
            METHOD,
            request_serializer=pb.AdmitStreamRequest.SerializeToString,
            response_deserializer=pb.AdmitStreamReply.FromString,
        )()
        call = cast(_Call, opened)
        try:
            await asyncio.wait_for(call.initial_metadata(), self._timeout)
            ended = call.done()  # refused (not authorized, unreachable) or not served
            code = await call.code() if ended else grpc.StatusCode.OK
        except TimeoutError:
            call.cancel()
            raise DeadlineExceeded("the iam did not answer in time") from None
        except grpc.aio.AioRpcError as exc:
            ended, code = True, exc.code()
        if not ended:
            self._stream = _Stream(call, channel)
            return self._stream
        if code == grpc.StatusCode.UNIMPLEMENTED:
            log(_log, "iam has no admission stream: unary AdmitMany calls")
            self._unary_until = time.monotonic() + UNARY_FOR_S
            return None
        trailing = await call.trailing_metadata()
        pairs = tuple((str(k), v) for k, v in trailing) if trailing else None
        raise error_from_status(code, await call.details() or "", pairs, "iam")

    async def wait_idle(self) -> None:
        await self._queue.wait_idle()

    async def aclose(self) -> None:
        """End the stream (after the queue is idle)."""
        await self._queue.wait_idle()
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()
