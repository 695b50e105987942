"""One call to the iam for many creates: concurrent admissions and audit entries of this
apiserver are queued while a call is in flight and go together in the next ``AdmitMany``
(a burst of creates then costs the iam one RPC and one transaction, not two RPCs each).

Each caller still gets its own answer: an admission its verdict (the DsecError the iam
raised, rebuilt from its code), an audit entry the call's outcome.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from dsec.core.batching import Batcher
from dsec.core.errors import error_from_wire
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.errors import error_from_rpc

MAX_BATCH = 256  # items per call
_Item = pb.AdmitRequest | pb.AuditEntry


class IamBatch:
    def __init__(self, iam: pb_grpc.IamAsyncStub, *, timeout_s: float = 10.0) -> None:
        self._iam = iam
        self._timeout = timeout_s
        self._queue: Batcher[_Item, None] = Batcher(self._send, max_batch=MAX_BATCH)
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
        try:
            reply = await self._iam.AdmitMany(call, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:  # a channel without TranslateErrors (hot path)
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
