"""Reaching a server on a port inside a sandbox: plain HTTP (the ``http`` runtime op) and
upgraded connections such as WebSockets (spliced onto the ``tcp`` runtime op).

Both the path form ``/v1/sandboxes/{id}/ports/{port}/...`` and host-style routing
(``hostroute.py``) end here, after the caller was authenticated like any API call.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from dsec.agent import protocol
from dsec.apiserver import relay, upgrade
from dsec.apiserver.context import ctx, principal
from dsec.core.errors import DeadlineExceeded

HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Authorization",
        "Host",
        "Content-Length",
    )
)
# Our own credentials never reach the sandbox's server.
CREDENTIAL_HEADERS = ("Authorization", "X-Dsec-Token")
# How long reaching the port may take (the edge, its agent, the agent's own 10 s connect).
CONNECT_TIMEOUT_S = 20.0


class EdgeTcpPipe:
    """A ``tcp`` runtime call as an :class:`upgrade.Pipe`."""

    def __init__(self, stream: relay.EdgeStream) -> None:
        self._stream = stream
        self.result: dict[str, object] = {}

    @classmethod
    async def open(
        cls, request: web.Request, sandbox_id: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S
    ) -> EdgeTcpPipe:
        """Connected to ``port``. Raises DeadlineExceeded when that takes over ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                return await cls._open(request, sandbox_id, port)
        except TimeoutError:
            raise DeadlineExceeded(
                f"port {port} of sandbox {sandbox_id} did not connect within {timeout_s:g} s"
            ) from None

    @classmethod
    async def _open(cls, request: web.Request, sandbox_id: str, port: int) -> EdgeTcpPipe:
        c, p = ctx(request), principal(request)
        stream = await relay.EdgeStream.open(c, p, sandbox_id, {"op": "tcp", "port": port})
        try:
            while (frame := await stream.read()) is not None:
                kind, data = frame
                if kind == protocol.KIND_JSON:
                    msg = protocol.decode_json(data)
                    if msg.get("event") == "connected":
                        return cls(stream)
                    if protocol.is_final(msg):
                        relay.raise_for_final(msg)
            raise DeadlineExceeded("the tcp call ended before it connected")
        except BaseException:
            stream.cancel()
            raise

    async def send(self, data: bytes) -> None:
        await self._stream.send(protocol.KIND_IN, data)

    async def close_write(self) -> None:
        await self._stream.send(protocol.KIND_CLOSE)

    async def recv(self) -> bytes:
        while (frame := await self._stream.read()) is not None:
            kind, data = frame
            if kind == protocol.KIND_OUT:
                return data
            if kind == protocol.KIND_JSON:
                msg = protocol.decode_json(data)
                if protocol.is_final(msg):
                    self.result = msg.get("result") or {}
                    return b""
        return b""

    async def aclose(self) -> None:
        self._stream.cancel()


async def forward(
    request: web.Request, sandbox_id: str, port: int, path: str
) -> web.StreamResponse:
    """Forward ``request`` to ``port`` in the sandbox, as ``path`` (with the query string)."""
    principal(request).require("member")
    if request.query_string:
        path += "?" + request.query_string
    if upgrade.is_upgrade(request):
        pipe = await EdgeTcpPipe.open(request, sandbox_id, port)
        head = upgrade.request_head(request, path, f"localhost:{port}", CREDENTIAL_HEADERS)
        return await upgrade.splice(request, pipe, head)
    return await _http(request, sandbox_id, port, path)


async def _http(request: web.Request, sid: str, port: int, path: str) -> web.StreamResponse:
    c, p = ctx(request), principal(request)
    headers = [
        [k, v]
        for k, v in request.headers.items()
        if k.lower() not in HOP_HEADERS and k.lower() != "x-dsec-token"
    ]
    headers.append(["Host", f"localhost:{port}"])
    stream = await relay.EdgeStream.open(
        c,
        p,
        sid,
        {"op": "http", "port": port, "method": request.method, "path": path, "headers": headers},
    )
    try:
        async for chunk in request.content.iter_chunked(protocol.CHUNK):
            await stream.send(protocol.KIND_IN, chunk)
        await stream.send(protocol.KIND_CLOSE)
        await stream.done_writing()
        resp: web.StreamResponse | None = None
        while (frame := await stream.read()) is not None:
            kind, data = frame
            if kind == protocol.KIND_OUT and resp is not None:
                await resp.write(data)
            elif kind == protocol.KIND_JSON:
                msg = protocol.decode_json(data)
                if msg.get("event") == "response" and resp is None:
                    resp = web.StreamResponse(status=int(msg.get("status", 502)))
                    for k, v in msg.get("headers", []):
                        if str(k).lower() not in HOP_HEADERS:
                            resp.headers.add(str(k), str(v))
                    await resp.prepare(request)
                elif protocol.is_final(msg):
                    relay.raise_for_final(msg)
                    if resp is None:
                        raise DeadlineExceeded("the sandbox server sent no response")
                    await resp.write_eof()
                    return resp
        raise DeadlineExceeded("the proxied request ended without a result")
    finally:
        stream.cancel()
