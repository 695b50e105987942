"""Named snapshot routes: take one of a running sandbox, list, get, delete, and create a
sandbox from one (``POST /v1/sandboxes`` with ``{"snapshot": id}``).

A snapshot lives on the edge of its source sandbox; its id names that edge, so every call
goes straight there. A sandbox made from a snapshot starts on that same edge, admitted by
iam (project quota) like any create. A full (microVM) snapshot can start a sandbox on
another edge too (``"edge": id`` asks for one; otherwise when the snapshot's edge is full):
the snapshot is copied there first (``snapshot_copy``: streamed, verified by digest).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from aiohttp import web

from dsec.apiserver import audit, snapshot_copy
from dsec.apiserver.admission import admit_and_create
from dsec.apiserver.context import ctx, json_body, ok, principal, sandbox_id
from dsec.apiserver.upstream import EdgeEntry, rpc
from dsec.core import projects
from dsec.core.errors import (
    InvalidArgument,
    NodeFull,
    SnapshotNotFound,
    Unavailable,
)
from dsec.core.ids import (
    RANDOM_BYTES,
    edge_of,
    new_snapshot_id,
    snapshot_edge_of,
)
from dsec.core.spec import SandboxSpec
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.convert import spec_json

FROM_SNAPSHOT_FIELDS = {"snapshot", "project", "timeout_s", "metadata", "edge"}


def snapshot_json(info: pb.SnapshotInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "name": info.name,
        "project": info.project,
        "owner": info.owner,
        "source_sandbox": info.source_sandbox,
        "backend": info.backend,
        "mode": info.mode,
        "size_bytes": info.size_bytes,
        "created_at": info.created_at,
        "edge_id": info.edge_id,
        "spec": spec_json(info.spec),
    }


async def _edge(request: web.Request, snapshot_id: str) -> EdgeEntry:
    """The edge holding ``snapshot_id`` (SnapshotNotFound if malformed or its edge is
    unknown; Unavailable naming the edge if it is down)."""
    edge_id = snapshot_edge_of(snapshot_id)
    c = ctx(request)
    for fresh in (False, True):
        for e in await c.upstream.edges(fresh=fresh):
            if e.edge_id == edge_id:
                if not e.healthy:
                    raise Unavailable(
                        f"snapshot {snapshot_id} is on edge {edge_id}, which is down "
                        "(its files are only there: it cannot be used or copied until it is back)"
                    )
                return e
    raise SnapshotNotFound(f"no snapshot {snapshot_id} (its edge {edge_id} is unknown)")


def _snapshot_id(request: web.Request) -> str:
    sid = request.match_info["snapshot_id"]
    snapshot_edge_of(sid)
    return sid


async def create_snapshot(request: web.Request) -> web.Response:
    """``POST /v1/sandboxes/{id}/snapshots`` with ``{"name"?, "mode"?: "full"|"filesystem"}``:
    a named snapshot of the running sandbox, which keeps running."""
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    body = await json_body(request)
    unknown = set(body) - {"name", "mode"}
    if unknown:
        raise InvalidArgument(f"unknown snapshot field(s): {', '.join(sorted(unknown))}")
    name, mode = body.get("name") or "", body.get("mode") or ""
    if not isinstance(name, str) or not isinstance(mode, str):
        raise InvalidArgument("'name' and 'mode' must be strings")
    snap_id = new_snapshot_id(edge_of(sid), os.urandom(RANDOM_BYTES))
    stub = await c.upstream.edge_for(sid)
    req = pb.CreateSnapshotRequest(sandbox_id=sid, snapshot_id=snap_id, name=name, mode=mode)
    info = await rpc("edge", stub.CreateSnapshot(req, metadata=p.metadata(), timeout=300))
    request["audit_project"] = info.project
    c.metrics.inc("snapshots_created", backend=info.backend)
    return ok(snapshot_json(info), status=201)


async def list_snapshots(request: web.Request) -> web.Response:
    """``GET /v1/snapshots?project=&sandbox_id=&name=``: the caller's snapshots on every
    edge, oldest first."""
    c, p = ctx(request), principal(request)
    p.require("viewer")
    q = request.query
    project = q.get("project", "")
    if project:
        projects.validate(project)
    req = pb.ListSnapshotsRequest(
        project=project, sandbox_id=q.get("sandbox_id", ""), name=q.get("name", "")
    )
    edges = [e for e in await c.upstream.edges() if e.healthy]
    replies = await asyncio.gather(
        *(
            rpc(
                f"edge {e.edge_id}",
                c.upstream.edge_stub(e).ListSnapshots(req, metadata=p.metadata(), timeout=10),
            )
            for e in edges
        )
    )
    items = sorted((i for r in replies for i in r.snapshots), key=lambda i: i.created_at)
    return ok({"snapshots": [snapshot_json(i) for i in items]})


async def get_snapshot(request: web.Request) -> web.Response:
    """One snapshot."""
    c, p, snap_id = ctx(request), principal(request), _snapshot_id(request)
    p.require("viewer")
    stub = c.upstream.edge_stub(await _edge(request, snap_id))
    req = pb.SnapshotRef(snapshot_id=snap_id)
    info = await rpc("edge", stub.GetSnapshot(req, metadata=p.metadata(), timeout=10))
    return ok(snapshot_json(info))


async def delete_snapshot(request: web.Request) -> web.Response:
    """Remove a snapshot (sandboxes made from it keep running)."""
    c, p, snap_id = ctx(request), principal(request), _snapshot_id(request)
    p.require("member")
    request[audit.TARGET] = snap_id
    stub = c.upstream.edge_stub(await _edge(request, snap_id))
    req = pb.SnapshotRef(snapshot_id=snap_id)
    info = await rpc("edge", stub.DeleteSnapshot(req, metadata=p.metadata(), timeout=60))
    request["audit_project"] = info.project
    await snapshot_copy.drop_copies(request, snap_id)
    return ok(snapshot_json(info))


async def create_sandbox(request: web.Request, body: dict[str, Any]) -> pb.SandboxInfo:
    """A sandbox from snapshot ``body["snapshot"]`` on the snapshot's edge, admitted by iam
    first; the snapshot gives backend, image, CPU and memory, the body the lifetime and
    metadata (and the project, default: the snapshot's)."""
    c, p = ctx(request), principal(request)
    unknown = set(body) - FROM_SNAPSHOT_FIELDS
    if unknown:
        raise InvalidArgument(
            f"a sandbox from a snapshot takes only {', '.join(sorted(FROM_SNAPSHOT_FIELDS))}; "
            f"not {', '.join(sorted(unknown))} (the snapshot decides those)"
        )
    snap_id = body["snapshot"]
    if not isinstance(snap_id, str):
        raise InvalidArgument("'snapshot' must be a snapshot id")
    entry = await _edge(request, snap_id)
    stub = c.upstream.edge_stub(entry)
    snap = await rpc(
        "edge",
        stub.GetSnapshot(pb.SnapshotRef(snapshot_id=snap_id), metadata=p.metadata(), timeout=10),
    )
    project = body.get("project") or snap.project
    if not isinstance(project, str):
        raise InvalidArgument("'project' must be a project path")
    projects.validate(project)
    p.require_on(project, "member")
    request["audit_project"] = project
    d = spec_json(snap.spec)
    d["timeout_s"] = body.get("timeout_s", d["timeout_s"])
    d["metadata"] = body.get("metadata") or {}
    spec = SandboxSpec.from_dict(d)
    target = body.get("edge") or ""
    if not isinstance(target, str):
        raise InvalidArgument("'edge' must be an edge id")
    if target and target != entry.edge_id:
        _copyable(snap)
        there = await snapshot_copy.edge_entry(request, target)
        return await _elsewhere(request, snap, entry, there, project, spec)
    try:
        return await admit_and_create(request, project, spec, [entry], from_snapshot=snap_id)
    except NodeFull as exc:
        if snap.mode != "full":
            raise NodeFull(
                f"edge {entry.edge_id}, which holds snapshot {snap_id}, is full "
                f"({snap.mode} snapshots are not copied between edges): {exc.message}"
            ) from exc
        full = exc
    edges = [e for e in await c.upstream.edges() if e.edge_id != entry.edge_id]
    try:
        order = c.upstream.placement.order(edges, spec.backend, spec.memory_mb, limit=1)
    except Unavailable as exc:  # no other edge with room
        raise NodeFull(
            f"edge {entry.edge_id}, which holds snapshot {snap_id}, is full ({full.message}) "
            f"and no other edge can take it: {exc.message}"
        ) from exc
    return await _elsewhere(request, snap, entry, order[0], project, spec)


def _copyable(snap: pb.SnapshotInfo) -> None:
    if snap.mode != "full":
        raise InvalidArgument(
            f"snapshot {snap.id} is a {snap.mode} snapshot: only full ones start on another "
            "edge (a filesystem snapshot is an image: push it and pull it there)"
        )


async def _elsewhere(
    request: web.Request,
    snap: pb.SnapshotInfo,
    source: EdgeEntry,
    target: EdgeEntry,
    project: str,
    spec: SandboxSpec,
) -> pb.SandboxInfo:
    """Copy ``snap`` to ``target`` and create the sandbox there from the copy."""
    _copyable(snap)
    if spec.backend not in target.view.status.backends:
        raise InvalidArgument(f"edge {target.edge_id} does not run {spec.backend} sandboxes")

    async def create_there(copy_id: str) -> pb.SandboxInfo:
        return await admit_and_create(request, project, spec, [target], from_snapshot=copy_id)

    return await snapshot_copy.on_edge(request, snap.id, source, target, create_there)


ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/sandboxes/{sandbox_id}/snapshots", create_snapshot),
    ("GET", "/v1/snapshots", list_snapshots),
    ("GET", "/v1/snapshots/{snapshot_id}", get_snapshot),
    ("DELETE", "/v1/snapshots/{snapshot_id}", delete_snapshot),
]
