"""The apiserver's upgrade (WebSocket) passthrough gives up on a sandbox port that does not
connect or a server that does not answer the upgrade, and says which, instead of holding
the client's connection open (``dsec.apiserver.upgrade``, ``dsec.apiserver.ports``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from dsec.apiserver import ports, relay, upgrade
from dsec.core.errors import DsecError
from tests.unit.servekit import serving

UPGRADE = {"Connection": "Upgrade", "Upgrade": "websocket"}
StreamPair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class SilentPipe:
    """A connection to a server that accepted it and never answers."""

    def __init__(self) -> None:
        self.sent = b""
        self.closed = False

    async def send(self, data: bytes) -> None:
        self.sent += data

    async def close_write(self) -> None:
        pass

    async def recv(self) -> bytes:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self.closed = True


async def _answer(aw: Any) -> web.StreamResponse:
    try:
        resp: web.StreamResponse = await aw
        return resp
    except DsecError as exc:  # as the apiserver's error middleware answers it
        return web.json_response({"code": exc.code, "message": exc.message},
                                 status=exc.http_status)  # fmt: skip


async def _get(handler: Any) -> tuple[int, dict[str, Any], float]:
    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        started = time.monotonic()
        resp = await client.get("/", headers=UPGRADE)
        return resp.status, await resp.json(), time.monotonic() - started


@pytest.mark.asyncio
async def test_a_server_that_never_answers_the_upgrade_gets_a_504() -> None:
    pipe = SilentPipe()

    async def handler(request: web.Request) -> web.StreamResponse:
        head = upgrade.request_head(request, "/feed", "localhost:7190")
        return await _answer(upgrade.splice(request, pipe, head, answer_timeout_s=0.3))

    status, body, took = await _get(handler)
    assert status == 504
    assert body == {
        "code": "deadline_exceeded",
        "message": "the server did not answer the upgrade request within 0.3 s",
    }
    assert took < 5
    assert pipe.sent.startswith(b"GET /feed HTTP/1.1\r\nHost: localhost:7190\r\n")
    assert pipe.closed  # and the connection to it is dropped


class SilentStream:
    """An edge stream whose tcp call never says ``connected``."""

    cancelled = False

    async def read(self) -> tuple[int, bytes] | None:
        await asyncio.Event().wait()
        return None

    def cancel(self) -> None:
        SilentStream.cancelled = True


@pytest.mark.asyncio
async def test_a_port_that_never_connects_gets_a_504(monkeypatch: pytest.MonkeyPatch) -> None:
    async def open_stream(*args: Any) -> SilentStream:
        return SilentStream()

    monkeypatch.setattr(relay.EdgeStream, "open", open_stream)
    monkeypatch.setattr(ports, "ctx", lambda request: None)
    monkeypatch.setattr(ports, "principal", lambda request: None)

    async def handler(request: web.Request) -> web.StreamResponse:
        sid = "sbx-ab12-abcdefghijklmnopqrst"
        return await _answer(ports.EdgeTcpPipe.open(request, sid, 7190, timeout_s=0.3))

    status, body, took = await _get(handler)
    assert status == 504
    assert body["message"] == (
        "port 7190 of sandbox sbx-ab12-abcdefghijklmnopqrst did not connect within 0.3 s"
    )
    assert took < 5
    assert SilentStream.cancelled  # the tcp call is given up too


class SwitchingPipe(SilentPipe):
    """A server that accepts the WebSocket upgrade and then says nothing, never closing."""

    def __init__(self) -> None:
        super().__init__()
        self.answered = False
        self.write_closed = False

    async def recv(self) -> bytes:
        if not self.answered:
            self.answered = True
            return b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n"
        return await super().recv()

    async def close_write(self) -> None:
        self.write_closed = True


class ClosingPipe(SilentPipe):
    """A server that accepts the upgrade, sends a last frame and closes."""

    def __init__(self) -> None:
        super().__init__()
        self.answers = [b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n", b"bye"]

    async def recv(self) -> bytes:
        return self.answers.pop(0) if self.answers else b""


@asynccontextmanager
async def _upgraded(pipe: upgrade.Pipe, ended: asyncio.Event) -> AsyncIterator[StreamPair]:
    """A raw client connection, upgraded, to an apiserver-like server splicing onto ``pipe``
    (run as the apiserver runs it: a client going away does not cancel the handler)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await upgrade.splice(request, pipe, b"GET / HTTP/1.1\r\n\r\n")
        finally:
            ended.set()

    app = web.Application()
    app.router.add_get("/", handler)
    async with serving(web.AppRunner(app)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     b"Sec-WebSocket-Version: 13\r\n\r\n")  # fmt: skip
        assert (await reader.readline()).startswith(b"HTTP/1.1 101")
        await reader.readuntil(b"\r\n\r\n")
        yield reader, writer
        writer.close()


@pytest.mark.asyncio
async def test_a_server_closing_closes_its_websocket_client_at_once() -> None:
    """A WebSocket client waits for the server's close before it closes its own side."""
    ended = asyncio.Event()
    async with _upgraded(ClosingPipe(), ended) as (reader, _):
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 10) == b"bye"  # then EOF
        assert time.monotonic() - started < upgrade.CLOSE_GRACE_S / 2
        await asyncio.wait_for(ended.wait(), 5)


@pytest.mark.asyncio
async def test_a_websocket_client_gone_drops_a_server_that_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(upgrade, "CLOSE_GRACE_S", 0.3)
    pipe = SwitchingPipe()
    ended = asyncio.Event()
    async with _upgraded(pipe, ended) as (_, writer):
        writer.close()  # the client goes away; the server never closes
        await asyncio.wait_for(ended.wait(), 5)
    assert pipe.write_closed  # the server was told
    assert pipe.closed  # and then dropped
