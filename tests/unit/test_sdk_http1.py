"""The SDK's keep-alive pool for JSON calls (dsec.sdk.http1) against a real HTTP server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsec.core.errors import DeadlineExceeded, Unavailable
from dsec.sdk.http1 import Http1Pool, usable
from dsec.sdk.wire import Request


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.posts = 0
        self.mode = "ok"  # ok | drop (close without answering) | slow


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

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


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _pool(srv: _Server) -> Http1Pool:
    url = f"http://127.0.0.1:{srv.server_address[1]}/api"
    return Http1Pool(url, {"Authorization": "Bearer k"}, False)


def test_calls_reuse_one_connection_and_carry_the_headers(server: _Server) -> None:
    pool = _pool(server)
    for i in range(5):
        status, body = pool.request(Request("POST", "/x", timeout=5), str(i).encode())
        assert status == 200
        assert body == b'{"got":"' + str(i).encode() + b'","auth":"Bearer k"}'
    assert server.connections == 1
    pool.close()


def test_a_connection_the_server_closed_while_idle_is_replaced(server: _Server) -> None:
    pool = _pool(server)
    assert pool.request(Request("POST", "/x", timeout=5), b"a")[0] == 200
    for conn in list(pool._idle):
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_RD)  # seen readable (EOF), as after a server close
    assert pool.request(Request("POST", "/x", timeout=5), b"b")[0] == 200
    assert server.connections == 2
    assert server.posts == 2
    pool.close()


def test_a_post_the_server_dropped_is_not_sent_twice(server: _Server) -> None:
    pool = _pool(server)
    assert pool.request(Request("POST", "/x", timeout=5), b"a")[0] == 200
    server.mode = "drop"
    with pytest.raises(Unavailable):
        pool.request(Request("POST", "/x", timeout=5), b"b")
    assert server.posts == 2  # ran once: not retried on a new connection
    server.mode = "ok"
    assert pool.request(Request("POST", "/x", timeout=5), b"c")[0] == 200
    pool.close()


def test_no_answer_in_time_is_deadline_exceeded(server: _Server) -> None:
    server.mode = "slow"
    pool = _pool(server)
    with pytest.raises(DeadlineExceeded):
        pool.request(Request("POST", "/x", timeout=0.2), b"a")
    pool.close()


def test_nothing_listening_is_unavailable() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    pool = Http1Pool(f"http://127.0.0.1:{port}", {}, False)
    with pytest.raises(Unavailable):
        pool.request(Request("GET", "/x", timeout=1), None)


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
