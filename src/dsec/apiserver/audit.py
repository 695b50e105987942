"""Audit of sandbox lifecycle actions, and the admin routes that read the audit log.

The iam stores the log (append-only, hash-chained, see ``dsec.core.audit``). IAM mutations
are recorded by the iam itself in the same transaction; the apiserver records every
lifecycle action it forwarded (create, kill, pause, resume, timeout) with its result once
the edge answered. A failed append is logged and counted; it does not undo the action.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from dsec.apiserver.auth import PLATFORM, Principal
from dsec.apiserver.context import ctx, ok, principal
from dsec.apiserver.roles import require_admin_on
from dsec.core.errors import DsecError, InvalidArgument
from dsec.obs import log
from dsec.rpc._gen import dsec_pb2 as pb

_log = logging.getLogger("dsec.apiserver")

_S = "/v1/sandboxes/{sandbox_id}"
ACTIONS: dict[tuple[str, str], str] = {
    ("POST", "/v1/sandboxes"): "sandbox.create",
    ("DELETE", _S): "sandbox.kill",
    ("POST", f"{_S}/pause"): "sandbox.pause",
    ("POST", f"{_S}/fork"): "sandbox.fork",
    ("POST", f"{_S}/snapshots"): "snapshot.create",
    ("DELETE", "/v1/snapshots/{snapshot_id}"): "snapshot.delete",
    ("POST", f"{_S}/resume"): "sandbox.resume",
    ("POST", f"{_S}/timeout"): "sandbox.set_timeout",
    ("POST", f"{_S}/trajectory"): "trajectory.bind",
    ("POST", f"{_S}/checkpoint"): "trajectory.checkpoint",
    ("DELETE", "/v1/trajectories/{tid}"): "trajectory.remove",
    ("PUT", "/v1/trajectory-quota"): "trajectory.set_quota",
}

TARGET = "audit_target"  # request key a handler sets when the target is not in the path


async def record(request: web.Request, route: str, status: int, error: DsecError | None,
                 request_id: str) -> None:  # fmt: skip
    """Append the audit event of this request, if its route is audited."""
    action = ACTIONS.get((request.method, route))
    p = request.get("principal")
    if action is None or not isinstance(p, Principal):
        return
    target = request.match_info.get("sandbox_id") or str(request.get(TARGET, ""))
    project = str(request.get("audit_project") or p.project)
    result = "ok" if error is None and status < 400 else (error.code if error else str(status))
    await append(request, p, action, target, project, result, error, request_id)


async def append(request: web.Request, p: Principal, action: str, target: str, project: str,
                 result: str, error: DsecError | None, request_id: str) -> None:  # fmt: skip
    """Append one audit event (one per sandbox for batch actions); failures are counted."""
    entry = pb.AuditEntry(
        actor=f"{p.subject} (key {p.key_id})", action=action, target=target, project=project,
        result=result, request_id=request_id, details=error.message if error else "",
    )  # fmt: skip
    c = ctx(request)
    try:
        await c.upstream.iam_batch.audit(entry)
    except DsecError as exc:
        c.metrics.inc("audit_append_failures")
        log(_log, "audit append failed", logging.ERROR, action=action, target=target,
            request_id=request_id, error=exc.message)  # fmt: skip


def _time(value: str, name: str) -> float:
    """Seconds since the epoch, an ISO-8601 time, or an age like 30s, 10m, 2h, 7d."""
    if not value:
        return 0.0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if value[-1] in units and value[:-1].replace(".", "", 1).isdigit():
            return time.time() - float(value[:-1]) * units[value[-1]]
        if value.replace(".", "", 1).isdigit():
            return float(value)
        from datetime import datetime

        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise InvalidArgument(f"{name}: not a time or an age like 10m: {value!r}") from None


def entry_json(e: pb.AuditEntry) -> dict[str, Any]:
    return {
        "seq": e.seq, "ts": e.ts, "actor": e.actor, "action": e.action, "project": e.project,
        "target": e.target, "result": e.result, "request_id": e.request_id,
        "details": e.details, "prev_hash": e.prev_hash, "hash": e.hash,
    }  # fmt: skip


async def list_audit(request: web.Request) -> web.Response:
    """Query the audit log by time range, project, actor and action (platform admin, or
    admin of the project asked for)."""
    c, p = ctx(request), principal(request)
    q = request.query
    require_admin_on(p, q.get("project", "") or PLATFORM)
    limit = q.get("limit", "1000")
    after = q.get("after", "0")
    if not limit.isdigit() or not after.isdigit():
        raise InvalidArgument("'limit' and 'after' must be non-negative integers")
    reply = await c.upstream.iam.QueryAudit(
        pb.AuditQuery(
            since=_time(q.get("since", ""), "since"), until=_time(q.get("until", ""), "until"),
            project=q.get("project", ""), actor=q.get("actor", ""), action=q.get("action", ""),
            after_seq=int(after), limit=int(limit),
        ),
        metadata=p.metadata(), timeout=30,
    )  # fmt: skip
    return ok({"entries": [entry_json(e) for e in reply.entries]})


async def verify_audit(request: web.Request) -> web.Response:
    """Check the audit log's hash chain end to end (platform admin)."""
    c, p = ctx(request), principal(request)
    require_admin_on(p, PLATFORM)
    v = await c.upstream.iam.VerifyAudit(pb.Empty(), metadata=p.metadata(), timeout=60)
    return ok({"entries": v.entries, "intact": v.broken_at == 0,
               "broken_at": v.broken_at or None, "head_hash": v.head_hash})  # fmt: skip


ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/v1/audit", list_audit),
    ("GET", "/v1/audit/verify", verify_audit),
]
