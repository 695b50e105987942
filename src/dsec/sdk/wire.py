"""Sans-I/O core of the SDK: each API call is a :class:`Call` (request + parser), no sockets.

The sync and async shells (``sandbox.py``, ``async_sandbox.py``) only send what the
builders here and in ``runtime_calls.py`` produce and hand the answer to :func:`finish`, so
the two surfaces cannot drift apart. This module holds the plumbing (requests, error
mapping) and the control-plane calls (sandboxes, keys, identity).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dsec import __version__
from dsec.core.errors import (
    ClientError,
    DeadlineExceeded,
    DsecError,
    Internal,
    InvalidArgument,
    InvalidState,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    Unavailable,
    error_from_wire,
)
from dsec.core.spec import create_deadline_s
from dsec.sdk.models import (
    JSON,
    AccessToken,
    AuditEntry,
    BatchResult,
    Identity,
    KeyInfo,
    NewKey,
    SandboxInfo,
    SnapshotInfo,
)

T = TypeVar("T")

USER_AGENT = f"dsec-sdk-python/{__version__}"
DEFAULT_TIMEOUT_S = 30.0  # read timeout of a plain call
CREATE_TIMEOUT_S = 300.0  # creating may pull and unpack an image
EXEC_MARGIN_S = 30.0  # extra read time on top of a command's own timeout
CONNECT_TIMEOUT_S = 5.0

_STATUS_ERRORS: dict[int, type[DsecError]] = {
    400: InvalidArgument,
    401: Unauthenticated,
    403: PermissionDenied,
    404: NotFound,
    409: InvalidState,
    413: PayloadTooLarge,
    429: QuotaExceeded,
    502: Unavailable,
    503: Unavailable,
    504: DeadlineExceeded,
}


@dataclass(frozen=True, slots=True)
class Request:
    """An HTTP request relative to the API URL; ``timeout`` overrides the read timeout."""

    method: str
    path: str
    params: tuple[tuple[str, str], ...] = ()
    body: bytes | None = None
    headers: tuple[tuple[str, str], ...] = ()
    timeout: float | None = DEFAULT_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """A request and how to read its answer; ``on_error`` may refine a decoded error."""

    request: Request
    parse: Callable[[JSON], T]
    on_error: Callable[[DsecError, JSON], DsecError] | None = None


def auth_headers(api_key: str) -> dict[str, str]:
    """Headers every request carries (HTTP and the runtime WebSocket)."""
    return {"Authorization": f"Bearer {api_key}", "User-Agent": USER_AGENT}


def json_body(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def json_request(
    method: str,
    path: str,
    body: Mapping[str, Any] | None = None,
    *,
    params: tuple[tuple[str, str], ...] = (),
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> Request:
    """Build a request whose body (if any) is a compact JSON object."""
    if body is None:
        return Request(method, path, params, None, (), timeout)
    return Request(
        method, path, params, json_body(body), (("Content-Type", "application/json"),), timeout
    )


def compact(**fields: Any) -> JSON:
    """Keep only the fields that were given (not None)."""
    return {k: v for k, v in fields.items() if v is not None}


def decode_json(content: bytes) -> JSON:
    """Decode a JSON object body; an empty body is ``{}``."""
    if not content:
        return {}
    try:
        obj = json.loads(content)
    except ValueError:
        raise Internal(f"the server sent invalid JSON: {content[:200]!r}") from None
    if not isinstance(obj, dict):
        raise Internal(f"the server sent JSON that is not an object: {content[:200]!r}")
    return obj


def error_for_status(status: int, content: bytes) -> tuple[DsecError, JSON]:
    """Rebuild the error an error answer carries; returns it with the decoded body."""
    try:
        body = json.loads(content) if content else {}
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    err = body.get("error")
    if isinstance(err, dict) and isinstance(err.get("code"), str):
        return error_from_wire(err["code"], str(err.get("message", ""))), body
    text = content[:200].decode("utf-8", "replace").strip()
    cls = _STATUS_ERRORS.get(status)
    if cls is None:
        cls = ClientError if 400 <= status < 500 else Internal
    return cls(f"HTTP {status}" + (f": {text}" if text else "")), body


def finish(call: Call[T], status: int, content: bytes) -> T:
    """Turn an answer into the call's result, or raise the error it carries."""
    if 200 <= status < 300:
        return call.parse(decode_json(content))
    exc, body = error_for_status(status, content)
    if call.on_error is not None:
        exc = call.on_error(exc, body)
    raise exc


