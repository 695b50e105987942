"""Sans-I/O builders for the trajectory log: binding, status, checkpoints, listing, export.

A sandbox bound to a trajectory has every runtime call recorded by the apiserver; opening
the same trajectory again replays the recorded results (see ``docs/trajectories.md``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypeVar

from dsec.core.errors import InvalidArgument
from dsec.sdk.models import JSON
from dsec.sdk.wire import Call, compact, json_request, sandbox_path

T = TypeVar("T")
POLICIES = ("diverge", "fail")


def check_policy(on_mismatch: str, checkpoint_every: int) -> None:
    if on_mismatch not in POLICIES:
        raise InvalidArgument(f"on_mismatch must be 'diverge' or 'fail', got {on_mismatch!r}")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
        raise InvalidArgument("checkpoint_every must be an integer (0: never)")
    if checkpoint_every < 0:
        raise InvalidArgument("checkpoint_every must be >= 0 (0: never)")


def policy_body(trajectory: str | None, on_mismatch: str, checkpoint_every: int) -> JSON:
    """The create-body fields that bind a new sandbox to ``trajectory``."""
    if trajectory is None:
        return {}
    if not isinstance(trajectory, str) or not trajectory:
        raise InvalidArgument("trajectory must be a non-empty string such as 'run42/ep7'")
    check_policy(on_mismatch, checkpoint_every)
    return compact(
        trajectory=trajectory,
        on_mismatch=on_mismatch,
        checkpoint_every=checkpoint_every or None,
    )


def idempotent(call: Call[T], flag: bool) -> Call[T]:
    """Mark a runtime call as safe to run again when a trajectory is restored."""
    if not flag:
        return call
    headers = (*call.request.headers, ("X-Dsec-Idempotent", "1"))
    return replace(call, request=replace(call.request, headers=headers))


def _obj(o: JSON) -> dict[str, Any]:
    return dict(o)


def bind(sandbox_id: str, trajectory: str, on_mismatch: str, checkpoint_every: int) -> Call[JSON]:
    body = policy_body(trajectory, on_mismatch, checkpoint_every)
    return Call(json_request("POST", f"{sandbox_path(sandbox_id)}/trajectory", body), _obj)


def status(sandbox_id: str) -> Call[JSON]:
    return Call(json_request("GET", f"{sandbox_path(sandbox_id)}/trajectory"), _obj)


def checkpoint(sandbox_id: str) -> Call[JSON]:
    req = json_request("POST", f"{sandbox_path(sandbox_id)}/checkpoint", {}, timeout=900)
    return Call(req, _obj)


def list_trajectories(project: str | None, name: str | None) -> Call[list[JSON]]:
    params = tuple((k, v) for k, v in (("project", project), ("name", name)) if v)
    req = json_request("GET", "/v1/trajectories", params=params)
    return Call(req, lambda o: list(o.get("trajectories", [])))


def _tid(trajectory_id: str) -> str:
    if not trajectory_id or not trajectory_id.isalnum():
        raise InvalidArgument(f"invalid trajectory id {trajectory_id!r}")
    return trajectory_id


def get(trajectory_id: str) -> Call[JSON]:
    return Call(json_request("GET", f"/v1/trajectories/{_tid(trajectory_id)}"), _obj)


def export(trajectory_id: str) -> Call[list[JSON]]:
    req = json_request(
        "GET", f"/v1/trajectories/{_tid(trajectory_id)}/steps", params=(("format", "json"),)
    )
    return Call(req, lambda o: list(o.get("steps", [])))


def remove(trajectory_id: str) -> Call[JSON]:
    return Call(json_request("DELETE", f"/v1/trajectories/{_tid(trajectory_id)}"), _obj)


def quota(project: str | None) -> Call[JSON]:
    params = (("project", project),) if project else ()
    return Call(json_request("GET", "/v1/trajectory-quota", params=params), _obj)


def set_quota(project: str, limit_bytes: int) -> Call[JSON]:
    body = {"project": project, "limit_bytes": limit_bytes}
    return Call(json_request("PUT", "/v1/trajectory-quota", body), _obj)
