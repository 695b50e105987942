"""Sandbox lifecycle routes: create (admit + schedule), list, get, kill, set timeout and
network policy."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from dsec.apiserver import audit
from dsec.apiserver.context import ctx, json_body, ok, principal, sandbox_id
from dsec.apiserver.upstream import EdgeEntry, rpc
from dsec.core import projects
from dsec.core.errors import (
    BackendUnavailable,
    DsecError,
    InvalidArgument,
    NodeFull,
    PermissionDenied,
    Unavailable,
)
from dsec.core.ids import RANDOM_BYTES, new_sandbox_id
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.convert import spec_from_pb, spec_to_pb

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
        "spec": spec_from_pb(info.spec).to_dict(),
        "network_stats": dict(info.network_stats),
    }


def _placement(edges: list[EdgeEntry], backend: str) -> list[EdgeEntry]:
    """Healthy edges offering the backend, the least loaded (by memory) first."""
    healthy = [e for e in edges if e.healthy]
    if not healthy:
        raise Unavailable("no healthy edge is reporting to the watcher")
    fit = [e for e in healthy if backend in e.view.status.backends]
    if not fit:
        offered = sorted({b for e in healthy for b in e.view.status.backends})
        raise BackendUnavailable(
            f"no edge offers backend {backend!r} (offered: {', '.join(offered) or 'none'})"
        )

    def free(e: EdgeEntry) -> float:
        s = e.view.status
        return s.memory_total_mb * 4 - s.memory_allocated_mb

    return sorted(fit, key=free, reverse=True)


async def create(request: web.Request) -> web.Response:
    c, p = ctx(request), principal(request)
    p.require("member")
    body = await json_body(request)
    project = body.pop("project", None) or p.project
    if not isinstance(project, str):
        raise InvalidArgument("'project' must be a project path")
    projects.validate(project)
    if not (p.admin or projects.contains(p.project, project)):
        raise PermissionDenied(f"project {project!r} is outside your project {p.project!r}")
    request["audit_project"] = project
    spec = SandboxSpec.from_dict(body)
    req_spec = spec_to_pb(spec)
    last: DsecError = NodeFull("every edge is full")
    for entry in _placement(await c.upstream.edges(), spec.backend)[:MAX_EDGE_TRIES]:
        sid = new_sandbox_id(entry.edge_id, os.urandom(RANDOM_BYTES))
        request[audit.TARGET] = sid
        admit = pb.AdmitRequest(
            project=project,
            sandbox_id=sid,
            cpu=spec.cpu,
            memory_mb=spec.memory_mb,
            edge_id=entry.edge_id,
        )
        await rpc("iam", c.upstream.iam.Admit(admit, timeout=10))
        try:
            info = await rpc(
                f"edge {entry.edge_id}",
                c.upstream.edge_stub(entry).CreateSandbox(
                    pb.CreateSandboxRequest(
                        spec=req_spec, project=project, owner=p.subject, sandbox_id=sid
                    ),
                    metadata=p.metadata(),
                    timeout=120,
                ),
            )
        except BaseException as exc:
            await asyncio.shield(_release(request, sid))
            if isinstance(exc, NodeFull):
                last = exc
                continue
            raise
        c.metrics.inc("sandboxes_created")
        return ok(info_json(info), status=201)
    raise last


async def _release(request: web.Request, sid: str) -> None:
    try:
        await rpc(
            "iam", ctx(request).upstream.iam.Release(pb.ReleaseRequest(sandbox_id=sid), timeout=10)
        )
    except DsecError:
        pass  # the edge's periodic reconcile frees it


async def list_(request: web.Request) -> web.Response:
    c, p = ctx(request), principal(request)
    p.require("viewer")
    include = request.query.get("all", "").lower() in ("1", "true", "yes")
    edges = [e for e in await c.upstream.edges() if e.healthy]
    project = request.query.get("project", "" if p.admin else p.project)
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
    """Thaw a paused sandbox."""
    return await _on_sandbox(request, "member", "ResumeSandbox")


async def fork(request: web.Request) -> web.Response:
    """``POST /v1/sandboxes/{id}/fork`` with ``{"count": N}``: N children from a snapshot."""
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    body = await json_body(request)
    count = body.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 64:
        raise InvalidArgument("count must be an integer between 1 and 64")
    stub = await c.upstream.edge_for(sid)
    reply = await rpc(
        "edge",
        stub.ForkSandbox(
            pb.ForkSandboxRequest(sandbox_id=sid, count=count), metadata=p.metadata(), timeout=300
        ),
    )
    return ok({"sandboxes": [info_json(i) for i in reply.sandboxes]})


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
    p.require("admin")
    out = []
    for e in await c.upstream.edges(fresh=True):
        d = MessageToDict(e.view.status, preserving_proto_field_name=True)
        d.update(healthy=e.healthy, last_seen=e.view.last_seen)
        out.append(d)
    return ok({"edges": out})


ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/sandboxes", create),
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