def connection_error(url: str, exc: BaseException) -> Unavailable:
    """The error for a request that never got an answer."""
    reason = str(exc) or type(exc).__name__
    return Unavailable(f"cannot reach the apiserver at {url}: {reason}")


def ignore_body(_: JSON) -> None:
    return None


def sandbox_path(sandbox_id: str) -> str:
    if not sandbox_id or "/" in sandbox_id or sandbox_id in (".", ".."):
        raise InvalidArgument(f"invalid sandbox id {sandbox_id!r}")
    return f"/v1/sandboxes/{sandbox_id}"


# -- sandboxes ------------------------------------------------------------------------------


def create_sandbox(
    *,
    backend: str | None,
    image: str | None,
    cpu: float | None,
    memory_mb: int | None,
    pids: int | None,
    timeout_s: int | None,
    env: Mapping[str, str] | None,
    metadata: Mapping[str, str] | None,
    project: str | None = None,
    network: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    on_timeout: str | None = None,
) -> Call[SandboxInfo]:
    """``POST /v1/sandboxes``: omitted (None) fields take the server's defaults; ``extra``
    adds fields (the trajectory binding)."""
    body = compact(
        backend=backend,
        image=image,
        cpu=cpu,
        memory_mb=memory_mb,
        pids=pids,
        timeout_s=timeout_s,
        env=dict(env) if env is not None else None,
        metadata=dict(metadata) if metadata is not None else None,
        project=project,
        network=_network_body(network) if network is not None else None,
        on_timeout=on_timeout,
    )
    body.update(extra or {})
    # the apiserver's own wait for the edge (core.spec.create_deadline_s) ends first
    wait = max(CREATE_TIMEOUT_S, create_deadline_s(backend) + 10)
    req = json_request("POST", "/v1/sandboxes", body, timeout=wait)
    return Call(req, SandboxInfo.from_wire)


def _network_body(network: Mapping[str, Any]) -> dict[str, list[str]]:
    if not isinstance(network, Mapping) or set(network) - {"allow", "deny"}:
        raise InvalidArgument('network must be {"allow": [...], "deny": [...]}')
    out: dict[str, list[str]] = {}
    for key in ("allow", "deny"):
        rules = network.get(key) or []
        if isinstance(rules, str) or not all(isinstance(r, str) for r in rules):
            raise InvalidArgument(f"network.{key} must be a list of rule strings")
        out[key] = list(rules)
    return out


def set_network(sandbox_id: str, network: Mapping[str, Any]) -> Call[SandboxInfo]:
    """``PUT /v1/sandboxes/{id}/network``: replace the policy of a running sandbox."""
    path = sandbox_path(sandbox_id) + "/network"
    return Call(json_request("PUT", path, _network_body(network)), SandboxInfo.from_wire)


def _sandbox_list(obj: JSON) -> list[SandboxInfo]:
    return [SandboxInfo.from_wire(s) for s in obj.get("sandboxes") or []]


def list_sandboxes(all: bool = False) -> Call[list[SandboxInfo]]:
    params = (("all", "1"),) if all else ()
    return Call(json_request("GET", "/v1/sandboxes", params=params), _sandbox_list)


def get_sandbox(sandbox_id: str) -> Call[SandboxInfo]:
    return Call(json_request("GET", sandbox_path(sandbox_id)), SandboxInfo.from_wire)


def kill_sandbox(sandbox_id: str) -> Call[SandboxInfo]:
    return Call(json_request("DELETE", sandbox_path(sandbox_id)), SandboxInfo.from_wire)


def pause_sandbox(sandbox_id: str) -> Call[SandboxInfo]:
    return Call(json_request("POST", sandbox_path(sandbox_id) + "/pause"), SandboxInfo.from_wire)


def resume_sandbox(sandbox_id: str, edge: str | None = None) -> Call[SandboxInfo]:
    """``POST /v1/sandboxes/{id}/resume``; ``edge``: resume it on that edge (a microVM moves
    there under a new id, the answer's)."""
    path = sandbox_path(sandbox_id) + "/resume"
    if edge is None:
        return Call(json_request("POST", path), SandboxInfo.from_wire)
    return Call(json_request("POST", path, {"edge": edge}, timeout=CREATE_TIMEOUT_S),
                SandboxInfo.from_wire)  # fmt: skip


BATCH_ACTIONS = ("pause", "resume", "kill")
BATCH_TIMEOUT_S = 600.0  # a thousand sandboxes, 32 at a time


def _batch_results(obj: JSON) -> list[BatchResult]:
    return [BatchResult.from_wire(r) for r in obj.get("results") or []]


