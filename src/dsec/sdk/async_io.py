"""The asyncio I/O shell of the SDK: keep-alive HTTP (``ahttp1`` for JSON calls, an
``httpx.AsyncClient`` for the rest) plus WebSockets.

The twin of ``sync_io.py``: it sends what the sans-I/O modules build and translates foreign
exceptions once, with the same helpers, so both shells report identical errors.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import TypeVar

import httpx
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from dsec.agent.protocol import CHUNK, MAX_FRAME
from dsec.core.errors import DsecError, Internal
from dsec.sdk.ahttp1 import AsyncHttp1Pool
from dsec.sdk.config import ClientConfig, tls_verify
from dsec.sdk.http1 import usable
from dsec.sdk.models import ExecEvent, HttpResponse
from dsec.sdk.runtime_calls import port_response
from dsec.sdk.streams import CLOSE_MESSAGE, RuntimeStream, input_messages, runtime_url
from dsec.sdk.sync_io import URL_CACHE_SIZE, WS_OPEN_TIMEOUT_S, translate_httpx, translate_ws
from dsec.sdk.wire import (
    CONNECT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    USER_AGENT,
    Call,
    Request,
    auth_headers,
    error_for_status,
    finish,
)

T = TypeVar("T")
AsyncContent = bytes | AsyncIterable[bytes]
AsyncStdin = bytes | Iterable[bytes] | AsyncIterable[bytes]


def _timeout(seconds: float | None) -> httpx.Timeout:
    return httpx.Timeout(seconds, connect=CONNECT_TIMEOUT_S, pool=None)


class AsyncRuntimeSocket:
    """One runtime call over a WebSocket; ``async for`` it for events until the final one."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self.stream = RuntimeStream()

    async def send(self, message: bytes) -> None:
        try:
            await self._ws.send(message)
        except ConnectionClosed as exc:
            raise self.stream.closed_early(str(exc)) from None

    async def send_input(self, data: bytes) -> None:
        for message in input_messages(data):
            await self.send(message)

    async def close_input(self) -> None:
        await self.send(CLOSE_MESSAGE)

    async def next_event(self) -> ExecEvent | None:
        """Wait for the next output or final event; ``None`` once the call has finished."""
        while not self.stream.done:
            try:
                message = await self._ws.recv()
            except ConnectionClosed as exc:
                raise self.stream.closed_early(str(exc)) from None
            event = self.stream.feed(message)
            if event is not None:
                return event
        return None

    async def __aiter__(self) -> AsyncIterator[ExecEvent]:
        while (event := await self.next_event()) is not None:
            yield event

    async def wait_event(self, name: str) -> None:
        """Wait for the server's ``name`` event (a final error frame raises it)."""
        while not self.stream.done:
            try:
                message = await self._ws.recv()
            except ConnectionClosed as exc:
                raise self.stream.closed_early(str(exc)) from None
            if self.stream.feed(message) is not None:
                raise Internal(f"the runtime stream sent output before the {name!r} event")
            if self.stream.events and self.stream.events[-1].get("event") == name:
                return
        raise Internal(f"the runtime call ended without the {name!r} event")

    async def close(self) -> None:
        await self._ws.close()


