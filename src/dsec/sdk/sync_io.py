"""The blocking I/O shell of the SDK: keep-alive HTTP (``http1`` for JSON calls, an
``httpx.Client`` for the rest) plus runtime WebSockets.

It only sends what ``wire``/``runtime_calls``/``streams`` build and translates foreign
exceptions (httpx, websockets, OS errors) into ``dsec.core.errors`` exactly once, here.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import httpx
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect

from dsec.agent.protocol import CHUNK, MAX_FRAME
from dsec.core.errors import DeadlineExceeded, DsecError, Internal
from dsec.sdk.config import ClientConfig, tls_verify
from dsec.sdk.http1 import Http1Pool, usable
from dsec.sdk.models import ExecEvent, HttpResponse
from dsec.sdk.runtime_calls import port_response
from dsec.sdk.streams import CLOSE_MESSAGE, RuntimeStream, input_messages, runtime_url
from dsec.sdk.wire import (
    CONNECT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    USER_AGENT,
    Call,
    Request,
    auth_headers,
    connection_error,
    error_for_status,
    finish,
)

T = TypeVar("T")
Content = bytes | Iterable[bytes]
WS_OPEN_TIMEOUT_S = 30.0
URL_CACHE_SIZE = 4096


def _timeout(seconds: float | None) -> httpx.Timeout:
    return httpx.Timeout(seconds, connect=CONNECT_TIMEOUT_S, pool=None)


def translate_httpx(url: str, exc: httpx.HTTPError, timeout: float | None) -> DsecError:
    """The dsec error for an httpx failure (timeouts are :class:`DeadlineExceeded`)."""
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return DeadlineExceeded(f"no answer from the apiserver at {url} within {timeout} s")
    return connection_error(url, exc)


def translate_ws(url: str, exc: BaseException) -> DsecError:
    """The dsec error for a failed WebSocket handshake."""
    if isinstance(exc, InvalidStatus):
        err, _ = error_for_status(exc.response.status_code, bytes(exc.response.body or b""))
        return err
    return connection_error(url, exc)


class SyncRuntimeSocket:
    """One runtime call over a WebSocket; iterate it for events until the final one."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._send_lock = threading.Lock()
        self.stream = RuntimeStream()

    def send(self, message: bytes) -> None:
        try:
            with self._send_lock:
                self._ws.send(message)
        except ConnectionClosed as exc:
            raise self.stream.closed_early(str(exc)) from None

    def send_input(self, data: bytes) -> None:
        for message in input_messages(data):
            self.send(message)

    def close_input(self) -> None:
        self.send(CLOSE_MESSAGE)

    def next_event(self) -> ExecEvent | None:
        """Block for the next output or final event; ``None`` once the call has finished."""
        while not self.stream.done:
            try:
                message = self._ws.recv()
            except ConnectionClosed as exc:
                raise self.stream.closed_early(str(exc)) from None
            event = self.stream.feed(message)
            if event is not None:
                return event
        return None

    def __iter__(self) -> Iterator[ExecEvent]:
        while (event := self.next_event()) is not None:
            yield event

    def wait_event(self, name: str) -> None:
        """Block until the server's ``name`` event (a final error frame raises it)."""
        while not self.stream.done:
            try:
                message = self._ws.recv()
            except ConnectionClosed as exc:
                raise self.stream.closed_early(str(exc)) from None
            if self.stream.feed(message) is not None:
                raise Internal(f"the runtime stream sent output before the {name!r} event")
            if self.stream.events and self.stream.events[-1].get("event") == name:
                return
        raise Internal(f"the runtime call ended without the {name!r} event")

    def close(self) -> None:
        self._ws.close()


