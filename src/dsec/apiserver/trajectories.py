"""Trajectory routes: create-with-trajectory (re-attach, restore), bind, checkpoint, status,
list/show/export/remove, and the per-project quota on log bytes.

``POST /v1/sandboxes`` with ``"trajectory": T`` opens T (``dsec.trajectory.log``):

- a new T: the sandbox is created and bound; its calls are recorded;
- a T with steps: replay starts at step 0. Its sandbox is the recorded one if that still
  runs (re-attached, nothing created); else a new one from the latest checkpoint image (or
  the original image: "step 0") on which every step after the checkpoint is run again for
  real, which is allowed only when each of them was marked idempotent; otherwise the create
  fails with 409 ``trajectory_not_restorable`` naming the first step that is not.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from dsec.apiserver import audit, sandboxes
from dsec.apiserver import trajectory_sandbox as traj_io
from dsec.apiserver.auth import Principal
from dsec.apiserver.context import ctx, json_body, ok, principal, sandbox_id
from dsec.apiserver.upstream import rpc
from dsec.core import projects
from dsec.core.errors import (
    DsecError,
    InvalidArgument,
    NotFound,
    NotRestorable,
    PermissionDenied,
    Unavailable,
)
from dsec.core.spec import SandboxSpec
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.trajectory.log import Step, Trajectory, TrajectoryLog

POLICY_FIELDS = ("trajectory", "on_mismatch", "checkpoint_every")


def _log(request: web.Request) -> TrajectoryLog:
    tlog = ctx(request).trajectories
    if tlog is None:
        raise Unavailable("this apiserver has no trajectory store configured")
    return tlog


def summary(t: Trajectory) -> dict[str, Any]:
    d = t.to_json()
    d.pop("spec")
    return d


def _policy(body: dict[str, Any]) -> tuple[str, str, int]:
    name = body.pop("trajectory")
    if not isinstance(name, str):
        raise InvalidArgument("'trajectory' must be a string such as 'run42/ep7'")
    on_mismatch = body.pop("on_mismatch", None) or "diverge"
    every = body.pop("checkpoint_every", None) or 0
    return name, on_mismatch, every


async def _alive(request: web.Request, sid: str) -> pb.SandboxInfo | None:
    c, p = ctx(request), principal(request)
    try:
        stub = await c.upstream.edge_for(sid)
        info = await rpc(
            "edge",
            stub.GetSandbox(pb.SandboxRef(sandbox_id=sid), metadata=p.metadata(), timeout=10),
        )
    except (NotFound, Unavailable):
        return None
    assert isinstance(info, pb.SandboxInfo)
    return info if info.state in ("running", "paused") else None


def _describe(step: Step) -> str:
    req = step.raw_request
    what = req.get("cmd") or req.get("path") or req.get("pid") or ""
    return f"step {step.n} ({step.op} {what!r})" if what else f"step {step.n} ({step.op})"


async def _restore(
    request: web.Request, tlog: TrajectoryLog, t: Trajectory, project: str
) -> pb.SandboxInfo:
    c, p = ctx(request), principal(request)
    ckpt = max(t.checkpoints, key=lambda k: int(k["step"]), default=None)
    base = int(ckpt["step"]) if ckpt else 0
    image = str(ckpt["image"]) if ckpt else str(t.spec.get("image", "base"))
    after = [s async for s in tlog.steps(t.id, base)]
    for s in after:
        if not s.idempotent and s.op not in traj_io.READ_ONLY_OPS and s.status == 200:
            where = f"the checkpoint at step {base}" if ckpt else "the start (no checkpoint)"
            raise NotRestorable(
                f"trajectory {t.name!r}: its sandbox {t.sandbox_id or '(none)'} is gone, and "
                f"{_describe(s)} after {where} is not marked idempotent, so it cannot be "
                "run again; take checkpoints (checkpoint_every=N or sbx.checkpoint()) or mark "
                "such calls idempotent=True, or remove the trajectory to start over"
            )
    spec = SandboxSpec.from_dict({**t.spec, "image": image})
    info = await sandboxes.create_sandbox(request, project, spec)
    try:
        for s in after:
            await traj_io.rerun(c, p, info.id, s)
    except BaseException:
        stub = await c.upstream.edge_for(info.id)
        try:
            await stub.KillSandbox(
                pb.SandboxRef(sandbox_id=info.id), metadata=p.metadata(), timeout=60
            )
        except Exception:
            pass
        raise
    c.metrics.inc("trajectory_restores")
    return info


async def create(request: web.Request, project: str, body: dict[str, Any]) -> web.Response:
    """``POST /v1/sandboxes`` with a trajectory: see the module docstring."""
    tlog = _log(request)
    name, on_mismatch, every = _policy(body)
    spec = SandboxSpec.from_dict(body)
    t, new = await tlog.open(
        project, name, spec=spec.to_dict(), on_mismatch=on_mismatch, checkpoint_every=every
    )
    how = "created"
    info = await _alive(request, t.sandbox_id) if t.sandbox_id and not new else None
    if info is not None:
        how = "reattached"
    elif t.steps and not new:
        info = await _restore(request, tlog, t, project)
        how = "restored"
    else:
        info = await sandboxes.create_sandbox(request, project, spec)
    t = await _bind(request, tlog, t, info.id)
    out = sandboxes.info_json(info)
    out["trajectory"] = {**summary(t), "opened": how}
    return ok(out, status=201 if how != "reattached" else 200)


async def _mark(request: web.Request, sid: str, tid: str, epoch: str = "") -> None:
    """Tell the sandbox's edge it is bound to ``tid`` ("": no longer) at ``epoch``: see
    ``trajectory_bindings.py``."""
    c, p = ctx(request), principal(request)
    stub = await c.upstream.edge_for(sid)
    await rpc(
        "edge",
        stub.MarkTrajectory(
            pb.MarkTrajectoryRequest(sandbox_id=sid, trajectory_id=tid, epoch=epoch),
            metadata=p.metadata(),
            timeout=10,
        ),
    )


async def _unmark(request: web.Request, sid: str) -> None:
    """Best effort: a sandbox left marked only costs its calls a second look-up."""
    ctx(request).bindings.forget(sid)
    try:
        await _mark(request, sid, "")
    except DsecError:
        pass


async def _bind(request: web.Request, tlog: TrajectoryLog, t: Trajectory, sid: str) -> Trajectory:
    """Bind ``sid`` to ``t`` in the log, then mark it bound at its edge before answering."""
    previous = t.sandbox_id
    t = await tlog.bind(t.id, sid)
    await _mark(request, sid, t.id, t.epoch)
    ctx(request).bindings.saw(sid, t.id)
    if previous and previous != sid:
        await _unmark(request, previous)
    return t


def _check_access(p: Principal, t: Trajectory) -> None:
    if not (p.admin or projects.contains(p.project, t.project)):
        raise PermissionDenied(f"trajectory {t.id} is outside your project {p.project!r}")


async def _get(request: web.Request, role: str) -> Trajectory:
    p = principal(request)
    p.require(role)
    t = await _log(request).get(request.match_info["tid"])
    _check_access(p, t)
    return t


async def bind(request: web.Request) -> web.Response:
    """``POST /v1/sandboxes/{id}/trajectory``: record this sandbox's calls into T."""
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    tlog = _log(request)
    body = await json_body(request)
    if "trajectory" not in body:
        raise InvalidArgument("'trajectory' is required")
    name, on_mismatch, every = _policy(body)
    stub = await c.upstream.edge_for(sid)
    info = await rpc(
        "edge", stub.GetSandbox(pb.SandboxRef(sandbox_id=sid), metadata=p.metadata(), timeout=10)
    )
    if not (p.admin or projects.contains(p.project, info.project)):
        raise PermissionDenied(f"sandbox {sid} is outside your project {p.project!r}")
    spec = sandboxes.info_json(info)["spec"]
    t, _ = await tlog.open(
        info.project, name, spec=spec, on_mismatch=on_mismatch, checkpoint_every=every
    )
    t = await _bind(request, tlog, t, sid)
    return ok(summary(t))


