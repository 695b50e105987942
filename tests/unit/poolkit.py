"""The SDK's two keep-alive pools for JSON calls, ``dsec.sdk.http1`` (blocking) and
``dsec.sdk.ahttp1`` (asyncio), behind one blocking interface, and the real HTTP server their
tests run against (tests/unit/test_sdk_http1.py, tests/unit/test_sdk_ahttp1.py)."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dsec.sdk.ahttp1 import AsyncHttp1Pool
from dsec.sdk.http1 import Http1Pool
from dsec.sdk.wire import Request

AUTH = {"Authorization": "Bearer k"}


class PoolServer(ThreadingHTTPServer):
    """Answers a POST with ``{"got":"<body>","auth":"<Authorization>"}``; counts connections
    and posts. ``mode``: ``ok``, ``drop`` (close without answering) or ``slow`` (1 s)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.posts = 0
        self.mode = "ok"

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a caller that gave up waiting
            super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/api"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: PoolServer

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.server.posts += 1
        if self.server.mode == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if self.server.mode == "slow":
            time.sleep(1.0)
        out = b'{"got":"' + body + b'","auth":"' + self.headers["Authorization"].encode() + b'"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@contextmanager
def pool_server() -> Iterator[PoolServer]:
    srv = PoolServer()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def closed_port() -> int:
    """A local port nothing listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


class BlockingPool:
    """``Http1Pool`` itself."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.pool = Http1Pool(url, headers, False)

    def request(self, req: Request, body: bytes | None) -> tuple[int, bytes]:
        return self.pool.request(req, body)

    def idle(self) -> int:
        return len(self.pool._idle)

    def server_closed_idle(self) -> None:
        """Make the idle connections look closed by the server (EOF to read)."""
        for conn in list(self.pool._idle):
            assert conn.sock is not None
            conn.sock.shutdown(socket.SHUT_RD)

    def close(self) -> None:
        self.pool.close()


class AsyncPool:
    """``AsyncHttp1Pool``, each call run to its end on one event loop kept for the pool."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self._runner = asyncio.Runner()
        self.pool = AsyncHttp1Pool(url, headers, False)

    def request(self, req: Request, body: bytes | None) -> tuple[int, bytes]:
        return self._runner.run(self.pool.request(req, body))

    def idle(self) -> int:
        return len(self.pool._idle)

    def server_closed_idle(self) -> None:
        for conn in list(self.pool._idle):
            assert conn.transport is not None
            conn.transport.get_extra_info("socket").shutdown(socket.SHUT_RD)
        self._runner.run(asyncio.sleep(0.05))  # the loop sees the EOF

    def close(self) -> None:
        self.pool.close()
        self._runner.close()


Pool = BlockingPool | AsyncPool
POOLS: dict[str, type[BlockingPool] | type[AsyncPool]] = {
    "blocking": BlockingPool,
    "async": AsyncPool,
}