class SyncTransport:
    """Sends calls over one pooled keep-alive HTTP client; opens runtime WebSockets."""

    def __init__(
        self, config: ClientConfig, *, http_transport: httpx.BaseTransport | None = None
    ) -> None:
        self.config = config
        self._headers = auth_headers(config.api_key)
        self._http = httpx.Client(
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
            Http1Pool(config.api_url, self._headers, tls_verify(config.api_url))
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

    def send(self, req: Request, content: Content | None = None) -> httpx.Response:
        """Send ``req`` (with ``content`` instead of its body if given) and read the answer."""
        try:
            return self._http.request(
                req.method,
                self._url(req.path),
                params=req.params or None,
                content=req.body if content is None else content,
                headers=req.headers or None,
                timeout=self._req_timeout(req.timeout),
            )
        except httpx.HTTPError as exc:
            raise translate_httpx(self.config.api_url, exc, req.timeout) from None

    def _unary(self, req: Request, content: Content | None) -> tuple[int, bytes]:
        """(status, body) of a request whose body is in memory: through the pool if any."""
        if self._pool is not None and (content is None or isinstance(content, bytes)):
            return self._pool.request(req, req.body if content is None else content)
        resp = self.send(req, content)
        return resp.status_code, resp.content

    def call(self, call: Call[T], content: Content | None = None) -> T:
        return finish(call, *self._unary(call.request, content))

    def fetch(self, req: Request) -> bytes:
        """Send ``req`` and return the raw body of a successful answer."""
        status, body = self._unary(req, None)
        if status >= 300:
            raise error_for_status(status, body)[0]
        return body

    def port(self, req: Request) -> HttpResponse:
        resp = self.send(req)
        return port_response(resp.status_code, resp.headers.multi_items(), resp.content)

    @contextmanager
    def download(
        self, req: Request, chunk_size: int = CHUNK, content: Content | None = None
    ) -> Iterator[Iterator[bytes]]:
        """Open a streamed download; the yielded iterator gives the body in chunks.

        ``content`` (an iterable of chunks) is sent as the body instead of ``req.body``.
        """
        try:
            with self._http.stream(
                req.method,
                self._url(req.path),
                params=req.params or None,
                content=req.body if content is None else content,
                headers=dict(req.headers),
                timeout=self._req_timeout(req.timeout),
            ) as resp:
                if resp.status_code >= 300:
                    raise error_for_status(resp.status_code, resp.read())[0]
                yield resp.iter_bytes(chunk_size)
        except httpx.HTTPError as exc:
            raise translate_httpx(self.config.api_url, exc, req.timeout) from None

    def open_runtime(self, sandbox_id: str, first: bytes) -> SyncRuntimeSocket:
        """Open the sandbox's runtime WebSocket and send the call's request message."""
        url = runtime_url(self.config.api_url, sandbox_id)
        try:
            # Entered as a context manager: websockets >= 17.1 warns about bare connections.
            ws = ws_connect(
                url,
                additional_headers={"Authorization": self._headers["Authorization"]},
                user_agent_header=USER_AGENT,
                compression=None,
                open_timeout=WS_OPEN_TIMEOUT_S,
                close_timeout=2,
                max_size=MAX_FRAME + 16,
            ).__enter__()
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise translate_ws(url, exc) from None
        sock = SyncRuntimeSocket(ws)
        try:
            sock.send(first)
        except BaseException:
            sock.close()
            raise
        return sock

    def events(
        self, sandbox_id: str, first: bytes, stdin: Content | None = None
    ) -> Generator[ExecEvent, None, None]:
        """Run one streamed call: send ``stdin`` (if any, then end it) and yield events."""
        sock = self.open_runtime(sandbox_id, first)
        failures: list[BaseException] = []
        try:
            if isinstance(stdin, bytes | bytearray | memoryview) and len(stdin) <= CHUNK:
                try:
                    sock.send_input(bytes(stdin))
                    sock.close_input()
                except DsecError:
                    pass  # the call already ended (and closed): its final frame says how
            elif stdin is not None:
                threading.Thread(
                    target=_pump_input, args=(sock, stdin, failures), daemon=True
                ).start()
            yield from sock
        finally:
            sock.close()
        if failures:
            raise failures[0]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        self._http.close()


def _pump_input(sock: SyncRuntimeSocket, stdin: Content, failures: list[BaseException]) -> None:
    """Send ``stdin`` then end it; runs in a thread so output is read meanwhile."""
    chunks: Iterable[bytes] = [bytes(stdin)] if isinstance(stdin, bytes | bytearray) else stdin
    try:
        for chunk in chunks:
            sock.send_input(bytes(chunk))
        sock.close_input()
    except DsecError:
        pass  # the call ended (or the socket closed) while input was still being sent
    except Exception as exc:
        failures.append(exc)
        try:
            sock.close_input()
        except DsecError:
            pass