async def status(request: web.Request) -> web.Response:
    """``GET /v1/sandboxes/{id}/trajectory``: the bound trajectory, its mode and cursor."""
    p, sid = principal(request), sandbox_id(request)
    p.require("viewer")
    t = await _log(request).for_sandbox(sid)
    if t is None:
        raise NotFound(f"sandbox {sid} is not bound to a trajectory")
    _check_access(p, t)
    return ok(summary(t))


async def checkpoint(request: web.Request) -> web.Response:
    """``POST /v1/sandboxes/{id}/checkpoint``: pack the sandbox as the bound trajectory's
    latest checkpoint (its state after the log's last step)."""
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    t = await _log(request).for_sandbox(sid)
    if t is None:
        raise NotFound(f"sandbox {sid} is not bound to a trajectory")
    _check_access(p, t)
    return ok(await traj_io.checkpoint(c, p, t.id, sid), status=201)


async def list_(request: web.Request) -> web.Response:
    """Trajectories of a project (filter by ``name``)."""
    p = principal(request)
    p.require("viewer")
    project = request.query.get("project", "" if p.admin else p.project)
    if not (p.admin or projects.contains(p.project, project)):
        raise PermissionDenied(f"project {project!r} is outside your project {p.project!r}")
    items = await _log(request).list(project)
    name = request.query.get("name")
    if name:
        items = [t for t in items if t.name == name]
    return ok({"trajectories": [summary(t) for t in items]})


