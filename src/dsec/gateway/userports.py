"""Sandbox ports other than envd's through the gateway (what ``sbx.get_host(port)`` names).

The caller authenticates like E2B's ``allowPublicTraffic: false`` mode: the sandbox's
``trafficAccessToken`` in ``E2B-Traffic-Access-Token`` (or ``X-Access-Token``, or
``Authorization: Bearer``). That token is the caller's OpenDsec key, so OpenDsec's own checks
decide. Plain requests go through the API's port proxy; upgrades (WebSockets) are spliced
onto a connection to the apiserver, which splices them onto the sandbox's port in turn.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse

from aiohttp import web

from dsec.apiserver import upgrade
from dsec.core.errors import Unauthenticated, Unavailable
from dsec.gateway import signing
from dsec.gateway.control import gw

TOKEN_HEADERS = ("E2B-Traffic-Access-Token", "X-Access-Token")
# Never passed on to the sandbox's server.
DROP = (*TOKEN_HEADERS, "Authorization", "E2b-Sandbox-Id", "E2b-Sandbox-Port")
READ_CHUNK = 64 * 1024
CONNECT_TIMEOUT_S = 10.0  # to the apiserver (TCP and TLS)


def port_token(request: web.Request) -> str:
    for name in TOKEN_HEADERS:
        value = request.headers.get(name, "").strip()
        if value:
            return signing.key_of(value)
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return auth[7:].strip()
    raise Unauthenticated(
        "sandbox ports need the sandbox's traffic access token "
        "(header E2B-Traffic-Access-Token: <sandbox.traffic_access_token>)"
    )


class StreamPipe:
    """A plain TCP (or TLS) connection as an :class:`upgrade.Pipe`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> StreamPipe:
        u = urllib.parse.urlsplit(url)
        tls = u.scheme == "https"
        ctx = ssl.create_default_context() if tls else None  # honours SSL_CERT_FILE
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(
                    u.hostname, u.port or (443 if tls else 80), ssl=ctx
                )
        except TimeoutError:
            raise Unavailable(
                f"cannot reach the apiserver at {url} within {CONNECT_TIMEOUT_S:g} s"
            ) from None
        except OSError as exc:
            raise Unavailable(f"cannot reach the apiserver at {url}: {exc}") from None
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def close_write(self) -> None:
        if self._writer.can_write_eof():
            self._writer.write_eof()

    async def recv(self) -> bytes:
        return await self._reader.read(READ_CHUNK)

    async def aclose(self) -> None:
        self._writer.close()


async def splice_port(request: web.Request, sandbox_id: str, port: int) -> web.StreamResponse:
    """Pass an upgrade request (WebSocket) to ``port`` in the sandbox, then the connection."""
    token = port_token(request)
    api_url = gw(request).clients.api_url
    netloc = urllib.parse.urlsplit(api_url).netloc
    target = f"/v1/sandboxes/{sandbox_id}/ports/{port}{request.path_qs}"
    head = upgrade.request_head(
        request, target, netloc, DROP, extra=[("Authorization", f"Bearer {token}")]
    )
    # The apiserver behind us waits for the port (ports.CONNECT_TIMEOUT_S) and then the
    # answer (upgrade.ANSWER_TIMEOUT_S) and says which failed: wait longer than both.
    pipe = await StreamPipe.open(api_url)
    return await upgrade.splice(request, pipe, head, answer_timeout_s=2 * upgrade.ANSWER_TIMEOUT_S)
