"""The asyncio SDK's keep-alive pool for JSON calls (dsec.sdk.ahttp1) against a real HTTP
server (the same one as the blocking pool's tests), and against aiohttp's server."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
from aiohttp import web

from dsec.core.errors import DeadlineExceeded, InvalidArgument, Unavailable
from dsec.sdk.ahttp1 import AsyncHttp1Pool
from dsec.sdk.wire import Request
from tests.unit.test_sdk_http1 import _Server
from tests.unit.test_sdk_http1 import server as _server_fixture

server = _server_fixture


def _pool(srv: _Server) -> AsyncHttp1Pool:
    url = f"http://127.0.0.1:{srv.server_address[1]}/api"
    return AsyncHttp1Pool(url, {"Authorization": "Bearer k"}, False)


@pytest.mark.asyncio
async def test_calls_reuse_one_connection_and_carry_the_headers(server: _Server) -> None:
    pool = _pool(server)
    for i in range(5):
        status, body = await pool.request(Request("POST", "/x", timeout=5), str(i).encode())
        assert status == 200
        assert body == b'{"got":"' + str(i).encode() + b'","auth":"Bearer k"}'
    assert server.connections == 1
    pool.close()


@pytest.mark.asyncio
async def test_concurrent_calls_each_get_their_own_answer(server: _Server) -> None:
    pool = _pool(server)
    got = await asyncio.gather(
        *(pool.request(Request("POST", "/x", timeout=5), str(i).encode()) for i in range(8))
    )
    assert [b for _, b in got] == [b'{"got":"%d","auth":"Bearer k"}' % i for i in range(8)]
    assert server.connections == 8
    assert len(pool._idle) == 8
    pool.close()


@pytest.mark.asyncio
async def test_a_connection_the_server_closed_while_idle_is_replaced(server: _Server) -> None:
    pool = _pool(server)
    assert (await pool.request(Request("POST", "/x", timeout=5), b"a"))[0] == 200
    for conn in list(pool._idle):
        assert conn.transport is not None
        conn.transport.get_extra_info("socket").shutdown(socket.SHUT_RD)  # EOF, as a close
    await asyncio.sleep(0.05)  # the loop sees the EOF
    assert (await pool.request(Request("POST", "/x", timeout=5), b"b"))[0] == 200
    assert server.connections == 2
    assert server.posts == 2
    pool.close()


@pytest.mark.asyncio
async def test_a_post_the_server_dropped_is_not_sent_twice(server: _Server) -> None:
    pool = _pool(server)
    assert (await pool.request(Request("POST", "/x", timeout=5), b"a"))[0] == 200
    server.mode = "drop"
    with pytest.raises(Unavailable):
        await pool.request(Request("POST", "/x", timeout=5), b"b")
    assert server.posts == 2  # ran once: not retried on a new connection
    server.mode = "ok"
    assert (await pool.request(Request("POST", "/x", timeout=5), b"c"))[0] == 200
    pool.close()


@pytest.mark.asyncio
async def test_no_answer_in_time_is_deadline_exceeded(server: _Server) -> None:
    server.mode = "slow"
    pool = _pool(server)
    with pytest.raises(DeadlineExceeded):
        await pool.request(Request("POST", "/x", timeout=0.2), b"a")
    assert not pool._idle  # a connection with an answer still to come is not reused
    pool.close()


@pytest.mark.asyncio
async def test_nothing_listening_is_unavailable() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    pool = AsyncHttp1Pool(f"http://127.0.0.1:{port}", {}, False)
    with pytest.raises(Unavailable):
        await pool.request(Request("GET", "/x", timeout=1), None)


@pytest.mark.asyncio
async def test_header_or_path_injection_is_refused(server: _Server) -> None:
    pool = _pool(server)
    with pytest.raises(InvalidArgument):
        await pool.request(Request("GET", "/x y", timeout=1), None)
    with pytest.raises(InvalidArgument):
        await pool.request(Request("GET", "/x", headers=(("X-A", "1\r\nX-B: 2"),)), None)
    assert server.connections == 0
    with pytest.raises(InvalidArgument):
        AsyncHttp1Pool("http://127.0.0.1:1", {"Authorization": "Bearer k\r\nX: y"}, False)


@pytest.fixture
def chunky() -> Iterator[tuple[str, list[str]]]:
    """An aiohttp server answering by length, chunked, with no body, and closing."""
    seen: list[str] = []

    async def by_length(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Content-Length", ""))
        return web.Response(body=b"n=%d" % len(await request.read()), status=201)

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for part in (b'{"a":', b"1", b"}"):
            await resp.write(part)
        await resp.write_eof()
        return resp

    async def empty(request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def closing(request: web.Request) -> web.Response:
        return web.Response(body=b"bye", headers={"Connection": "close"})

    app = web.Application()
    app.router.add_post("/len", by_length)
    app.router.add_get("/chunked", chunked)
    app.router.add_delete("/empty", empty)
    app.router.add_get("/closing", closing)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    import threading

    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{port}", seen
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)
    loop.close()


@pytest.mark.asyncio
async def test_answers_by_length_chunked_empty_and_until_close(
    chunky: tuple[str, list[str]],
) -> None:
    url, seen = chunky
    pool = AsyncHttp1Pool(url, {}, False)
    assert await pool.request(Request("POST", "/len", body=b"xyz"), b"xyz") == (201, b"n=3")
    assert await pool.request(Request("POST", "/len"), None) == (201, b"n=0")
    assert seen == ["3", "0"]
    assert await pool.request(Request("GET", "/chunked"), None) == (200, b'{"a":1}')
    assert await pool.request(Request("DELETE", "/empty"), None) == (204, b"")
    assert len(pool._idle) == 1  # all of these on one kept connection
    assert await pool.request(Request("GET", "/closing"), None) == (200, b"bye")
    assert not pool._idle
    pool.close()
