"""The SDK's keep-alive pools for JSON calls against a real HTTP server: each test on both
the blocking pool (dsec.sdk.http1) and the asyncio one (dsec.sdk.ahttp1, see poolkit)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsec.core.errors import DeadlineExceeded, Unavailable
from dsec.sdk.http1 import usable
from dsec.sdk.wire import Request
from tests.unit.poolkit import AUTH, POOLS, Pool, PoolServer, closed_port, pool_server


@pytest.fixture
def server() -> Iterator[PoolServer]:
    with pool_server() as srv:
        yield srv


@pytest.fixture(params=sorted(POOLS))
def kind(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def pool(server: PoolServer, kind: str) -> Iterator[Pool]:
    p = POOLS[kind](server.url, AUTH)
    yield p
    p.close()


def test_calls_reuse_one_connection_and_carry_the_headers(pool: Pool, server: PoolServer) -> None:
    for i in range(5):
        status, body = pool.request(Request("POST", "/x", timeout=5), str(i).encode())
        assert status == 200
        assert body == b'{"got":"' + str(i).encode() + b'","auth":"Bearer k"}'
    assert server.connections == 1


def test_a_connection_the_server_closed_while_idle_is_replaced(
    pool: Pool, server: PoolServer
) -> None:
    assert pool.request(Request("POST", "/x", timeout=5), b"a")[0] == 200
    pool.server_closed_idle()
    assert pool.request(Request("POST", "/x", timeout=5), b"b")[0] == 200
    assert server.connections == 2
    assert server.posts == 2


def test_a_post_the_server_dropped_is_not_sent_twice(pool: Pool, server: PoolServer) -> None:
    assert pool.request(Request("POST", "/x", timeout=5), b"a")[0] == 200
    server.mode = "drop"
    with pytest.raises(Unavailable):
        pool.request(Request("POST", "/x", timeout=5), b"b")
    assert server.posts == 2  # ran once: not retried on a new connection
    server.mode = "ok"
    assert pool.request(Request("POST", "/x", timeout=5), b"c")[0] == 200


def test_no_answer_in_time_is_deadline_exceeded(pool: Pool, server: PoolServer) -> None:
    server.mode = "slow"
    with pytest.raises(DeadlineExceeded):
        pool.request(Request("POST", "/x", timeout=0.2), b"a")
    assert pool.idle() == 0  # a connection with an answer still to come is not reused


def test_nothing_listening_is_unavailable(kind: str) -> None:
    pool = POOLS[kind](f"http://127.0.0.1:{closed_port()}", {})
    try:
        with pytest.raises(Unavailable):
            pool.request(Request("GET", "/x", timeout=1), None)
    finally:
        pool.close()


def test_proxied_or_odd_urls_stay_with_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                "ALL_PROXY", "no_proxy", "NO_PROXY"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    assert usable("http://127.0.0.1:8420")
    assert not usable("unix:///run/dsec.sock")
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    assert not usable("http://api.example.invalid:8420")
    monkeypatch.setenv("no_proxy", "api.example.invalid")
    assert usable("http://api.example.invalid:8420")
