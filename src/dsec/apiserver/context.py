"""Shared per-app objects and small request helpers for the handlers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from dsec.apiserver.auth import Authenticator, Principal
from dsec.apiserver.trajectory_bindings import Bindings
from dsec.apiserver.upstream import Upstream
from dsec.core.errors import InvalidArgument, PayloadTooLarge
from dsec.obs import Metrics
from dsec.trajectory.log import TrajectoryLog


@dataclass(frozen=True, slots=True)
class Ctx:
    upstream: Upstream
    auth: Authenticator
    metrics: Metrics
    components: dict[str, str]  # component name -> address, for /v1/status
    trajectories: TrajectoryLog | None = None  # the trajectory log (None: not recording)
    bindings: Bindings = field(default_factory=Bindings)  # sandbox -> trajectory, cached


CTX: web.AppKey[Ctx] = web.AppKey("ctx", Ctx)


def ctx(request: web.Request) -> Ctx:
    return request.app[CTX]


def principal(request: web.Request) -> Principal:
    p = request.get("principal")
    assert isinstance(p, Principal)
    return p


async def json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLarge(
            f"request body over {request.app._client_max_size} bytes; "
            "upload files with PUT /files, which streams"
        ) from exc
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    return body


def query(request: web.Request, name: str, *, required: bool = True, default: str = "") -> str:
    value = request.query.get(name)
    if value is None:
        if required:
            raise InvalidArgument(f"missing query parameter {name!r}")
        return default
    return value


def flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "").lower() in ("1", "true", "yes")


def sandbox_id(request: web.Request) -> str:
    return request.match_info["sandbox_id"]


def ok(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
