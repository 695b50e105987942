"""The ``dsec.v1.Iam`` gRPC servicer: proto messages in, :class:`IamDb` calls, messages out.

The state is an :class:`~dsec.iam.state.IamState` (SQLite on its own thread by default, or
a StateStore such as etcd). Admit calls that arrive while an earlier batch is being decided
are queued and decided together in one transaction (``admit_many``): a burst of admissions
costs one disk sync or one Raft round, not one each. Who may call
what is :data:`ALLOWED_ROLES`; an edge may additionally only release and reconcile its own
sandboxes (checked here against the name in its certificate).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dsec.core.audit import AuditEvent
from dsec.core.batching import Batcher
from dsec.core.errors import DsecError, Internal, PermissionDenied, QuotaExceeded, Unauthenticated
from dsec.iam.admit_stream import AdmitStreamRpc
from dsec.iam.audit_rpcs import AuditRpcs, actor_of, event_from
from dsec.iam.join_rpcs import JoinTokenRpcs
from dsec.iam.records import Admission, KeyRecord, Project
from dsec.iam.signing import key_id as signing_key_id
from dsec.iam.state import IamState
from dsec.iam.token_rpcs import TokenRpcs
from dsec.obs import Metrics, log
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.server import peer_identity

_log = logging.getLogger("dsec.iam")
_Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

ALLOWED_ROLES: dict[str, set[str]] = {
    "dsec.v1.Iam": {"apiserver", "admin"},
    "/dsec.v1.Iam/Release": {"apiserver", "admin", "edge"},
    "/dsec.v1.Iam/Reconcile": {"apiserver", "admin", "edge"},
    "/dsec.v1.Iam/AppendAudit": {"apiserver", "admin", "edge"},
}
DEFAULT_RECONCILE_GRACE_S = 30.0
# How long after MoveAllocation the source edge is told to end the sandbox itself: longer
# than the apiserver's own EndMovedSandbox call may take (it does this when it does not die).
MOVE_SETTLE_S = 300.0


class IamService(AuditRpcs, TokenRpcs, JoinTokenRpcs, AdmitStreamRpc, pb_grpc.IamServicer):
    """Serves the Iam RPCs from an :class:`IamState` it owns (closed by :meth:`close`)."""

    def __init__(
        self,
        state: IamState,
        *,
        metrics: Metrics | None = None,
        reconcile_grace_s: float = DEFAULT_RECONCILE_GRACE_S,
        signing: tuple[str, Ed25519PrivateKey] | None = None,
        pki_dir: Path | None = None,
    ) -> None:
        self._state = state
        self.pki_dir = pki_dir
        if signing is None:  # tests: an ephemeral key
            key = Ed25519PrivateKey.generate()
            signing = (signing_key_id(key.public_key()), key)
        self._signing = signing
        self._metrics = metrics or Metrics("dsec_iam")
        self._grace = reconcile_grace_s
        # admissions and audit entries queue together: one transaction decides a burst
        self._queue: Batcher[Admission | AuditEvent, bool | AuditEvent] = Batcher(self._decide)

    async def _decide(
        self, items: Sequence[Admission | AuditEvent]
    ) -> list[bool | AuditEvent | Exception]:
        admissions = [i for i in items if isinstance(i, Admission)]
        events = [i for i in items if isinstance(i, AuditEvent)]
        verdicts, entries = await self._state.admit_and_append(admissions, events)
        v, e = iter(verdicts), iter(entries)
        return [next(v) if isinstance(i, Admission) else next(e) for i in items]

    async def admit(self, admission: Admission) -> bool:
        """Admit through the batching queue; same answers as ``IamDb.admit``."""
        new = await self._queue.submit(admission)
        assert isinstance(new, bool)
        return new

    async def batched_audit(self, event: AuditEvent) -> AuditEvent:
        """Append through the batching queue."""
        entry = await self._queue.submit(event)
        assert isinstance(entry, AuditEvent)
        return entry

    async def close(self) -> None:
        """Let queued admissions finish, then close the state."""
        await self._queue.wait_idle()
        await self._state.close()

    async def Authenticate(self, request: pb.AuthenticateRequest, context: _Ctx) -> pb.Principal:
        try:
            p = await self._state.authenticate(request.api_key)
        except Unauthenticated:
            self._metrics.inc("authentications", result="refused")
            raise
        self._metrics.inc("authentications", result="ok")
        return pb.Principal(subject=p.subject, project=p.project, role=p.role, key_id=p.key_id)

    async def CreateKey(self, request: pb.CreateKeyRequest, context: _Ctx) -> pb.CreateKeyReply:
        actor, rid = actor_of(context)
        token, rec = await self._state.create_key(
            request.subject, request.project, request.role, request.name, actor=actor,
            request_id=rid,
        )  # fmt: skip
        log(
            _log,
            "key created",
            key_id=rec.key_id,
            subject=rec.subject,
            project=rec.project,
            role=rec.role,
            by=peer_identity(context).spiffe_id,
        )
        return pb.CreateKeyReply(api_key=token, key_id=rec.key_id)

    async def ListKeys(self, request: pb.ListKeysRequest, context: _Ctx) -> pb.KeyList:
        keys = await self._state.list_keys(request.project)
        return pb.KeyList(keys=[_key_info(k) for k in keys])

    async def RevokeKey(self, request: pb.KeyRef, context: _Ctx) -> pb.Empty:
        actor, rid = actor_of(context)
        await self._state.revoke_key(request.key_id, actor=actor, request_id=rid)
        log(_log, "key revoked", key_id=request.key_id, by=peer_identity(context).spiffe_id)
        return pb.Empty()

    async def Admit(self, request: pb.AdmitRequest, context: _Ctx) -> pb.Empty:
        try:
            new = await self.admit(
                Admission(
                    request.project,
                    request.sandbox_id,
                    request.cpu,
                    request.memory_mb,
                    request.edge_id,
                )
            )
        except QuotaExceeded:
            self._metrics.inc("admissions", result="quota_exceeded")
            raise
        self._metrics.inc("admissions", result="admitted" if new else "repeated")
        return pb.Empty()

    async def AdmitMany(self, request: pb.AdmitBatch, context: _Ctx) -> pb.AdmitBatchReply:
        """Admissions and audit entries an apiserver coalesced: they join this iam's own
        queues (one transaction each per burst). An entry that cannot be appended fails
        the call, as AppendAudit would."""
        return await self.admit_batch(request, peer_identity(context).spiffe_id)

    async def admit_batch(self, request: pb.AdmitBatch, peer: str) -> pb.AdmitBatchReply:
        """:meth:`AdmitMany` for caller ``peer`` (its SPIFFE id)."""
        items: list[Admission | AuditEvent] = [
            Admission(r.project, r.sandbox_id, r.cpu, r.memory_mb, r.edge_id)
            for r in request.admissions
        ]
        items += [event_from(e, peer) for e in request.audit]
        decided = await self._queue.submit_many(items)
        results = decided[: len(request.admissions)]
        for r in decided[len(request.admissions) :]:
            if isinstance(r, Exception):
                raise r
        reply = pb.AdmitBatchReply()
        counts: dict[str, int] = {}
        for r in results:
            if isinstance(r, BaseException):
                err = r if isinstance(r, DsecError) else Internal(f"admission failed: {r}")
                result = err.code
                reply.verdicts.add(error_code=err.code, error_message=err.message)
            else:
                result = "admitted" if r else "repeated"
                reply.verdicts.add()
            counts[result] = counts.get(result, 0) + 1
        for result, n in counts.items():
            self._metrics.inc("admissions", float(n), result=result)
        return reply

    async def Release(self, request: pb.ReleaseRequest, context: _Ctx) -> pb.Empty:
        peer = peer_identity(context)
        edge = peer.name if peer.role == "edge" else ""
        alloc = await self._state.release(request.sandbox_id, edge_id=edge)
        if alloc is not None:
            self._metrics.inc("releases")
        return pb.Empty()

    async def MoveAllocation(self, request: pb.MoveAllocationRequest, context: _Ctx) -> pb.Empty:
        await self._state.move_allocation(request.from_sandbox_id, request.to_sandbox_id)
        self._metrics.inc("allocations_moved")
        return pb.Empty()

    async def Reconcile(self, request: pb.ReconcileRequest, context: _Ctx) -> pb.ReconcileReply:
        peer = peer_identity(context)
        if peer.role == "edge" and peer.name != request.edge_id:
            raise PermissionDenied(f"edge {peer.name} may not reconcile edge {request.edge_id!r}")
        gone = await self._state.reconcile(
            request.edge_id, list(request.live_sandbox_ids), self._grace
        )
        if gone:
            self._metrics.inc("reconciled_releases", float(len(gone)))
            log(
                _log,
                "released allocations the edge no longer holds",
                edge_id=request.edge_id,
                sandboxes=gone,
            )
        moved, unallocated = await self._state.settle_moves(
            request.edge_id,
            list(request.live_sandbox_ids),
            MOVE_SETTLE_S,
            list(request.running_sandbox_ids),
        )
        return pb.ReconcileReply(
            moved=[pb.MovedSandbox(sandbox_id=o, moved_to=n) for o, n in moved],
            unallocated=unallocated,
        )

    async def GetUsage(self, request: pb.ProjectRef, context: _Ctx) -> pb.Usage:
        u = await self._state.usage(request.project)
        return pb.Usage(
            project=u.project.name,
            sandboxes=u.sandboxes,
            cpu=u.cpu,
            memory_mb=u.memory_mb,
            max_sandboxes=u.project.max_sandboxes,
            max_cpu=u.project.max_cpu,
            max_memory_mb=u.project.max_memory_mb,
        )

    async def PutProject(self, request: pb.Project, context: _Ctx) -> pb.Project:
        wanted = Project(
            request.name, request.max_sandboxes, request.max_cpu, request.max_memory_mb
        )
        actor, rid = actor_of(context)
        p = await self._state.put_project(wanted, actor=actor, request_id=rid)
        log(
            _log,
            "project saved",
            project=p.name,
            max_sandboxes=p.max_sandboxes,
            max_cpu=p.max_cpu,
            max_memory_mb=p.max_memory_mb,
        )
        return _project_msg(p)

    async def ListProjects(self, request: pb.Empty, context: _Ctx) -> pb.ProjectList:
        projects = await self._state.list_projects()
        return pb.ProjectList(projects=[_project_msg(p) for p in projects])

    async def DeleteProject(self, request: pb.ProjectRef, context: _Ctx) -> pb.Empty:
        actor, rid = actor_of(context)
        await self._state.delete_project(request.project, actor=actor, request_id=rid)
        return pb.Empty()

    async def GrantRole(self, request: pb.RoleGrant, context: _Ctx) -> pb.Empty:
        actor, rid = actor_of(context)
        await self._state.grant_role(
            request.project, request.subject, request.role, actor=actor, request_id=rid
        )
        log(_log, "role granted", project=request.project, subject=request.subject,
            role=request.role or "(none)")  # fmt: skip
        return pb.Empty()

    async def ListGrants(self, request: pb.ListGrantsRequest, context: _Ctx) -> pb.GrantList:
        grants = await self._state.list_grants(request.subject, request.project)
        return pb.GrantList(
            grants=[pb.RoleGrant(project=g.project, subject=g.subject, role=g.role) for g in grants]
        )


def _key_info(k: KeyRecord) -> pb.KeyInfo:
    return pb.KeyInfo(
        key_id=k.key_id,
        subject=k.subject,
        project=k.project,
        role=k.role,
        name=k.name,
        created_at=k.created_at,
        revoked=k.revoked,
    )


def _project_msg(p: Project) -> pb.Project:
    return pb.Project(
        name=p.name, max_sandboxes=p.max_sandboxes, max_cpu=p.max_cpu, max_memory_mb=p.max_memory_mb
    )
