"""Project-scoped roles: grant and list them, and the checks routes share.

A project admin manages its own subtree: it grants roles there and makes keys there, but
only for subjects it fully governs (every role they hold lies in its subtree), so nobody
can mint a credential for someone with more reach than themselves. Platform-wide acts
(grants on ``*``, other subjects' tokens) need a platform admin.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from dsec.apiserver.auth import PLATFORM, Principal
from dsec.apiserver.context import Ctx, ctx, json_body, ok, principal
from dsec.apiserver.upstream import rpc
from dsec.core import projects
from dsec.core.errors import InvalidArgument, NotFound, PermissionDenied
from dsec.rpc._gen import dsec_pb2 as pb


def admin_scope_of(project: str) -> str:
    """Where admin is needed to change ``project`` itself: its parent (``*`` at the top)."""
    return projects.parent(project) or PLATFORM


def require_admin_on(p: Principal, project: str) -> None:
    if project == PLATFORM:
        if not p.admin:
            raise PermissionDenied("this needs a platform admin")
        p.require("admin")
        return
    p.require_on(project, "admin")


async def require_governs(c: Ctx, p: Principal, subject: str) -> None:
    """The caller must be admin over every project ``subject`` holds a role on."""
    if p.admin:
        p.require("admin")
        return
    reply = await rpc("iam", c.upstream.iam.ListGrants(pb.ListGrantsRequest(subject=subject),
                                                       timeout=10))  # fmt: skip
    keys = await rpc("iam", c.upstream.iam.ListKeys(pb.ListKeysRequest(), timeout=10))
    held = [g.project for g in reply.grants]
    held += [k.project for k in keys.keys if k.subject == subject and not k.revoked]
    for project in held:
        if project == PLATFORM or p.rank_on(project) < 2:
            raise PermissionDenied(
                f"subject {subject!r} holds roles outside the projects you administer"
            )


async def require_key_admin(c: Ctx, p: Principal, key_id: str) -> None:
    """The caller must be admin on the project of API key ``key_id``."""
    if p.admin:
        p.require("admin")
        return
    keys = await rpc("iam", c.upstream.iam.ListKeys(pb.ListKeysRequest(), timeout=10))
    found = [k for k in keys.keys if k.key_id == key_id]
    if not found or p.rank_on(found[0].project) < 2:
        raise NotFound(f"no API key {key_id!r} in the projects you administer")
    p.require_on(found[0].project, "admin")


def _md(request: web.Request) -> tuple[tuple[str, str], ...]:
    return (*principal(request).metadata(), ("x-request-id", str(request.get("request_id", ""))))


async def grant(request: web.Request) -> web.Response:
    """``POST /v1/grants`` ``{"project", "subject", "role"}`` (role "" takes it away)."""
    c, p = ctx(request), principal(request)
    body = await json_body(request)
    fields = {k: body.get(k, "") for k in ("project", "subject", "role")}
    if not all(isinstance(v, str) for v in fields.values()) or not fields["project"]:
        raise InvalidArgument("'project', 'subject' and 'role' must be strings")
    require_admin_on(p, fields["project"])
    await rpc("iam", c.upstream.iam.GrantRole(pb.RoleGrant(**fields), metadata=_md(request),
                                              timeout=10))  # fmt: skip
    c.auth.forget_grants(fields["subject"])
    return ok(fields, status=201)


async def list_grants(request: web.Request) -> web.Response:
    """``GET /v1/grants?project=&subject=``: the grants on projects the caller can see."""
    c, p = ctx(request), principal(request)
    p.require("viewer")
    q = request.query
    req = pb.ListGrantsRequest(subject=q.get("subject", ""), project=q.get("project", ""))
    reply = await rpc("iam", c.upstream.iam.ListGrants(req, timeout=10))
    seen = [g for g in reply.grants
            if p.admin or (g.project != PLATFORM and p.sees(g.project))]  # fmt: skip
    return ok({"grants": [{"project": g.project, "subject": g.subject, "role": g.role}
                          for g in seen]})  # fmt: skip


ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/grants", grant),
    ("GET", "/v1/grants", list_grants),
]
