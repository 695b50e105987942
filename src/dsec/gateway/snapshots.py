"""E2B snapshots and fork on OpenDsec's named snapshots and fork.

``create_snapshot`` (``POST /sandboxes/{id}/snapshots``, ``{"name"?, "memory"?}``) takes a
named snapshot: ``memory`` true (or unset, on microvm) is a full snapshot, false (or unset,
on container) a filesystem one. ``Sandbox.create(<snapshotID>)`` starts a sandbox from it
(see ``control.create``), ``list_snapshots`` is ``GET /snapshots`` and ``delete_snapshot``
is ``DELETE /templates/{id}``. ``fork`` (``POST /sandboxes/{id}/fork``) answers one
``{"sandbox": ...}`` per child.
"""

from __future__ import annotations

import base64
from typing import Any

from aiohttp import web

from dsec.core.errors import InvalidArgument, NotFound, SnapshotNotFound
from dsec.core.ids import is_snapshot_id
from dsec.gateway import control
from dsec.sdk import runtime_calls as rc
from dsec.sdk import wire
from dsec.sdk.async_sandbox import AsyncClient
from dsec.sdk.models import SandboxInfo, SnapshotInfo

MAX_FORK = 20  # the SDK's bound


def snapshot_json(info: SnapshotInfo) -> dict[str, Any]:
    return {"snapshotID": info.id, "names": [info.name] if info.name else []}


async def create(request: web.Request) -> web.Response:
    client, _ = control._client(request)
    sid = request.match_info["sandbox_id"]
    body = await control._json(request)
    name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidArgument("'name' must be a string")
    memory = body.get("memory")
    if memory is not None and not isinstance(memory, bool):
        raise InvalidArgument("'memory' must be a boolean")
    await control._live(client, sid)
    mode = None if memory is None else ("full" if memory else "filesystem")
    info = await client.transport.call(wire.create_snapshot(sid, name or "", mode))
    return web.json_response(snapshot_json(info), status=201)


async def list_snapshots(request: web.Request) -> web.Response:
    client, _ = control._client(request)
    q = request.query
    items = await client.list_snapshots(sandbox_id=q.get("sandboxID", ""))
    wanted = q.get("name", "")
    if wanted:
        items = [i for i in items if wanted in (i.id, i.name)]
    limit_raw = q.get("limit", "")
    if limit_raw and not limit_raw.isdigit():
        raise InvalidArgument("'limit' must be a positive integer")
    limit = min(int(limit_raw or control.MAX_PAGE), control.MAX_PAGE) or control.MAX_PAGE
    start = control._page_token(q.get("nextToken", ""))
    page = items[start : start + limit]
    headers = {}
    if start + limit < len(items):
        headers["X-Next-Token"] = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
    return web.json_response([snapshot_json(i) for i in page], headers=headers)


async def delete(request: web.Request) -> web.Response:
    """``DELETE /templates/{id}``: only snapshots are templates one can delete here."""
    client, _ = control._client(request)
    template = request.match_info["template_id"]
    snap = await find(client, template)
    if snap is None:
        raise SnapshotNotFound(f"no snapshot {template!r}")
    await client.delete_snapshot(snap.id)
    return web.Response(status=204)


async def find(client: AsyncClient, template: str) -> SnapshotInfo | None:
    """The caller's snapshot with id or name ``template``, or None."""
    if is_snapshot_id(template):
        try:
            return await client.get_snapshot(template)
        except NotFound:
            return None
    named = await client.list_snapshots(name=template)
    return named[-1] if named else None  # the newest of that name


async def create_sandbox(
    request: web.Request, client: AsyncClient, snap: SnapshotInfo, body: dict[str, Any]
) -> SandboxInfo:
    """A sandbox from snapshot ``snap`` (``Sandbox.create(<snapshotID or name>)``)."""
    timeout = control._timeout(body, control.DEFAULT_TIMEOUT_S)
    metadata = control._str_map(body, "metadata")
    info = await client.transport.call(wire.create_from_snapshot(snap.id, timeout, metadata))
    _warm(request, client, info)
    return info


def _warm(request: web.Request, client: AsyncClient, info: SandboxInfo) -> None:
    """Start the sandbox's process keeper now, so the first command does not wait for it."""
    if info.spec is None or info.spec.backend != "function":
        control.gw(request).background(client.transport.call(rc.list_processes(info.id)))


async def fork(request: web.Request) -> web.Response:
    g = control.gw(request)
    client, key = control._client(request)
    sid = request.match_info["sandbox_id"]
    body = await control._json(request)
    count = body.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK:
        raise InvalidArgument(f"'count' must be an integer between 1 and {MAX_FORK}")
    timeout = control._timeout(body, None)
    await control._live(client, sid)
    children = await client.transport.call(wire.fork_sandbox(sid, count, timeout))
    out = []
    for child in children:
        _warm(request, client, child)
        out.append({"sandbox": control.sandbox_json(g, child, key)})
    return web.json_response(out, status=201)


ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/sandboxes/{sandbox_id}/snapshots", create),
    ("POST", "/sandboxes/{sandbox_id}/fork", fork),
    ("GET", "/snapshots", list_snapshots),
    ("DELETE", "/templates/{template_id}", delete),
]
