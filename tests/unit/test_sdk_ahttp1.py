"""What only the asyncio SDK's keep-alive pool for JSON calls (dsec.sdk.ahttp1) does:
concurrent calls, and answers from aiohttp's server (by length, chunked, empty, until
close). What both pools do is tested on both in tests/unit/test_sdk_http1.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from dsec.core.errors import InvalidArgument
from dsec.sdk.ahttp1 import AsyncHttp1Pool
from dsec.sdk.wire import Request
from tests.unit.poolkit import AUTH, pool_server


@pytest.mark.asyncio
async def test_concurrent_calls_each_get_their_own_answer() -> None:
    with pool_server() as server:
        pool = AsyncHttp1Pool(server.url, AUTH, False)
        got = await asyncio.gather(
            *(pool.request(Request("POST", "/x", timeout=5), str(i).encode()) for i in range(8))
        )
        assert [b for _, b in got] == [b'{"got":"%d","auth":"Bearer k"}' % i for i in range(8)]
        assert server.connections == 8
        assert len(pool._idle) == 8
        pool.close()


@pytest.mark.asyncio
async def test_header_or_path_injection_is_refused() -> None:
    with pool_server() as server:
        pool = AsyncHttp1Pool(server.url, AUTH, False)
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