class AsyncTransport:
    """Sends calls over one pooled keep-alive async HTTP client; opens runtime WebSockets."""

    def __init__(
        self, config: ClientConfig, *, http_transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.config = config
        self._headers = auth_headers(config.api_key)
        self._http = httpx.AsyncClient(
            base_url=config.api_url,
            headers=self._headers,
            timeout=_timeout(DEFAULT_TIMEOUT_S),
            transport=http_transport,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            verify=tls_verify(config.api_url),
        )
        self._timeouts: dict[float | None, httpx.Timeout] = {}
        self._urls: dict[str, httpx.URL] = {}
        self._pool = (
            AsyncHttp1Pool(config.api_url, self._headers, tls_verify(config.api_url))
            if http_transport is None and usable(config.api_url)
            else None
        )

    def _url(self, path: str) -> httpx.URL:
        """The absolute URL of ``path``, parsed once (httpx's base-URL merge is slow)."""
        url = self._urls.get(path)
        if url is None:
            url = httpx.URL(self.config.api_url + path)
            if len(self._urls) < URL_CACHE_SIZE:
                self._urls[path] = url
        return url

    def _req_timeout(self, seconds: float | None) -> httpx.Timeout:
        t = self._timeouts.get(seconds)
        if t is None:
            t = self._timeouts[seconds] = _timeout(seconds)
        return t

    async def send(self, req: Request, content: AsyncContent | None = None) -> httpx.Response:
        """Send ``req`` (with ``content`` instead of its body if given) and read the answer."""
        try:
            return await self._http.request(
                req.method,
                self._url(req.path),
                params=req.params or None,
                content=req.body if content is None else content,
                headers=req.headers or None,
                timeout=self._req_timeout(req.timeout),
            )
        except httpx.HTTPError as exc:
            raise translate_httpx(self.config.api_url, exc, req.timeout) from None

    async def _unary(self, req: Request, content: AsyncContent | None) -> tuple[int, bytes]:
        """(status, body) of a request whose body is in memory: through the pool if any."""
        if self._pool is not None and (content is None or isinstance(content, bytes)):
            return await self._pool.request(req, req.body if content is None else content)
        resp = await self.send(req, content)
        return resp.status_code, resp.content

    async def call(self, call: Call[T], content: AsyncContent | None = None) -> T:
        return finish(call, *await self._unary(call.request, content))

    async def fetch(self, req: Request) -> bytes:
        """Send ``req`` and return the raw body of a successful answer."""
        status, body = await self._unary(req, None)
        if status >= 300:
            raise error_for_status(status, body)[0]
        return body

    async def port(self, req: Request) -> HttpResponse:
        resp = await self.send(req)
        return port_response(resp.status_code, resp.headers.multi_items(), resp.content)

    @asynccontextmanager
    async def port_stream(
        self, req: Request, content: AsyncContent | None = None
    ) -> AsyncIterator[tuple[int, list[tuple[str, str]], AsyncIterator[bytes]]]:
        """Like :meth:`port`, but the body is yielded as the sandbox server sends it.

        Yields ``(status, headers, chunks)``; the platform's own refusals raise, as in
        :meth:`port` (their bodies are read first, the sandbox's are not).
        """
        try:
            async with self._http.stream(
                req.method,
                self._url(req.path),
                content=req.body if content is None else content,
                headers=req.headers or None,
                timeout=self._req_timeout(req.timeout),
            ) as resp:
                headers = resp.headers.multi_items()
                maybe_platform = "x-dsec-error" in resp.headers or (
                    resp.status_code in (401, 403, 404, 502, 503, 504)
                    and resp.headers.get("content-type", "").startswith("application/json")
                )
                if maybe_platform:
                    body = await resp.aread()
                    port_response(resp.status_code, headers, body)  # raises the platform's

                    async def whole() -> AsyncIterator[bytes]:
                        yield body

                    yield resp.status_code, headers, whole()
                else:
                    yield resp.status_code, headers, resp.aiter_bytes()
        except httpx.HTTPError as exc:
            raise translate_httpx(self.config.api_url, exc, req.timeout) from None

    @asynccontextmanager
    async def download(
        self, req: Request, chunk_size: int = CHUNK, content: AsyncContent | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """Open a streamed download; the yielded iterator gives the body in chunks.

        ``content`` (chunks) is sent as the body instead of ``req.body``.
        """
        try:
            async with self._http.stream(
                req.method,
                self._url(req.path),
                params=req.params or None,
                content=req.body if content is None else content,
                headers=dict(req.headers),
                timeout=self._req_timeout(req.timeout),
            ) as resp:
                if resp.status_code >= 300:
                    raise error_for_status(resp.status_code, await resp.aread())[0]
                yield resp.aiter_bytes(chunk_size)
        except httpx.HTTPError as exc:
            raise translate_httpx(self.config.api_url, exc, req.timeout) from None

    async def open_runtime(self, sandbox_id: str, first: bytes) -> AsyncRuntimeSocket:
        """Open the sandbox's runtime WebSocket and send the call's request message."""
        url = runtime_url(self.config.api_url, sandbox_id)
        try:
            ws = await ws_connect(
                url,
                additional_headers={"Authorization": self._headers["Authorization"]},
                user_agent_header=USER_AGENT,
                compression=None,
                open_timeout=WS_OPEN_TIMEOUT_S,
                close_timeout=2,
                max_size=MAX_FRAME + 16,
            )
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise translate_ws(url, exc) from None
        sock = AsyncRuntimeSocket(ws)
        try:
            await sock.send(first)
        except BaseException:
            await sock.close()
            raise
        return sock

    async def events(
        self, sandbox_id: str, first: bytes, stdin: AsyncStdin | None = None
    ) -> AsyncGenerator[ExecEvent, None]:
        """Run one streamed call: send ``stdin`` (if any, then end it) and yield events."""
        sock = await self.open_runtime(sandbox_id, first)
        failures: list[BaseException] = []
        pump: asyncio.Task[None] | None = None
        try:
            if isinstance(stdin, bytes | bytearray | memoryview) and len(stdin) <= CHUNK:
                try:
                    await sock.send_input(bytes(stdin))
                    await sock.close_input()
                except DsecError:
                    pass  # the call already ended (and closed): its final frame says how
            elif stdin is not None:
                pump = asyncio.create_task(_pump_input(sock, stdin, failures))
            async for event in sock:
                yield event
        finally:
            if pump is not None and not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
            await sock.close()
        if failures:
            raise failures[0]

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
        await self._http.aclose()


def _next_chunk(it: Iterator[bytes]) -> bytes | None:
    chunk = next(it, None)
    return None if chunk is None else bytes(chunk)


async def _chunks(stdin: AsyncStdin) -> AsyncIterator[bytes]:
    if isinstance(stdin, bytes | bytearray | memoryview):
        yield bytes(stdin)
    elif isinstance(stdin, AsyncIterable):
        async for chunk in stdin:
            yield bytes(chunk)
    else:
        it: Iterator[bytes] = iter(stdin)
        while (piece := await asyncio.to_thread(_next_chunk, it)) is not None:
            yield piece


async def _pump_input(
    sock: AsyncRuntimeSocket, stdin: AsyncStdin, failures: list[BaseException]
) -> None:
    """Send ``stdin`` then end it, concurrently with reading the output."""
    try:
        async for chunk in _chunks(stdin):
            await sock.send_input(chunk)
        await sock.close_input()
    except DsecError:
        pass  # the call ended (or the socket closed) while input was still being sent
    except Exception as exc:
        failures.append(exc)
        with contextlib.suppress(DsecError):
            await sock.close_input()
