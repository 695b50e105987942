"""``GET /v1/backends``: each edge's backends, what they can do, and whether they run there.

An edge that does not answer is listed with its error instead of failing the whole answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from dsec.apiserver.context import ctx, ok, principal
from dsec.apiserver.upstream import EdgeEntry, rpc
from dsec.core.errors import DsecError
from dsec.rpc._gen import dsec_pb2 as pb

_CAPS = (
    "pause",
    "fork",
    "snapshot",
    "pty",
    "persistent_processes",
    "persistent_filesystem",
    "network_policy",
    "max_vcpus",
    "max_memory_mb",
    "min_memory_mb",
    "min_vcpus",
    "create_seconds",
    "notes",
)


def backend_json(info: pb.BackendInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "available": info.available,
        "reason": info.reason,
        "capabilities": {k: getattr(info.capabilities, k) for k in _CAPS},
    }


async def list_backends(request: web.Request) -> web.Response:
    """Every edge's backends with capabilities and availability (any role)."""
    c, p = ctx(request), principal(request)
    p.require("viewer")
    edges = await c.upstream.edges()

    async def one(e: EdgeEntry) -> dict[str, Any]:
        entry: dict[str, Any] = {"edge_id": e.edge_id, "healthy": e.healthy, "backends": []}
        if not e.healthy:
            entry["error"] = "the edge is not reporting to the watcher"
            return entry
        try:
            reply = await rpc(
                f"edge {e.edge_id}",
                c.upstream.edge_stub(e).ListBackends(pb.Empty(), metadata=p.metadata(), timeout=10),
            )
        except DsecError as exc:
            entry["error"] = exc.message
            return entry
        entry["backends"] = [backend_json(b) for b in reply.backends]
        return entry

    return ok({"edges": list(await asyncio.gather(*(one(e) for e in edges)))})


ROUTES: list[tuple[str, str, Any]] = [("GET", "/v1/backends", list_backends)]
