"""HTTP Upgrade (WebSocket) passthrough: the client's connection is spliced onto a byte pipe.

The proxy does not terminate the WebSocket: it writes the client's upgrade request to the
pipe (a raw TCP stream to the server), reads the server's answer, and on ``101 Switching
Protocols`` copies bytes both ways until either side closes. Subprotocols, extensions,
frames, pings and close codes are therefore exactly what client and server agreed on.
Any other answer is returned as an ordinary HTTP response. Used by the apiserver's port
proxy (pipe = the ``tcp`` runtime op) and the E2B gateway (pipe = a connection to the
apiserver).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Protocol

from aiohttp import web

from dsec.core.errors import DeadlineExceeded, Unavailable

MAX_HEAD = 64 * 1024
MAX_REFUSAL_BODY = 1024 * 1024
REFUSAL_READ_S = 5.0
# How long the server may take to answer the upgrade request. Without a bound, a server
# that accepted the connection but never answers would hold the client's connection open
# (and a client whose own handshake timeout fired cannot always close it until we do).
ANSWER_TIMEOUT_S = 30.0
CLIENT_QUEUE_HIGH = 64  # chunks queued from the client before it is paused
CLOSE_GRACE_S = 5.0
HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"})
# aiohttp switches the connection to raw bytes only for these upgrades.
SUPPORTED = frozenset({"websocket", "tcp"})


class Pipe(Protocol):
    """A bidirectional byte stream to the server."""

    async def send(self, data: bytes) -> None: ...

    async def close_write(self) -> None: ...

    async def recv(self) -> bytes:
        """The next bytes; ``b""`` once the server closed its side."""
        ...

    async def aclose(self) -> None: ...


def is_upgrade(request: web.Request) -> bool:
    conn = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    return "upgrade" in conn and request.headers.get("Upgrade", "").lower() in SUPPORTED


def request_head(
    request: web.Request,
    target: str,
    host: str,
    drop: Iterable[str] = (),
    *,
    extra: Iterable[tuple[str, str]] = (),
) -> bytes:
    """The upgrade request as sent on: ``target`` path, ``host``, minus ``drop``, plus ``extra``."""
    skip = {"host", "content-length", "transfer-encoding", *(d.lower() for d in drop)}
    lines = [f"{request.method} {target} HTTP/1.1", f"Host: {host}"]
    for k, v in request.headers.items():
        if k.lower() not in skip:
            lines.append(f"{k}: {v}")
    lines.extend(f"{k}: {v}" for k, v in extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse_head(head: bytes) -> tuple[int, str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise Unavailable(f"the server answered the upgrade with {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        k, sep, v = line.partition(":")
        if sep:
            headers.append((k.strip(), v.strip()))
    return int(parts[1]), parts[2] if len(parts) > 2 else "", headers


async def _read_head(pipe: Pipe, timeout_s: float) -> tuple[bytes, bytes]:
    try:
        async with asyncio.timeout(timeout_s):
            return await _head(pipe)
    except TimeoutError:
        raise DeadlineExceeded(
            f"the server did not answer the upgrade request within {timeout_s:g} s"
        ) from None


async def _head(pipe: Pipe) -> tuple[bytes, bytes]:
    buf = b""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        if len(buf) > MAX_HEAD:
            raise Unavailable("the server's answer to the upgrade has a head over 64 KiB")
        chunk = await pipe.recv()
        if not chunk:
            raise Unavailable("the server closed the connection instead of answering")
        buf += chunk
    return buf[:end], buf[end + 4 :]


async def _refusal(
    pipe: Pipe, status: int, reason: str, headers: list[tuple[str, str]], rest: bytes
) -> web.Response:
    """The server declined the upgrade: hand its (small) answer back as is."""
    length = next((v for k, v in headers if k.lower() == "content-length"), None)
    want = int(length) if length and length.isdigit() else MAX_REFUSAL_BODY
    body = rest
    with contextlib.suppress(TimeoutError):  # no length and the server keeps the connection
        async with asyncio.timeout(REFUSAL_READ_S):
            while len(body) < min(want, MAX_REFUSAL_BODY) and (chunk := await pipe.recv()):
                body += chunk
    resp = web.Response(status=status, reason=reason or None, body=body[:want])
    for k, v in headers:
        if k.lower() not in HOP and k.lower() not in ("content-length", "transfer-encoding"):
            resp.headers.add(k, v)
    return resp


class _ClientFeed:
    """Receives the client's bytes after the upgrade (in place of aiohttp's HTTP parser)."""

    def __init__(self, request: web.Request) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._transport = request.transport
        self.paused = False

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.queue.put_nowait(bytes(data))
        if self.queue.qsize() >= CLIENT_QUEUE_HIGH and self._transport and not self.paused:
            self._transport.pause_reading()
            self.paused = True
        return False, b""

    def feed_eof(self) -> None:
        self.queue.put_nowait(None)

    def drained(self) -> None:
        if self.paused and self.queue.qsize() < CLIENT_QUEUE_HIGH // 2 and self._transport:
            self._transport.resume_reading()
            self.paused = False


async def _client_to_server(feed: _ClientFeed, pipe: Pipe) -> None:
    while (data := await feed.queue.get()) is not None:
        await pipe.send(data)
        feed.drained()
    await pipe.close_write()


async def _server_to_client(pipe: Pipe, resp: web.StreamResponse) -> None:
    while chunk := await pipe.recv():
        await resp.write(chunk)


async def splice(
    request: web.Request, pipe: Pipe, head: bytes, *, answer_timeout_s: float = ANSWER_TIMEOUT_S
) -> web.StreamResponse:
    """Forward the upgrade request ``head`` and then the connection; the pipe is closed after.

    Raises:
        DeadlineExceeded: the server sent no answer within ``answer_timeout_s``.
        Unavailable: it closed the connection instead, or answered something not HTTP.
    """
    try:
        await pipe.send(head)
        resp_head, rest = await _read_head(pipe, answer_timeout_s)
        status, reason, headers = _parse_head(resp_head)
        if status != 101:
            return await _refusal(pipe, status, reason, headers, rest)
        resp = web.StreamResponse(status=101, reason=reason or "Switching Protocols")
        for k, v in headers:
            resp.headers.add(k, v)
        resp.force_close()  # after the splice the connection is done, never reused
        feed = _ClientFeed(request)
        request.protocol.set_parser(feed)  # type: ignore[arg-type]  # duck-typed reader
        await resp.prepare(request)
        if rest:
            await resp.write(rest)
        up = asyncio.create_task(_client_to_server(feed, pipe))
        down = asyncio.create_task(_server_to_client(pipe, resp))
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            # The server closing its side ends the connection (the pipe's call is over:
            # nothing the client sends reaches it now), and a WebSocket client waits for
            # that close before it closes its own: it is dropped at once, after what was
            # written to it. The client leaving first: the server may still answer a
            # half-close, as a raw "tcp" upgrade may; WebSocket clients do not half-close,
            # so there the server gets CLOSE_GRACE_S to close. Then both are dropped.
            if not down.done():
                if request.headers.get("Upgrade", "").lower() == "websocket":
                    await asyncio.wait({down}, timeout=CLOSE_GRACE_S)
                else:
                    await asyncio.wait({down})
        finally:
            for task in (up, down):
                task.cancel()
                with contextlib.suppress(BaseException):  # its end is the connection's
                    await task
            if request.transport is not None:
                request.transport.close()
        return resp
    finally:
        await pipe.aclose()
