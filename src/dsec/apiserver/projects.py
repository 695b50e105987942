"""Project tree and quotas: create or change a project, list, delete, and usage."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from dsec.apiserver.context import ctx, json_body, ok, principal, query
from dsec.apiserver.roles import admin_scope_of, require_admin_on
from dsec.core import projects
from dsec.core.errors import InvalidArgument, PermissionDenied
from dsec.rpc._gen import dsec_pb2 as pb


def _project_json(p: pb.Project) -> dict[str, Any]:
    return {"name": p.name, "parent": projects.parent(p.name),
            "max_sandboxes": p.max_sandboxes, "max_cpu": p.max_cpu,
            "max_memory_mb": p.max_memory_mb}  # fmt: skip


async def put_project(request: web.Request) -> web.Response:
    """Create a project (its parent must exist) or replace its quota (admin of the parent)."""
    c, p = ctx(request), principal(request)
    body = await json_body(request)
    name = body.get("name")
    if not isinstance(name, str):
        raise InvalidArgument("'name' must be a project path such as org/team")
    require_admin_on(p, admin_scope_of(projects.validate(name)))
    limits = {k: body.get(k, 0) for k in ("max_sandboxes", "max_cpu", "max_memory_mb")}
    for k, v in limits.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise InvalidArgument(f"{k!r} must be a number >= 0 (0: no limit)")
    md = (*p.metadata(), ("x-request-id", str(request.get("request_id", ""))))
    saved = await c.upstream.iam.PutProject(
        pb.Project(name=projects.validate(name), max_sandboxes=int(limits["max_sandboxes"]),
                   max_cpu=float(limits["max_cpu"]),
                   max_memory_mb=int(limits["max_memory_mb"])),
        metadata=md, timeout=10,
    )  # fmt: skip
    return ok(_project_json(saved), status=201)


async def list_projects(request: web.Request) -> web.Response:
    """Every project the caller acts on (its own subtree; all of them for admins)."""
    c, p = ctx(request), principal(request)
    reply = await c.upstream.iam.ListProjects(pb.Empty(), timeout=10)
    mine = [x for x in reply.projects if p.sees(x.name)]
    return ok({"projects": [_project_json(x) for x in mine]})


async def delete_project(request: web.Request) -> web.Response:
    """Delete an empty leaf project; its keys are revoked (admin of the parent)."""
    c, p = ctx(request), principal(request)
    ref = pb.ProjectRef(project=projects.validate(request.match_info["name"]))
    require_admin_on(p, admin_scope_of(ref.project))
    md = (*p.metadata(), ("x-request-id", str(request.get("request_id", ""))))
    await c.upstream.iam.DeleteProject(ref, metadata=md, timeout=10)
    return ok({})


async def usage(request: web.Request) -> web.Response:
    """What a project and everything beneath it use, against its quota."""
    c, p = ctx(request), principal(request)
    name = projects.validate(query(request, "project", required=False, default=p.project))
    if not p.sees(name):
        raise PermissionDenied(f"project {name!r} is outside the projects you can see")
    p.require_on(name, "viewer")
    u = await c.upstream.iam.GetUsage(pb.ProjectRef(project=name), timeout=10)
    return ok({"project": u.project, "sandboxes": u.sandboxes, "cpu": u.cpu,
               "memory_mb": u.memory_mb, "max_sandboxes": u.max_sandboxes,
               "max_cpu": u.max_cpu, "max_memory_mb": u.max_memory_mb})  # fmt: skip


ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/projects", put_project),
    ("GET", "/v1/projects", list_projects),
    ("DELETE", "/v1/projects/{name:.+}", delete_project),
    ("GET", "/v1/usage", usage),
]
