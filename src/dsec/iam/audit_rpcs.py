"""The audit RPCs of the iam (a mixin of :class:`dsec.iam.service.IamService`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from dsec.core.audit import AuditEvent
from dsec.iam.audit import AuditQuery
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.server import peer_identity

if TYPE_CHECKING:
    from dsec.iam.state import IamState
_Ctx: TypeAlias = grpc.aio.ServicerContext[Any, Any]


def actor_of(context: _Ctx) -> tuple[str, str]:
    """(actor, request id): the end user the apiserver forwards, else the calling component."""
    md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    peer = peer_identity(context).spiffe_id
    subject = md.get("x-dsec-subject", "")
    actor = f"{subject} via {peer}" if subject else peer
    return actor, md.get("x-request-id", "")


def _entry(e: AuditEvent) -> pb.AuditEntry:
    return pb.AuditEntry(
        seq=e.seq, ts=e.ts, actor=e.actor, action=e.action, project=e.project, target=e.target,
        result=e.result, request_id=e.request_id, details=e.details, prev_hash=e.prev_hash,
        hash=e.hash,
    )  # fmt: skip


def event_from(request: pb.AuditEntry, peer: str) -> AuditEvent:
    """The event a component asked to append, its actor naming the calling component."""
    actor = request.actor or peer
    if peer not in actor:
        actor = f"{actor} via {peer}"
    return AuditEvent(
        ts=0.0, actor=actor, action=request.action, project=request.project,
        target=request.target, result=request.result or "ok",
        request_id=request.request_id, details=request.details,
    )  # fmt: skip


class AuditRpcs:
    """The audit RPCs, mixed into :class:`IamService`."""

    _state: IamState

    async def batched_audit(self, event: AuditEvent) -> AuditEvent:
        raise NotImplementedError

    async def AppendAudit(self, request: pb.AuditEntry, context: _Ctx) -> pb.Empty:
        await self.batched_audit(event_from(request, peer_identity(context).spiffe_id))
        return pb.Empty()

    async def QueryAudit(self, request: pb.AuditQuery, context: _Ctx) -> pb.AuditList:
        q = AuditQuery(
            since=request.since, until=request.until, project=request.project,
            actor=request.actor, action=request.action, after_seq=request.after_seq,
            limit=request.limit or 1000,
        )  # fmt: skip
        entries = await self._state.query_audit(q)
        return pb.AuditList(entries=[_entry(e) for e in entries])

    async def VerifyAudit(self, request: pb.Empty, context: _Ctx) -> pb.AuditVerdict:
        count, broken, head = await self._state.verify_audit()
        return pb.AuditVerdict(entries=count, broken_at=broken or 0, head_hash=head)
