"""The sandbox-bound side of the gateway: envd's RPC services and its plain HTTP routes.

Requests reach here when they name a sandbox (``E2b-Sandbox-Id`` or the Host). A sandbox
that does not exist (or has ended) is answered like E2B's proxy does, ``502`` with "The
sandbox was not found", which the SDK turns into ``SandboxNotRunningException``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import re
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import BodyPartReader, web

from dsec.agent.protocol import CHUNK
from dsec.apiserver import upgrade
from dsec.core.errors import (
    DsecError,
    InvalidArgument,
    InvalidState,
    SandboxNotFound,
    Unavailable,
)
from dsec.gateway import filesystem, lifecycle, process, signing, userports
from dsec.gateway.connect import (
    STREAM_TYPE,
    ConnectError,
    ServerStream,
    connect_error,
    read_envelopes,
    read_request,
    timeout_s,
    unary_error,
    unary_ok,
)
from dsec.gateway.control import LIVE_STATES, gw
from dsec.gateway.upstream import ENVD_PORT, access_token
from dsec.sdk import runtime_calls as rc
from dsec.sdk.async_sandbox import AsyncClient

NOT_FOUND_MESSAGE = "The sandbox was not found"
PORT_CLOSED_MESSAGE = "The sandbox is running but port is not open"


def sandbox_gone(sandbox_id: str) -> web.Response:
    body = {"sandboxId": sandbox_id, "message": NOT_FOUND_MESSAGE, "code": 502}
    return web.json_response(body, status=502)


def _user(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if not auth.lower().startswith("basic "):
        return None
    try:
        user = base64.b64decode(auth[6:].strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, ValueError):
        raise InvalidArgument("malformed Authorization header") from None
    return user or None


def _call(request: web.Request, sandbox_id: str) -> process.Call:
    g = gw(request)
    raw = request.headers.get("Keepalive-Ping-Interval", "")
    return process.Call(
        sandbox_id=sandbox_id,
        client=g.clients.get(access_token(request)),
        user=_user(request),
        timeout_s=timeout_s(request),
        keepalive_s=float(raw) if raw.isdigit() else 0.0,
        background=g.background,
    )


async def rpc(
    request: web.Request, sandbox_id: str, service: str, method: str
) -> web.StreamResponse:
    """One Connect call of ``process.Process`` or ``filesystem.Filesystem``."""
    if service == "process.Process":
        unary, server, client = process.UNARY, process.SERVER_STREAM, process.CLIENT_STREAM
    else:
        unary, server, client = filesystem.UNARY, filesystem.SERVER_STREAM, {}
    streaming = method in server or method in client
    stream = ServerStream(request)
    msg: dict[str, Any] | None = None
    for attempt in range(2):
        try:
            if method not in unary and not streaming:
                raise ConnectError("unimplemented", f"{service}/{method} is not supported")
            if streaming and request.content_type != STREAM_TYPE:
                raise ConnectError("invalid_argument", f"{method} needs {STREAM_TYPE}")
            c = _call(request, sandbox_id)
            if method in client:  # its body cannot be sent twice: resume a paused one first
                await lifecycle.resume_if_paused(c.client, sandbox_id)
                await client[method](c, read_envelopes(request.content), stream)
                return await stream.end()
            if msg is None:
                msg = await read_request(request)
            if method in server:
                await server[method](c, msg, stream)
                return await stream.end()
            return unary_ok(await unary[method](c, msg))
        except (SandboxNotFound, InvalidState) as exc:
            if isinstance(exc, SandboxNotFound) or await _ended(request, sandbox_id):
                if stream.started:
                    return await stream.end(ConnectError("unavailable", NOT_FOUND_MESSAGE))
                return sandbox_gone(sandbox_id)
            if (
                attempt == 0
                and msg is not None
                and not stream.started
                and await lifecycle.resume_if_paused(c.client, sandbox_id)
            ):
                continue  # auto-resume: serve the call on the resumed sandbox
            err = connect_error(exc)
            return await stream.end(err) if streaming or stream.started else unary_error(err)
        except (DsecError, ConnectError) as exc:
            err = connect_error(exc)
            if streaming or stream.started:
                return await stream.end(err)
            return unary_error(err)
        except ConnectionError:
            return stream.response_or_empty()
    raise AssertionError("unreachable")  # the second attempt always returns


async def _ended(request: web.Request, sandbox_id: str) -> bool:
    """Whether the sandbox has stopped (OpenDsec answers calls to it with invalid_state)."""
    try:
        info = await gw(request).clients.get(access_token(request)).get_sandbox(sandbox_id)
    except DsecError:
        return False
    return info.state not in LIVE_STATES


def http_error(exc: DsecError) -> web.Response:
    status = 507 if exc.code == "payload_too_large" else exc.http_status
    return web.json_response({"code": status, "message": exc.message}, status=status)


async def files_get(request: web.Request, sandbox_id: str) -> web.StreamResponse:
    client = _file_client(request, sandbox_id)
    req = rc.read_file(sandbox_id, request.query.get("path", ""))
    resp: web.StreamResponse | None = None
    async with client.transport.download(req) as chunks:
        async for chunk in chunks:
            if resp is None:
                resp = await _download_response(request)
            await resp.write(chunk)
    if resp is None:
        resp = await _download_response(request)
    await resp.write_eof()
    return resp


async def _download_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await resp.prepare(request)
    return resp


def _file_client(request: web.Request, sandbox_id: str) -> AsyncClient:
    """The caller's client on ``/files``: by its access token, or a signed URL's."""
    g = gw(request)
    if "signature" in request.query and "X-Access-Token" not in request.headers:
        return g.clients.get(g.tokens.verify(request, sandbox_id)[1])
    return g.clients.get(access_token(request))


async def _part_chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(CHUNK):
        yield chunk


async def _body_chunks(request: web.Request) -> AsyncIterator[bytes]:
    """The upload body; aiohttp already undoes ``Content-Encoding: gzip`` as it reads."""
    async for chunk in request.content.iter_chunked(CHUNK):
        yield chunk


_FILENAME_RE = re.compile(r"""(?:^|;)\s*filename\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;]*))""", re.I)


def _part_filename(part: BodyPartReader) -> str:
    """The part's filename as sent: a destination path (aiohttp's parser strips the '/')."""
    m = _FILENAME_RE.search(part.headers.get("Content-Disposition", ""))
    if m is None:
        return ""
    if m.group(1) is not None:
        return re.sub(r"\\(.)", r"\1", m.group(1))
    return urllib.parse.unquote(m.group(2).strip())


def _written(path: str) -> dict[str, Any]:
    return {"name": os.path.basename(path.rstrip("/")) or path, "type": "file", "path": path}


async def files_post(request: web.Request, sandbox_id: str) -> web.Response:
    client = _file_client(request, sandbox_id)
    query_path = request.query.get("path", "")
    written: list[dict[str, Any]] = []
    if request.content_type.startswith("multipart/"):
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise InvalidArgument("nested multipart bodies are not supported")
            path = query_path or _part_filename(part)
            if not path:
                raise InvalidArgument("each file part needs a filename (its destination path)")
            res = await client.transport.call(rc.write_file(sandbox_id, path), _part_chunks(part))
            written.append(_written(res.path))
    else:
        if not query_path:
            raise InvalidArgument("'path' is required")
        res = await client.transport.call(
            rc.write_file(sandbox_id, query_path), _body_chunks(request)
        )
        written.append(_written(res.path))
    if not written:
        raise InvalidArgument("the upload carried no file")
    return web.json_response(written)


async def health(request: web.Request, sandbox_id: str) -> web.Response:
    if "X-Access-Token" in request.headers:
        info = await gw(request).clients.get(access_token(request)).get_sandbox(sandbox_id)
        if info.state not in LIVE_STATES:
            return sandbox_gone(sandbox_id)
    return web.Response(status=204)


async def envs(request: web.Request, sandbox_id: str) -> web.Response:
    info = await gw(request).clients.get(access_token(request)).get_sandbox(sandbox_id)
    return web.json_response(dict(info.spec.env) if info.spec else {})


HTTP_ROUTES = {
    ("GET", "/files"): files_get,
    ("POST", "/files"): files_post,
    ("GET", "/health"): health,
    ("GET", "/envs"): envs,
}


_HOP = frozenset(
    (
        "host",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "upgrade",
        "te",
        "trailer",
        "x-access-token",
        "e2b-traffic-access-token",
        "authorization",
        "e2b-sandbox-id",
        "e2b-sandbox-port",
    )
)
MAX_PORT_BODY = 64 * 1024 * 1024
# The code interpreter's port (e2b_code_interpreter) is retried while closed: its server
# starts with the sandbox (the image's Entrypoint) and may not listen yet. Other ports 502.
CODE_INTERPRETER_PORT = 49999
PORT_OPEN_WAIT_S = 30.0


async def port_proxy(request: web.Request, sandbox_id: str, port: int) -> web.StreamResponse:
    """Forward a request to a server on ``port`` inside the sandbox (HTTP only).

    The answer is passed on as the server sends it (the code interpreter streams a cell's
    output line by line). It is authenticated by the traffic access token
    (``userports.port_token``)."""
    client = gw(request).clients.get(userports.port_token(request))
    body = await request.content.read(MAX_PORT_BODY + 1)
    if len(body) > MAX_PORT_BODY:
        raise InvalidArgument(f"request bodies to sandbox ports are limited to {MAX_PORT_BODY}")
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
    req = rc.port_request(
        sandbox_id, port, request.method, request.path_qs, headers, body or None, timeout=300
    )
    deadline = time.monotonic() + (PORT_OPEN_WAIT_S if port == CODE_INTERPRETER_PORT else 0)
    resp: web.StreamResponse | None = None
    while True:
        try:
            async with client.transport.port_stream(req) as (status, got, chunks):
                resp = web.StreamResponse(status=status)
                for k, v in got:
                    # the platform hands over the decoded body
                    if k.lower() not in _HOP and k.lower() != "content-encoding":
                        resp.headers.add(k, v)
                await resp.prepare(request)
                async for chunk in chunks:
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except Unavailable:
            if resp is not None and resp.prepared:
                raise  # broke off mid-answer: nothing more can be said to the client
            # A server the image starts at create may still be opening its port.
            if time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                continue
            msg = {
                "sandboxId": sandbox_id,
                "message": PORT_CLOSED_MESSAGE,
                "port": port,
                "code": 502,
            }
            return web.json_response(msg, status=502)


async def dispatch(request: web.Request, sandbox_id: str, port: int) -> web.StreamResponse:
    """Serve one sandbox-bound request."""
    token = request.headers.get("X-Access-Token", "").strip()
    if signing.sandbox_of(token) == sandbox_id:  # a token it handed out (before a restart)
        gw(request).tokens.add(token)
    if port != ENVD_PORT:
        try:
            if upgrade.is_upgrade(request):
                return await userports.splice_port(request, sandbox_id, port)
            return await port_proxy(request, sandbox_id, port)
        except SandboxNotFound:
            return sandbox_gone(sandbox_id)
        except DsecError as exc:
            return http_error(exc)
    path = request.path
    for service in ("process.Process", "filesystem.Filesystem"):
        prefix = f"/{service}/"
        if path.startswith(prefix) and request.method == "POST":
            return await rpc(request, sandbox_id, service, path[len(prefix) :])
    handler = HTTP_ROUTES.get((request.method, path))
    if handler is None:
        return web.json_response({"code": 404, "message": f"no route {path}"}, status=404)
    replayable = request.method == "GET"
    for attempt in range(2):
        try:
            if not replayable:  # an upload cannot be sent twice: resume a paused one first
                await lifecycle.resume_if_paused(_file_client(request, sandbox_id), sandbox_id)
            return await handler(request, sandbox_id)
        except SandboxNotFound:
            return sandbox_gone(sandbox_id)
        except DsecError as exc:
            if isinstance(exc, InvalidState):
                if await _ended(request, sandbox_id):
                    return sandbox_gone(sandbox_id)
                if (
                    replayable
                    and attempt == 0
                    and await lifecycle.resume_if_paused(
                        _file_client(request, sandbox_id), sandbox_id
                    )
                ):
                    continue  # auto-resume: serve it on the resumed sandbox
            return http_error(exc)
    raise AssertionError("unreachable")  # the second attempt always returns
