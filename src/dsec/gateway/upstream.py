"""The gateway's way to OpenDsec: the public HTTP API, as a client with the caller's key.

E2B sends its API key as ``X-API-Key`` on control-plane calls and the sandbox's
``envdAccessToken`` as ``X-Access-Token`` on sandbox calls. The gateway keeps no records:
the access token it hands out *is* the caller's OpenDsec API key, so every call goes to the
apiserver authenticated as the caller and OpenDsec's own checks (key, project, role)
decide. Clients are pooled per key (a bounded cache of keep-alive connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import OrderedDict

import httpx
from aiohttp import web

from dsec.core.errors import InvalidArgument, Unauthenticated
from dsec.gateway import signing
from dsec.sdk.async_sandbox import AsyncClient
from dsec.sdk.config import ClientConfig

MAX_CLIENTS = 64
CLOSE_EVICTED_AFTER_S = 120.0
ENVD_PORT = 49983
_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9][a-z0-9-]{0,62})\.")


class Clients:
    """One :class:`AsyncClient` per API key, least recently used evicted past a bound."""

    def __init__(
        self,
        api_url: str,
        max_clients: int = MAX_CLIENTS,
        *,
        http_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        self._max = max_clients
        self._transport = http_transport  # tests: an in-memory apiserver
        self._clients: OrderedDict[str, AsyncClient] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, api_key: str) -> AsyncClient:
        client = self._clients.get(api_key)
        if client is not None:
            self._clients.move_to_end(api_key)
            return client
        config = ClientConfig(api_url=self.api_url, api_key=api_key)
        client = AsyncClient(config=config, http_transport=self._transport)
        self._clients[api_key] = client
        while len(self._clients) > self._max:
            _, old = self._clients.popitem(last=False)
            task = asyncio.ensure_future(_close_later(old))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return client

    async def aclose(self) -> None:
        for task in list(self._closing):
            task.cancel()
        clients, self._clients = list(self._clients.values()), OrderedDict()
        for c in clients:
            await c.aclose()


async def _close_later(client: AsyncClient) -> None:
    """Close an evicted client once requests it may still be serving are done."""
    try:
        await asyncio.sleep(CLOSE_EVICTED_AFTER_S)
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()


def api_key(request: web.Request) -> str:
    """The caller's key on a control-plane call (``X-API-Key``, or a bearer token)."""
    key = request.headers.get("X-API-Key", "").strip()
    if not key:
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            key = auth[7:].strip()
    if not key:
        raise Unauthenticated("missing API key: send it as X-API-Key (E2B_API_KEY)")
    return key


def access_token(request: web.Request) -> str:
    """The caller's key on a sandbox call: the ``X-Access-Token`` create returned."""
    token = request.headers.get("X-Access-Token", "").strip()
    if not token:  # the same key, as e2b_code_interpreter's contexts calls send it
        token = request.headers.get("E2B-Traffic-Access-Token", "").strip()
    if not token:
        raise Unauthenticated("missing X-Access-Token (the sandbox's envdAccessToken)")
    return signing.key_of(token)


def target(request: web.Request) -> tuple[str, int] | None:
    """``(sandbox id, port)`` of a sandbox-bound request, or None for the control plane.

    The ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers win (``E2B_SANDBOX_URL`` mode);
    otherwise a Host of the form ``<port>-<sandbox id>.<domain>`` names them.
    """
    sid = request.headers.get("E2b-Sandbox-Id", "").strip()
    if sid:
        raw = request.headers.get("E2b-Sandbox-Port", "").strip() or str(ENVD_PORT)
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise InvalidArgument(f"invalid E2b-Sandbox-Port {raw!r}")
        return sid, int(raw)
    m = _HOST_RE.match(request.host.lower())
    if m and 0 < int(m.group(1)) < 65536:
        return m.group(2), int(m.group(1))
    return None
