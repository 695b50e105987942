"""Identity routes: who am I, and API key management (admin)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from dsec.apiserver.auth import PLATFORM
from dsec.apiserver.context import ctx, json_body, ok, principal
from dsec.apiserver.roles import require_admin_on, require_governs, require_key_admin
from dsec.apiserver.upstream import rpc
from dsec.core.errors import InvalidArgument
from dsec.rpc._gen import dsec_pb2 as pb


def _md(request: web.Request) -> tuple[tuple[str, str], ...]:
    """The caller and request id, so the iam's audit entry names who asked."""
    return (*principal(request).metadata(), ("x-request-id", str(request.get("request_id", ""))))


async def whoami(request: web.Request) -> web.Response:
    p = principal(request)
    return ok({"subject": p.subject, "project": p.project, "role": p.role, "key_id": p.key_id})


async def create_key(request: web.Request) -> web.Response:
    c, p = ctx(request), principal(request)
    body = await json_body(request)
    fields = {k: body.get(k, "") for k in ("subject", "project", "role", "name")}
    if not all(isinstance(v, str) for v in fields.values()):
        raise InvalidArgument("subject, project, role and name must be strings")
    require_admin_on(p, fields["project"] or PLATFORM)
    await require_governs(c, p, fields["subject"])
    call = c.upstream.iam.CreateKey(
        pb.CreateKeyRequest(**fields), metadata=_md(request), timeout=10
    )
    reply = await rpc("iam", call)
    return ok({"api_key": reply.api_key, "key_id": reply.key_id}, status=201)


async def list_keys(request: web.Request) -> web.Response:
    c, p = ctx(request), principal(request)
    project = request.query.get("project", "")
    if project or p.admin:
        require_admin_on(p, project or PLATFORM)
    else:
        p.require("admin")  # then only keys of the projects it administers are shown
    reply = await rpc(
        "iam", c.upstream.iam.ListKeys(pb.ListKeysRequest(project=project), timeout=10)
    )
    keys = [
        {
            "key_id": k.key_id,
            "subject": k.subject,
            "project": k.project,
            "role": k.role,
            "name": k.name,
            "created_at": k.created_at,
            "revoked": k.revoked,
        }
        for k in reply.keys
        if p.admin or p.rank_on(k.project) >= 2
    ]
    return ok({"keys": keys})


async def revoke_key(request: web.Request) -> web.Response:
    c, p = ctx(request), principal(request)
    await require_key_admin(c, p, request.match_info["key_id"])
    await rpc(
        "iam",
        c.upstream.iam.RevokeKey(
            pb.KeyRef(key_id=request.match_info["key_id"]), metadata=_md(request), timeout=10
        ),
    )
    c.auth.forget()
    return ok({})


ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/v1/whoami", whoami),
    ("POST", "/v1/keys", create_key),
    ("GET", "/v1/keys", list_keys),
    ("DELETE", "/v1/keys/{key_id}", revoke_key),
]
