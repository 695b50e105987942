"""The E2B control plane (``/sandboxes``, ``/v2/sandboxes``) on OpenDsec's sandbox API.

Exact success codes matter (the generated E2B client parses only the documented one) and
every error is ``{"code": <http status>, "message": ...}``. A template names an OpenDsec
image; the sandbox's ``envdAccessToken`` is the caller's API key (see ``upstream.py``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import urllib.parse
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from dsec.core.errors import (
    DsecError,
    ImageNotFound,
    InvalidArgument,
    InvalidState,
    NotFound,
    SandboxNotFound,
    SnapshotNotFound,
)
from dsec.core.ids import is_snapshot_id
from dsec.core.spec import BACKENDS
from dsec.gateway import egress, lifecycle, signing, usage
from dsec.gateway.upstream import ENVD_PORT, Clients, api_key
from dsec.sdk import runtime_calls as rc
from dsec.sdk import wire
from dsec.sdk.async_sandbox import AsyncClient
from dsec.sdk.models import SandboxInfo

ENVD_VERSION = "0.5.7"
DEFAULT_TEMPLATE = "base"
DEFAULT_TIMEOUT_S = 300
MAX_PAGE = 100
LIVE_STATES = ("creating", "running", "paused")


class Gateway:
    """What every handler needs: the per-key clients and the settings."""

    def __init__(
        self,
        clients: Clients,
        *,
        domain: str = "localhost",
        cpu: float = 1.0,
        memory_mb: int = 512,
        templates: dict[str, str] | None = None,
    ) -> None:
        self.clients = clients
        self.domain = domain
        self.cpu = cpu
        self.memory_mb = memory_mb
        self.templates = templates or {}
        self.tokens = signing.Tokens()  # sandbox tokens handed out, for signed file URLs
        self._tasks: set[asyncio.Task[Any]] = set()

    def background(self, coro: Any) -> None:
        """Run ``coro`` detached (errors ignored), keeping a reference until it ends."""

        async def quiet() -> None:
            try:
                await coro
            except Exception:
                pass

        task = asyncio.ensure_future(quiet())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.clients.aclose()


GATEWAY = web.AppKey("gateway", Gateway)


def gw(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


def _client(request: web.Request) -> tuple[AsyncClient, str]:
    key = api_key(request)
    return gw(request).clients.get(key), key


def _iso(t: datetime | None) -> str:
    return (t or datetime.now(UTC)).astimezone(UTC).isoformat().replace("+00:00", "Z")


def _template(info: SandboxInfo) -> str:
    return info.spec.image if info.spec else DEFAULT_TEMPLATE


def envd_token(g: Gateway, info: SandboxInfo, key: str) -> str:
    """The sandbox's ``envdAccessToken`` (remembered, to check the URLs it signs)."""
    token = signing.sandbox_token(info.id, key)
    g.tokens.add(token)
    return token


def sandbox_json(g: Gateway, info: SandboxInfo, key: str) -> dict[str, Any]:
    """The ``Sandbox`` object of create/connect."""
    return {
        "templateID": _template(info),
        "sandboxID": info.id,
        "alias": _template(info),
        "clientID": info.edge_id or "dsec",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": envd_token(g, info, key),
        # Sandbox ports need it (gateway/userports.py), and e2b_code_interpreter sends it
        # (not X-Access-Token) on its /contexts calls.
        "trafficAccessToken": key,
        "domain": g.domain,
    }


def listed_json(info: SandboxInfo) -> dict[str, Any]:
    spec = info.spec
    return {
        "templateID": _template(info),
        "alias": _template(info),
        "sandboxID": info.id,
        "clientID": info.edge_id or "dsec",
        "startedAt": _iso(info.started_at or info.created_at),
        "endAt": _iso(info.expires_at),
        "cpuCount": max(1, round(spec.cpu)) if spec else 1,
        "memoryMB": spec.memory_mb if spec else 0,
        "diskSizeMB": 0,
        "state": "paused" if info.state == "paused" else "running",
        "envdVersion": ENVD_VERSION,
        "metadata": lifecycle.visible_metadata(info),
    }


