"""Sandbox lifecycle routes: create (admit + schedule), list, get, kill, set timeout and
network policy."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from dsec.apiserver import audit, sandbox_move, snapshot_copy
from dsec.apiserver.admission import admit_and_create, release
from dsec.apiserver.auth import PLATFORM
from dsec.apiserver.context import ctx, json_body, ok, principal, sandbox_id
from dsec.apiserver.roles import require_admin_on
from dsec.apiserver.upstream import rpc
from dsec.core import projects
from dsec.core.errors import (
    DsecError,
    InvalidArgument,
    NodeFull,
    Unavailable,
)
from dsec.core.ids import RANDOM_BYTES, edge_of, new_sandbox_id
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.convert import spec_json

MAX_EDGE_TRIES = 3


def info_json(info: pb.SandboxInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "project": info.project,
        "owner": info.owner,
        "state": info.state,
        "edge_id": info.edge_id,
        "created_at": info.created_at,
        "started_at": info.started_at,
        "expires_at": info.expires_at,
        "error": info.error,
        "spec": spec_json(info.spec),
        "network_stats": dict(info.network_stats),
        "moved_to": info.moved_to,
    }


async def create(request: web.Request) -> web.Response:
    p = principal(request)
    p.require("member")
    body = await json_body(request)
    if "snapshot" in body:
        from dsec.apiserver import snapshots

        return ok(info_json(await snapshots.create_sandbox(request, body)), status=201)
    project = body.pop("project", None) or p.project
    if not isinstance(project, str):
        raise InvalidArgument("'project' must be a project path")
    projects.validate(project)
    p.require_on(project, "member")
    request["audit_project"] = project
    if body.get("trajectory") is not None:
        from dsec.apiserver import trajectories

        return await trajectories.create(request, project, body)
    info = await create_sandbox(request, project, SandboxSpec.from_dict(body))
    return ok(info_json(info), status=201)


async def create_sandbox(request: web.Request, project: str, spec: SandboxSpec) -> pb.SandboxInfo:
    """Admit and place one sandbox (trying up to MAX_EDGE_TRIES edges) and start it."""
    c = ctx(request)
    edges = await c.upstream.edges()
    order = c.upstream.placement.order(edges, spec.backend, spec.memory_mb, limit=MAX_EDGE_TRIES)
    return await admit_and_create(request, project, spec, order)


async def list_(request: web.Request) -> web.Response:
    c, p = ctx(request), principal(request)
    p.require("viewer")
    include = request.query.get("all", "").lower() in ("1", "true", "yes")
    edges = [e for e in await c.upstream.edges() if e.healthy]
    project = request.query.get("project", "")  # the edges show only what the caller sees
    req = pb.ListSandboxesRequest(project=project, include_terminated=include)
    replies = await asyncio.gather(
        *(
            rpc(
                f"edge {e.edge_id}",
                c.upstream.edge_stub(e).ListSandboxes(req, metadata=p.metadata(), timeout=10),
            )
            for e in edges
        )
    )
    items = [info_json(i) for r in replies for i in r.sandboxes]
    items.sort(key=lambda i: i["created_at"])
    return ok({"sandboxes": items})


async def _on_sandbox(request: web.Request, role: str, verb: str) -> web.Response:
    """Apply one of the edge's SandboxRef calls (GetSandbox, KillSandbox, ...) to the
    sandbox named in the path and answer its SandboxInfo."""
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require(role)
    stub = await c.upstream.edge_for(sid)
    call = getattr(stub, verb)
    info = await call(pb.SandboxRef(sandbox_id=sid), metadata=p.metadata(), timeout=60)
    return ok(info_json(info))


async def get(request: web.Request) -> web.Response:
    """One sandbox."""
    return await _on_sandbox(request, "viewer", "GetSandbox")


async def kill(request: web.Request) -> web.Response:
    """Stop a sandbox and remove everything it had."""
    return await _on_sandbox(request, "member", "KillSandbox")


async def pause(request: web.Request) -> web.Response:
    """Freeze every process of a running sandbox."""
    return await _on_sandbox(request, "member", "PauseSandbox")


async def resume(request: web.Request) -> web.Response:
    """Thaw a paused sandbox. ``{"edge": E}`` (or, for a microVM, its own edge being full)
    resumes it on that edge instead, under a new id (``sandbox_move``)."""
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    body = await json_body(request)
    if set(body) - {"edge"}:
        raise InvalidArgument(f"resume takes only 'edge', not {', '.join(sorted(set(body)))}")
    target = body.get("edge") or ""
    if not isinstance(target, str):
        raise InvalidArgument("'edge' must be an edge id")
    stub = await c.upstream.edge_for(sid)
    ref = pb.SandboxRef(sandbox_id=sid)
    if target and target != edge_of(sid):
        info = await rpc("edge", stub.GetSandbox(ref, metadata=p.metadata(), timeout=10))
        entry = await snapshot_copy.edge_entry(request, target)
        return ok(info_json(await sandbox_move.resume_on(request, info, entry)))
    return ok(info_json(await _resume_here_or_move(request, sid, stub)))


async def _resume_here_or_move(request: web.Request, sid: str, stub: Any) -> pb.SandboxInfo:
    """Resume ``sid`` on its edge; a microVM whose edge is full moves to the best other one
    (under a new id: the answer's ``id``)."""
    c, p = ctx(request), principal(request)
    ref = pb.SandboxRef(sandbox_id=sid)
    try:
        info: pb.SandboxInfo = await rpc(
            "edge", stub.ResumeSandbox(ref, metadata=p.metadata(), timeout=60)
        )
        return info
    except NodeFull as full:
        info = await rpc("edge", stub.GetSandbox(ref, metadata=p.metadata(), timeout=10))
        if info.spec.backend != "microvm":
            raise
        others = [e for e in await c.upstream.edges() if e.edge_id != info.edge_id]
        try:
            there = c.upstream.placement.order(
                others, info.spec.backend, info.spec.memory_mb, limit=1
            )
        except Unavailable:
            raise full from None
        return await sandbox_move.resume_on(request, info, there[0])


BATCH_VERBS = {
    "pause": ("PauseSandbox", "sandbox.pause"),
    "resume": ("ResumeSandbox", "sandbox.resume"),
    "kill": ("KillSandbox", "sandbox.kill"),
}
MAX_BATCH = 1000
BATCH_CONCURRENCY = 32  # edge calls in flight per batch request


async def batch(request: web.Request) -> web.Response:
    """``POST /v1/sandboxes:batch`` with ``{"action": "pause|resume|kill", "ids": [...]}``
    or ``{"action": ..., "project": "org/team"}`` (every live sandbox of the project and its
    subprojects). Each sandbox is authorized by its edge and audited on its own; the answer
    lists one result per sandbox: ``{"id", "ok": true, "sandbox"}`` or ``{"id", "ok": false,
    "error"}``, in the order of ``ids``. A resume does what a single one does: a microVM whose
    edge is full resumes on another edge (``sandbox.id`` is then its new id)."""
    c, p = ctx(request), principal(request)
    p.require("member")
    body = await json_body(request)
    action = body.get("action")
    if action not in BATCH_VERBS:
        raise InvalidArgument(f"'action' must be one of {', '.join(BATCH_VERBS)}, not {action!r}")
    verb, audit_action = BATCH_VERBS[action]
    unknown = set(body) - {"action", "ids", "project"}
    if unknown:
        raise InvalidArgument(f"unknown batch field(s): {', '.join(sorted(unknown))}")
    if ("ids" in body) == ("project" in body):
        raise InvalidArgument("give exactly one of 'ids' (a list of sandbox ids) or 'project'")
    if "ids" in body:
        ids = body["ids"]
        if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
            raise InvalidArgument("'ids' must be a list of sandbox ids")
        ids = list(dict.fromkeys(ids))  # once each, in the order given
        scope = p.project
    else:
        scope = body["project"]
        if not isinstance(scope, str):
            raise InvalidArgument("'project' must be a project path")
        projects.validate(scope)
        p.require_on(scope, "member")
        ids = await _live_ids(request, scope)
    if len(ids) > MAX_BATCH:
        raise InvalidArgument(f"at most {MAX_BATCH} sandboxes per batch, got {len(ids)}")
    gate = asyncio.Semaphore(BATCH_CONCURRENCY)
    rid = str(request.get("request_id", ""))

    async def one(sid: str) -> dict[str, Any]:
        err: DsecError | None = None
        project = scope
        async with gate:
            try:
                stub = await c.upstream.edge_for(sid)
                if action == "resume":  # as a single resume: a full edge moves a microVM
                    info = await _resume_here_or_move(request, sid, stub)
                else:
                    call = getattr(stub, verb)
                    ref = pb.SandboxRef(sandbox_id=sid)
                    info = await rpc("edge", call(ref, metadata=p.metadata(), timeout=60))
                project = info.project
                out: dict[str, Any] = {"id": sid, "ok": True, "sandbox": info_json(info)}
            except DsecError as exc:
                err = exc
                out = {"id": sid, "ok": False, "error": exc.to_wire()}
        result = "ok" if err is None else err.code
        await audit.append(request, p, audit_action, sid, project, result, err, rid)
        return out

    results = await asyncio.gather(*(one(sid) for sid in ids))
    c.metrics.inc("sandbox_batches", action=action)
    return ok({"action": action, "results": results})


async def _live_ids(request: web.Request, project: str) -> list[str]:
    """Ids of the live sandboxes of ``project`` (and its subprojects), on every edge."""
    c, p = ctx(request), principal(request)
    req = pb.ListSandboxesRequest(project=project, include_terminated=False)
    edges = [e for e in await c.upstream.edges() if e.healthy]
    replies = await asyncio.gather(
        *(
            rpc(
                f"edge {e.edge_id}",
                c.upstream.edge_stub(e).ListSandboxes(req, metadata=p.metadata(), timeout=10),
            )
            for e in edges
        )
    )
    infos = sorted((i for r in replies for i in r.sandboxes), key=lambda i: i.created_at)
    return [i.id for i in infos]


async def fork(request: web.Request) -> web.Response:
    """``POST /v1/sandboxes/{id}/fork`` with ``{"count": N, "timeout_s"?: S, "edge"?: E}``:
    N children from a memory snapshot, each admitted by iam (project quota) first like a
    create. ``edge`` (or the parent's edge being full) puts them on another edge: a full
    snapshot of the parent is copied there (``snapshot_copy.fork_to``)."""
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    body = await json_body(request)
    count = body.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 64:
        raise InvalidArgument("count must be an integer between 1 and 64")
    timeout_s = body.get("timeout_s")
    if timeout_s is not None:
        SandboxSpec(timeout_s=timeout_s if isinstance(timeout_s, int) else -1)
    target = body.get("edge") or ""
    if not isinstance(target, str):
        raise InvalidArgument("'edge' must be an edge id")
    stub = await c.upstream.edge_for(sid)
    parent = await rpc(
        "edge", stub.GetSandbox(pb.SandboxRef(sandbox_id=sid), metadata=p.metadata(), timeout=10)
    )
    edge = edge_of(sid)
    if target and target != edge:
        entry = await snapshot_copy.edge_entry(request, target)
        made = await snapshot_copy.fork_to(request, parent, count, entry, timeout_s)
        c.metrics.inc("sandboxes_forked_elsewhere", count)
        return ok({"sandboxes": [info_json(i) for i in made]})
    ids = [new_sandbox_id(edge, os.urandom(RANDOM_BYTES)) for _ in range(count)]
    admitted: list[str] = []
    try:
        for cid in ids:
            admit = pb.AdmitRequest(project=parent.project, sandbox_id=cid, cpu=parent.spec.cpu,
                                    memory_mb=parent.spec.memory_mb, edge_id=edge)  # fmt: skip
            await rpc("iam", c.upstream.iam.Admit(admit, timeout=10))
            admitted.append(cid)
        req = pb.ForkSandboxRequest(sandbox_id=sid, count=count, child_ids=ids)
        reply = await rpc("edge", stub.ForkSandbox(req, metadata=p.metadata(), timeout=300))
    except BaseException as exc:
        await asyncio.shield(release(request, admitted))
        if not isinstance(exc, NodeFull) or parent.spec.backend != "microvm":
            raise
        # the parent's edge is full: fork onto the best other edge, through a snapshot copy
        others = [e for e in await c.upstream.edges() if e.edge_id != edge]
        spec = parent.spec
        try:
            there = c.upstream.placement.order(others, spec.backend, spec.memory_mb, limit=1)
        except Unavailable:
            raise exc from None
        made = await snapshot_copy.fork_to(request, parent, count, there[0], timeout_s)
        c.metrics.inc("sandboxes_forked_elsewhere", count)
        return ok({"sandboxes": [info_json(i) for i in made]})
    children = list(reply.sandboxes)
    if timeout_s is not None:
        children = [
            await rpc(
                "edge",
                stub.SetTimeout(
                    pb.SetTimeoutRequest(sandbox_id=ch.id, timeout_s=timeout_s),
                    metadata=p.metadata(),
                    timeout=10,
                ),
            )
            for ch in children
        ]
    c.metrics.inc("sandboxes_created", count)
    return ok({"sandboxes": [info_json(i) for i in children]})


async def set_timeout(request: web.Request) -> web.Response:
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    body = await json_body(request)
    timeout_s = body.get("timeout_s")
    SandboxSpec(timeout_s=timeout_s if isinstance(timeout_s, int) else -1)
    stub = await c.upstream.edge_for(sid)
    info = await rpc(
        "edge",
        stub.SetTimeout(
            pb.SetTimeoutRequest(sandbox_id=sid, timeout_s=int(timeout_s or 0)),
            metadata=p.metadata(),
            timeout=10,
        ),
    )
    return ok(info_json(info))


async def set_network(request: web.Request) -> web.Response:
    """``PUT /v1/sandboxes/{id}/network`` with ``{"allow": [...], "deny": [...]}``."""
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    policy = NetworkPolicy.from_dict(await json_body(request))
    stub = await c.upstream.edge_for(sid)
    info = await rpc(
        "edge",
        stub.SetNetwork(
            pb.SetNetworkRequest(
                sandbox_id=sid,
                network=pb.NetworkPolicy(allow=policy.allow, deny=policy.deny),
            ),
            metadata=p.metadata(),
            timeout=10,
        ),
    )
    return ok(info_json(info))


async def edges(request: web.Request) -> web.Response:
    c, p = ctx(request), principal(request)
    require_admin_on(p, PLATFORM)
    out = []
    for e in await c.upstream.edges(fresh=True):
        d = MessageToDict(e.view.status, preserving_proto_field_name=True)
        d.update(healthy=e.healthy, last_seen=e.view.last_seen)
        out.append(d)
    return ok({"edges": out})


ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/sandboxes", create),
    ("POST", "/v1/sandboxes:batch", batch),
    ("GET", "/v1/sandboxes", list_),
    ("GET", "/v1/sandboxes/{sandbox_id}", get),
    ("DELETE", "/v1/sandboxes/{sandbox_id}", kill),
    ("POST", "/v1/sandboxes/{sandbox_id}/timeout", set_timeout),
    ("POST", "/v1/sandboxes/{sandbox_id}/pause", pause),
    ("POST", "/v1/sandboxes/{sandbox_id}/resume", resume),
    ("POST", "/v1/sandboxes/{sandbox_id}/fork", fork),
    ("PUT", "/v1/sandboxes/{sandbox_id}/network", set_network),
    ("GET", "/v1/edges", edges),
]