async def show(request: web.Request) -> web.Response:
    """One trajectory: steps, bytes, replay state, checkpoints, divergence."""
    return ok(summary(await _get(request, "viewer")))


async def export(request: web.Request) -> web.StreamResponse:
    """The steps as JSON Lines (one object per step, payload bytes as base64);
    ``?format=json``: one ``{"steps": [...]}`` object."""
    t = await _get(request, "viewer")
    if request.query.get("format") == "json":
        steps = [
            {"trajectory": t.name, "project": t.project, **s.export()}
            async for s in _log(request).steps(t.id)
        ]
        return ok({"steps": steps})
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    async for s in _log(request).steps(t.id):
        line = {"trajectory": t.name, "project": t.project, **s.export()}
        await resp.write(json.dumps(line, separators=(",", ":")).encode() + b"\n")
    await resp.write_eof()
    return resp


async def remove(request: web.Request) -> web.Response:
    """Remove a trajectory, its steps and its checkpoint images."""
    t = await _get(request, "member")
    request[audit.TARGET] = f"{t.project}:{t.name}"
    request["audit_project"] = t.project
    await _log(request).remove(t.id)
    if t.sandbox_id:
        await _unmark(request, t.sandbox_id)
    await traj_io.drop_images(ctx(request), principal(request), t.checkpoints)
    return ok(summary(t))


async def get_quota(request: web.Request) -> web.Response:
    """A project's quota on trajectory log bytes, and its usage."""
    p = principal(request)
    p.require("viewer")
    project = request.query.get("project") or p.project
    if not (p.admin or projects.contains(p.project, project)):
        raise PermissionDenied(f"project {project!r} is outside your project {p.project!r}")
    tlog = _log(request)
    return ok(
        {
            "project": project,
            "limit_bytes": await tlog.quota(project),
            "used_bytes": await tlog.usage(project),
        }
    )


async def put_quota(request: web.Request) -> web.Response:
    """Set a project's quota on trajectory log bytes (admin; 0: none)."""
    p = principal(request)
    p.require("admin")
    body = await json_body(request)
    project = body.get("project")
    if not isinstance(project, str):
        raise InvalidArgument("'project' is required")
    projects.validate(project)
    request[audit.TARGET] = project
    request["audit_project"] = project
    tlog = _log(request)
    await tlog.set_quota(project, body.get("limit_bytes"))  # type: ignore[arg-type]
    return ok(
        {
            "project": project,
            "limit_bytes": await tlog.quota(project),
            "used_bytes": await tlog.usage(project),
        }
    )


ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/sandboxes/{sandbox_id}/trajectory", bind),
    ("GET", "/v1/sandboxes/{sandbox_id}/trajectory", status),
    ("POST", "/v1/sandboxes/{sandbox_id}/checkpoint", checkpoint),
    ("GET", "/v1/trajectories", list_),
    ("GET", "/v1/trajectory-quota", get_quota),
    ("PUT", "/v1/trajectory-quota", put_quota),
    ("GET", "/v1/trajectories/{tid}", show),
    ("GET", "/v1/trajectories/{tid}/steps", export),
    ("DELETE", "/v1/trajectories/{tid}", remove),
]