def batch_sandboxes(
    action: str, ids: Sequence[str] | None = None, project: str | None = None
) -> Call[list[BatchResult]]:
    """``POST /v1/sandboxes:batch``: one action on many sandboxes, one result each."""
    if action not in BATCH_ACTIONS:
        raise InvalidArgument(f"action must be one of {', '.join(BATCH_ACTIONS)}, not {action!r}")
    if (ids is None) == (project is None):
        raise InvalidArgument("give exactly one of ids or project")
    if isinstance(ids, str):
        raise InvalidArgument("ids must be a list of sandbox ids, not one string")
    body = compact(action=action, ids=None if ids is None else list(ids), project=project)
    request = json_request("POST", "/v1/sandboxes:batch", body, timeout=BATCH_TIMEOUT_S)
    return Call(request, _batch_results)


def fork_sandbox(
    sandbox_id: str, count: int, timeout_s: int | None = None, edge: str | None = None
) -> Call[list[SandboxInfo]]:
    """``POST /v1/sandboxes/{id}/fork``: ``timeout_s`` is the children's lifetime (default:
    the parent's); ``edge``: start them on that edge (through a copied full snapshot)."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 64:
        raise InvalidArgument(f"count must be an integer between 1 and 64, got {count!r}")
    path = sandbox_path(sandbox_id) + "/fork"
    body = compact(count=count, timeout_s=timeout_s, edge=edge)
    return Call(json_request("POST", path, body, timeout=CREATE_TIMEOUT_S), _sandbox_list)


SNAPSHOT_MODES = ("full", "filesystem")


def snapshot_path(snapshot_id: str) -> str:
    if not snapshot_id or "/" in snapshot_id or snapshot_id in (".", ".."):
        raise InvalidArgument(f"invalid snapshot id {snapshot_id!r}")
    return f"/v1/snapshots/{snapshot_id}"


def create_snapshot(sandbox_id: str, name: str = "", mode: str | None = None) -> Call[SnapshotInfo]:
    """``POST /v1/sandboxes/{id}/snapshots``: a named snapshot; the sandbox keeps running."""
    if mode is not None and mode not in SNAPSHOT_MODES:
        raise InvalidArgument(f"mode must be one of {', '.join(SNAPSHOT_MODES)}, not {mode!r}")
    path = sandbox_path(sandbox_id) + "/snapshots"
    body = compact(name=name or None, mode=mode)
    return Call(json_request("POST", path, body, timeout=CREATE_TIMEOUT_S), SnapshotInfo.from_wire)


def _snapshot_list(obj: JSON) -> list[SnapshotInfo]:
    return [SnapshotInfo.from_wire(s) for s in obj.get("snapshots") or []]


def list_snapshots(
    project: str = "", sandbox_id: str = "", name: str = ""
) -> Call[list[SnapshotInfo]]:
    params = tuple((k, v) for k, v in (("project", project), ("sandbox_id", sandbox_id),
                                      ("name", name)) if v)  # fmt: skip
    return Call(json_request("GET", "/v1/snapshots", params=params), _snapshot_list)


def get_snapshot(snapshot_id: str) -> Call[SnapshotInfo]:
    return Call(json_request("GET", snapshot_path(snapshot_id)), SnapshotInfo.from_wire)


def delete_snapshot(snapshot_id: str) -> Call[SnapshotInfo]:
    return Call(json_request("DELETE", snapshot_path(snapshot_id)), SnapshotInfo.from_wire)


def create_from_snapshot(
    snapshot_id: str,
    timeout_s: int | None = None,
    metadata: Mapping[str, str] | None = None,
    project: str | None = None,
    edge: str | None = None,
) -> Call[SandboxInfo]:
    """``POST /v1/sandboxes`` with ``snapshot``: a new sandbox from a named snapshot
    (``edge``: on that edge; a full snapshot is copied there first)."""
    snapshot_path(snapshot_id)
    body = compact(
        snapshot=snapshot_id,
        timeout_s=timeout_s,
        metadata=dict(metadata) if metadata is not None else None,
        project=project,
        edge=edge,
    )
    req = json_request("POST", "/v1/sandboxes", body, timeout=CREATE_TIMEOUT_S)
    return Call(req, SandboxInfo.from_wire)


def set_timeout(sandbox_id: str, seconds: int) -> Call[SandboxInfo]:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
        raise InvalidArgument(f"timeout must be a positive number of seconds, got {seconds!r}")
    path = sandbox_path(sandbox_id) + "/timeout"
    return Call(json_request("POST", path, {"timeout_s": int(seconds)}), SandboxInfo.from_wire)


# -- identity and keys ----------------------------------------------------------------------


def whoami() -> Call[Identity]:
    return Call(json_request("GET", "/v1/whoami"), Identity.from_wire)


def _new_key(obj: JSON) -> NewKey:
    return NewKey(api_key=str(obj.get("api_key", "")), key_id=str(obj.get("key_id", "")))


def create_key(*, subject: str, project: str, role: str, name: str) -> Call[NewKey]:
    body = {"subject": subject, "project": project, "role": role, "name": name}
    return Call(json_request("POST", "/v1/keys", body), _new_key)


def _key_list(obj: JSON) -> list[KeyInfo]:
    return [KeyInfo.from_wire(k) for k in obj.get("keys") or []]


def list_keys() -> Call[list[KeyInfo]]:
    return Call(json_request("GET", "/v1/keys"), _key_list)


def query_audit(
    *,
    since: str = "",
    until: str = "",
    project: str = "",
    actor: str = "",
    action: str = "",
    limit: int = 1000,
) -> Call[list[AuditEntry]]:
    """``since``/``until``: epoch seconds, ISO-8601, or an age such as ``10m``."""
    params = tuple((k, str(v)) for k, v in (
        ("since", since), ("until", until), ("project", project), ("actor", actor),
        ("action", action), ("limit", limit)) if v)  # fmt: skip
    return Call(
        json_request("GET", "/v1/audit", params=params),
        lambda body: [AuditEntry.from_wire(e) for e in body["entries"]],
    )


def put_project(name: str, max_sandboxes: int, max_cpu: float,
                max_memory_mb: int) -> Call[dict[str, Any]]:  # fmt: skip
    body = {"name": name, "max_sandboxes": max_sandboxes, "max_cpu": max_cpu,
            "max_memory_mb": max_memory_mb}  # fmt: skip
    return Call(json_request("POST", "/v1/projects", body), dict)


def list_projects() -> Call[list[dict[str, Any]]]:
    return Call(json_request("GET", "/v1/projects"), lambda b: list(b["projects"]))


def delete_project(name: str) -> Call[None]:
    if not name or name.startswith("/") or ".." in name:
        raise InvalidArgument(f"invalid project {name!r}")
    return Call(json_request("DELETE", f"/v1/projects/{name}"), ignore_body)


def usage(project: str = "") -> Call[dict[str, Any]]:
    params = (("project", project),) if project else ()
    return Call(json_request("GET", "/v1/usage", params=params), dict)


def grant_role(project: str, subject: str, role: str) -> Call[None]:
    body = {"project": project, "subject": subject, "role": role}
    return Call(json_request("POST", "/v1/grants", body), ignore_body)


def list_grants(project: str = "", subject: str = "") -> Call[list[dict[str, Any]]]:
    params = tuple((k, v) for k, v in (("project", project), ("subject", subject)) if v)
    return Call(json_request("GET", "/v1/grants", params=params), lambda b: list(b["grants"]))


def create_join_token(ttl_s: int) -> Call[dict[str, Any]]:
    return Call(json_request("POST", "/v1/cluster/tokens", {"ttl_s": ttl_s}), dict)


def create_token(ttl_s: int) -> Call[AccessToken]:
    return Call(json_request("POST", "/v1/tokens", {"ttl_s": ttl_s}), AccessToken.from_wire)


def revoke(kind: str, value: str) -> Call[None]:
    if kind not in ("token", "key", "subject"):
        raise InvalidArgument(f"kind must be token, key or subject, got {kind!r}")
    return Call(json_request("POST", "/v1/revocations", {"kind": kind, "value": value}),
                ignore_body)  # fmt: skip


def verify_audit() -> Call[dict[str, Any]]:
    return Call(json_request("GET", "/v1/audit/verify"), dict)


def revoke_key(key_id: str) -> Call[None]:
    if not key_id or "/" in key_id:
        raise InvalidArgument(f"invalid key id {key_id!r}")
    return Call(json_request("DELETE", f"/v1/keys/{key_id}"), ignore_body)


def _edges(obj: JSON) -> list[JSON]:
    return [dict(e) for e in obj.get("edges") or [] if isinstance(e, dict)]


def _backend_edges(obj: JSON) -> list[JSON]:
    items = obj.get("edges")
    return list(items) if isinstance(items, list) else []


def list_backends() -> Call[list[JSON]]:
    return Call(json_request("GET", "/v1/backends"), _backend_edges)


def list_edges() -> Call[list[JSON]]:
    return Call(json_request("GET", "/v1/edges"), _edges)