def detail_json(g: Gateway, info: SandboxInfo, key: str) -> dict[str, Any]:
    return {
        **listed_json(info),
        "envdAccessToken": envd_token(g, info, key),
        "domain": g.domain,
        "lifecycle": lifecycle.lifecycle_json(info),
    }


def error_response(status: int, message: str, *, retry: bool = True) -> web.Response:
    headers = {} if retry else {"Should-Retry": "false"}
    return web.json_response({"code": status, "message": message}, status=status, headers=headers)


async def _live(client: AsyncClient, sandbox_id: str) -> SandboxInfo:
    """The sandbox, or ``SandboxNotFound`` if it does not exist or has ended."""
    info = await client.get_sandbox(sandbox_id)
    if info.state not in LIVE_STATES:
        raise SandboxNotFound(f"sandbox {sandbox_id} is {info.state}")
    return info


def _str_map(body: dict[str, Any], key: str) -> dict[str, str]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidArgument(f"'{key}' must be an object of strings")
    return dict(value)


async def _json(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise InvalidArgument("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return body


def _timeout(body: dict[str, Any], default: int | None) -> int | None:
    t = body.get("timeout", default)
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, int | float) or t <= 0:
        raise InvalidArgument("'timeout' must be a positive number of seconds")
    return max(1, int(t))


BACKEND_METADATA_KEY = "dsec.backend"


def choose_backend(template: str, metadata: dict[str, str]) -> tuple[str, str]:
    """The backend and template of an E2B create.

    A template ``<backend>`` or ``<backend>:<template>`` (``function:base``) picks the
    backend; metadata ``dsec.backend`` overrides it; otherwise ``container``.
    """
    backend = "container"
    head, sep, rest = template.partition(":")
    if head in BACKENDS:
        backend, template = head, (rest if sep and rest else DEFAULT_TEMPLATE)
    chosen = metadata.get(BACKEND_METADATA_KEY)
    if chosen is not None:
        if chosen not in BACKENDS:
            raise InvalidArgument(
                f"metadata {BACKEND_METADATA_KEY}={chosen!r}: choose one of {', '.join(BACKENDS)}"
            )
        backend = chosen
    return backend, template


async def create(request: web.Request) -> web.Response:
    g = gw(request)
    client, key = _client(request)
    body = await _json(request)
    template = body.get("templateID") or DEFAULT_TEMPLATE
    if not isinstance(template, str):
        raise InvalidArgument("'templateID' must be a string")
    metadata = _str_map(body, "metadata")
    if is_snapshot_id(template):  # Sandbox.create(<snapshotID>)
        return await _create_from_snapshot(request, template, body)
    backend, template = choose_backend(template, metadata or {})
    on_timeout, lifecycle_meta = lifecycle.create_options(body)
    network = None
    internet = body.get("allow_internet_access", body.get("allowInternetAccess"))
    if body.get("network") is not None or internet is not None:
        if internet is not None and not isinstance(internet, bool):
            raise InvalidArgument("'allow_internet_access' must be a boolean")
        network = egress.policy(body.get("network"), internet)
    call = wire.create_sandbox(
        backend=backend,
        image=g.templates.get(template, template),
        cpu=g.cpu,
        memory_mb=g.memory_mb,
        pids=None,
        timeout_s=_timeout(body, DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S,
        env=_str_map(body, "envVars"),
        metadata={**metadata, **lifecycle_meta},
        network=network,
        on_timeout=on_timeout,
    )
    try:
        info = await client.transport.call(call)
    except ImageNotFound:  # Sandbox.create(<snapshot name>)
        return await _create_from_snapshot(request, body["templateID"], body)
    return web.json_response(sandbox_json(g, info, key), status=201)


async def _create_from_snapshot(
    request: web.Request, template: str, body: dict[str, Any]
) -> web.Response:
    from dsec.gateway import snapshots

    client, key = _client(request)
    snap = await snapshots.find(client, template)
    if snap is None:
        raise SnapshotNotFound(f"no template or snapshot {template!r}")
    info = await snapshots.create_sandbox(request, client, snap, body)
    return web.json_response(sandbox_json(gw(request), info, key), status=201)


async def connect(request: web.Request) -> web.Response:
    g = gw(request)
    client, key = _client(request)
    sid = request.match_info["sandbox_id"]
    body = await _json(request)
    info = await _live(client, sid)
    status = 200
    if info.state == "paused":  # connect resumes a paused sandbox, as on E2B
        info = await client.transport.call(wire.resume_sandbox(sid))
        status = 201
    timeout = _timeout(body, None)
    if timeout is not None:
        remaining = (info.expires_at - datetime.now(UTC)).total_seconds() if info.expires_at else 0
        if remaining < timeout:
            info = await client.transport.call(wire.set_timeout(sid, timeout))
    return web.json_response(sandbox_json(g, info, key), status=status)


async def pause(request: web.Request) -> web.Response:
    """Freeze the sandbox (every process stops; memory is kept); 409 if already paused."""
    client, _ = _client(request)
    sid = request.match_info["sandbox_id"]
    info = await _live(client, sid)
    if info.state == "paused":
        return error_response(409, f"sandbox {sid} is already paused", retry=False)
    await client.transport.call(wire.pause_sandbox(sid))
    return web.Response(status=204)


async def get_info(request: web.Request) -> web.Response:
    client, key = _client(request)
    info = await _live(client, request.match_info["sandbox_id"])
    return web.json_response(detail_json(gw(request), info, key))


async def kill(request: web.Request) -> web.Response:
    client, _ = _client(request)
    sid = request.match_info["sandbox_id"]
    await _live(client, sid)
    try:
        await client.kill_sandbox(sid)
    except InvalidState:
        raise SandboxNotFound(f"sandbox {sid} has already ended") from None
    return web.Response(status=204)


async def set_timeout(request: web.Request) -> web.Response:
    client, _ = _client(request)
    sid = request.match_info["sandbox_id"]
    timeout = _timeout(await _json(request), None)
    if timeout is None:
        raise InvalidArgument("'timeout' is required")
    await _live(client, sid)
    await client.transport.call(wire.set_timeout(sid, timeout))
    return web.Response(status=204)


def _metadata_filter(raw: str) -> dict[str, str]:
    """The SDK quotes each key and value, urlencodes the pairs, and sends that as one value."""
    return {
        urllib.parse.unquote(k): urllib.parse.unquote(v)
        for k, v in urllib.parse.parse_qsl(raw, keep_blank_values=True)
    }


def _page_token(raw: str) -> int:
    if not raw:
        return 0
    try:
        n = int(base64.urlsafe_b64decode(raw.encode() + b"==").decode())
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InvalidArgument("invalid nextToken") from None
    if n < 0:
        raise InvalidArgument("invalid nextToken")
    return n


def _started_after(raw: str) -> datetime | None:
    if not raw:
        return None
    try:
        # a "+" of the offset may arrive decoded as a space
        t = datetime.fromisoformat(raw.replace("Z", "+00:00").replace(" ", "+"))
    except ValueError:
        raise InvalidArgument(f"'startedAfter' is not an RFC 3339 time: {raw!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


async def list_sandboxes(request: web.Request) -> web.Response:
    client, _ = _client(request)
    q = request.query
    items = [i for i in await client.list_sandboxes() if i.state in LIVE_STATES]
    wanted_meta = _metadata_filter(q.get("metadata", ""))
    states = {s for v in q.getall("state", []) for s in v.split(",") if s}
    template = q.get("template", "")
    after = _started_after(q.get("startedAfter", ""))
    out = []
    for info in items:
        if after is not None and (info.started_at or info.created_at or after) < after:
            continue
        d = listed_json(info)
        if any(d["metadata"].get(k) != v for k, v in wanted_meta.items()):
            continue
        if states and d["state"] not in states:
            continue
        if template and d["templateID"] != template:
            continue
        out.append(d)
    out.sort(key=lambda d: d["startedAt"], reverse=q.get("order") == "desc")
    limit_raw = q.get("limit", "")
    if limit_raw and not limit_raw.isdigit():
        raise InvalidArgument("'limit' must be a positive integer")
    limit = min(int(limit_raw or MAX_PAGE), MAX_PAGE) or MAX_PAGE
    start = _page_token(q.get("nextToken", ""))
    page = out[start : start + limit]
    headers = {"X-Total-Running": str(len(out))}
    if start + limit < len(out):
        headers["X-Next-Token"] = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
    return web.json_response(page, headers=headers)


async def update_network(request: web.Request) -> web.Response:
    """``PUT /sandboxes/{id}/network``: replace the egress rules (see ``egress.py``)."""
    client, _ = _client(request)
    sid = request.match_info["sandbox_id"]
    body = await _json(request)
    internet = body.get("allowInternetAccess")
    if internet is not None and not isinstance(internet, bool):
        raise InvalidArgument("'allowInternetAccess' must be a boolean")
    policy = egress.policy(body, internet)
    await _live(client, sid)
    await client.transport.call(wire.set_network(sid, policy))
    return web.Response(status=204)


async def metrics(request: web.Request) -> web.Response:
    """``GET /sandboxes/{id}/metrics``: one sample taken now (OpenDsec keeps no history)."""
    client, _ = _client(request)
    sid = request.match_info["sandbox_id"]
    info = await _live(client, sid)
    if info.state != "running":
        return web.json_response([])
    res = await client.transport.call(rc.exec_command(sid, usage.SCRIPT, timeout=10))
    sample = usage.parse(res.stdout)
    spec = info.spec
    cpus = max(1, round(spec.cpu)) if spec else 1
    mem_total = spec.memory_mb * 1024 * 1024 if spec else int(sample.get("mem_total", 0))
    now = datetime.now(UTC)
    return web.json_response(
        [
            {
                "timestamp": _iso(now),
                "timestampUnix": int(now.timestamp()),
                "cpuCount": cpus,
                "cpuUsedPct": round(min(100.0, sample.get("cpu_core_pct", 0.0) / cpus), 2),
                "memUsed": int(sample.get("mem_used", 0)),
                "memTotal": mem_total,
                "memCache": int(sample.get("mem_cache", 0)),
                "diskUsed": int(sample.get("disk_used", 0)),
                "diskTotal": int(sample.get("disk_total", 0)),
            }
        ]
    )


async def unrouted_files(request: web.Request) -> web.StreamResponse:
    """``/files`` without a sandbox: what ``download_url()``/``upload_url()`` give in
    ``E2B_SANDBOX_URL`` mode (the URL names no sandbox: the token that signed it does)."""
    from dsec.gateway import envd

    try:
        sandbox_id, _ = gw(request).tokens.verify(request, None)
    except DsecError as exc:
        return envd.http_error(exc)
    return await envd.dispatch(request, sandbox_id, ENVD_PORT)


def dsec_error_response(request: web.Request, exc: DsecError) -> web.Response:
    status = exc.http_status
    if isinstance(exc, NotFound) and "sandbox_id" in request.match_info:
        message = f"sandbox {request.match_info['sandbox_id']} not found: {exc.message}"
    else:
        message = exc.message
    return error_response(status, message, retry=request.method == "GET")


ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/sandboxes", create),
    ("POST", "/v2/sandboxes", create),
    ("GET", "/sandboxes", list_sandboxes),
    ("GET", "/v2/sandboxes", list_sandboxes),
    ("GET", "/sandboxes/{sandbox_id}", get_info),
    ("DELETE", "/sandboxes/{sandbox_id}", kill),
    ("POST", "/sandboxes/{sandbox_id}/timeout", set_timeout),
    ("POST", "/sandboxes/{sandbox_id}/connect", connect),
    ("POST", "/v2/sandboxes/{sandbox_id}/connect", connect),
    ("POST", "/sandboxes/{sandbox_id}/resume", connect),
    ("POST", "/sandboxes/{sandbox_id}/pause", pause),
    ("PUT", "/sandboxes/{sandbox_id}/network", update_network),
    ("GET", "/sandboxes/{sandbox_id}/metrics", metrics),
    ("GET", "/files", unrouted_files),
    ("POST", "/files", unrouted_files),
]
