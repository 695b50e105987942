"""Reaching servers inside a sandbox: raw TCP streams (sync, async) and ``dsec sandbox
port-forward``, against real servers started in the sandbox."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect
from websockets.typing import Subprotocol

from dsec.core.errors import InvalidArgument, Unavailable
from dsec.sdk import AsyncClient, Sandbox
from dsec.testing.platform import RunningPlatform

ECHO_PORT = 7100
HTTP_PORT = 7180
WS_PORT = 7190
WS_SERVER = Path(__file__).with_name("ws_server.py").read_text()
# Upper-cases each line back as it arrives, several connections at once; on EOF from the
# client it answers "bye <n bytes>" and closes.
ECHO_SERVER = f"""
import socket, threading
def serve(c):
    n = 0
    f = c.makefile("rb")
    for line in f:
        n += len(line)
        c.sendall(line.upper())
    c.sendall(b"bye %d" % n)
    c.close()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", {ECHO_PORT})); s.listen()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def _wait_port(sbx: Sandbox, port: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            sbx.connect_tcp(port).close()
            return
        except Unavailable:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.2)


def start_servers(sbx: Sandbox) -> Sandbox:
    """The echo server and a static HTTP server (``/root/www``) in ``sbx``."""
    sbx.files.write("/root/echo.py", ECHO_SERVER)
    sbx.files.write("/root/www/hello.txt", "hello from the sandbox\n")
    sbx.processes.start(["python3", "/root/echo.py"])
    sbx.processes.start(
        ["python3", "-m", "http.server", "--bind", "127.0.0.1", str(HTTP_PORT)], cwd="/root/www"
    )
    _wait_port(sbx, ECHO_PORT)
    _wait_port(sbx, HTTP_PORT)
    return sbx


def start_ws_server(sbx: Sandbox) -> Sandbox:
    sbx.files.write("/root/ws_server.py", WS_SERVER)
    sbx.processes.start(["python3", "/root/ws_server.py", str(WS_PORT)])
    _wait_port(sbx, WS_PORT)
    return sbx


@pytest.fixture
def servers(sbx: Sandbox) -> Sandbox:
    return start_servers(sbx)


def test_connect_tcp_streams_both_ways_and_half_closes(servers: Sandbox) -> None:
    with servers.connect_tcp(ECHO_PORT) as tcp:
        tcp.send(b"first line\n")
        assert tcp.recv() == b"FIRST LINE\n"  # an answer before we stop sending
        big = b"x" * 200_000 + b"\n"
        tcp.send(big)
        tcp.close_write()
        got = b"".join(tcp)
    assert got == big.upper() + b"bye %d" % (len(big) + 11)
    assert tcp.result == {"sent": len(big) + 11, "received": len(got) + 11}


def test_connect_tcp_to_a_closed_port_fails_at_once(sbx: Sandbox) -> None:
    with pytest.raises(Unavailable, match="cannot connect to port 7999"):
        sbx.connect_tcp(7999)
    with pytest.raises(InvalidArgument):
        sbx.connect_tcp(0)


def test_async_connect_tcp_runs_connections_concurrently(
    servers: Sandbox, platform: RunningPlatform
) -> None:
    async def one(client: AsyncClient, i: int) -> bytes:
        async with await client.sandbox(servers.id).connect_tcp(ECHO_PORT) as tcp:
            await tcp.send(f"conn {i}\n")
            await tcp.close_write()
            return b"".join([chunk async for chunk in tcp])

    async def main() -> list[bytes]:
        async with AsyncClient(api_url=platform.api_url, api_key=platform.admin_key) as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    got = asyncio.run(main())
    assert got == [f"CONN {i}\nbye {len(f'conn {i}') + 1}".encode() for i in range(8)]


@pytest.fixture
def forward(servers: Sandbox, platform: RunningPlatform) -> Iterator[tuple[str, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec.cli.main", "sandbox", "port-forward", servers.id, "0:7180"],
        env=platform.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.match(r"forwarding (127\.0\.0\.1):(\d+) -> ", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        yield m[1], int(m[2])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_port_forward_serves_many_connections(forward: tuple[str, int]) -> None:
    host, port = forward
    with httpx.Client(base_url=f"http://{host}:{port}") as http:
        for _ in range(3):  # one forwarded connection per keep-alive client...
            assert http.get("/hello.txt").text == "hello from the sandbox\n"
    for _ in range(3):  # ...and new connections each time
        r = httpx.get(f"http://{host}:{port}/hello.txt", headers={"Connection": "close"})
        assert r.status_code == 200
        assert r.text == "hello from the sandbox\n"
    assert httpx.get(f"http://{host}:{port}/missing").status_code == 404


def test_port_forward_rejects_bad_specs_and_unknown_sandboxes(
    platform: RunningPlatform, sbx: Sandbox
) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dsec.cli.main", "sandbox", "port-forward", *args],
            env=platform.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )

    bad = run(sbx.id, "80")
    assert bad.returncode == 2
    assert "LOCAL:REMOTE" in bad.stderr
    assert run(sbx.id, "0:70000").returncode == 2
    missing = run("sb-doesnotexist0000", "0:80")
    assert missing.returncode == 2
    assert "sandbox_not_found" in missing.stderr


def test_port_forward_closes_a_connection_when_nothing_listens(
    platform: RunningPlatform, sbx: Sandbox
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec.cli.main", "sandbox", "port-forward", sbx.id, "0:7998"],
        env=platform.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split()[1].rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            assert s.recv(10) == b""  # closed: the sandbox port did not answer
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.stderr is not None
    assert "cannot connect to port 7998" in proc.stderr.read()


@pytest.fixture
def ws_sandbox(sbx: Sandbox) -> Sandbox:
    return start_ws_server(sbx)


def _ws_url(platform: RunningPlatform, sbx: Sandbox, port: int, path: str) -> str:
    base = platform.api_url.replace("http://", "ws://")
    return f"{base}/v1/sandboxes/{sbx.id}/ports/{port}{path}"


def test_websocket_through_the_port_proxy(ws_sandbox: Sandbox, platform: RunningPlatform) -> None:
    auth = {"Authorization": f"Bearer {platform.admin_key}"}
    url = _ws_url(platform, ws_sandbox, WS_PORT, "/chat?room=1")
    with ws_connect(url, additional_headers=auth, subprotocols=[Subprotocol("chat.v2")]) as ws:
        assert ws.subprotocol == "chat.v2"  # negotiated by the sandbox's server
        # the path and query reach the server; our credentials do not
        assert ws.recv() == "hello /chat?room=1 auth=False"
        ws.send("hello")
        assert ws.recv() == "HELLO"
        blob = bytes(range(256)) * 1200  # 300 KiB in one frame, both ways
        ws.send(blob)
        assert ws.recv() == blob[::-1]
        ws.ping(b"p").wait(10)
        ws.close(code=4002, reason="client done")
    deadline = time.monotonic() + 10
    while not ws_sandbox.files.exists("/root/ws-closed"):
        assert time.monotonic() < deadline, "the server never saw the close"
        time.sleep(0.1)
    assert ws_sandbox.files.read_text("/root/ws-closed") == "4002"

    with ws_connect(url, additional_headers=auth) as ws:
        ws.recv()
        ws.send("bye")  # the server closes: its code and reason reach the client
        with pytest.raises(ConnectionClosed) as info:
            ws.recv()
    assert info.value.rcvd is not None
    assert info.value.rcvd.code == 4001
    assert info.value.rcvd.reason == "server says bye"


def test_websocket_upgrade_refusals(
    ws_sandbox: Sandbox, servers: Sandbox, platform: RunningPlatform
) -> None:
    auth = {"Authorization": f"Bearer {platform.admin_key}"}
    with pytest.raises(InvalidStatus) as refused:  # http.server does not upgrade
        ws_connect(_ws_url(platform, servers, HTTP_PORT, "/hello.txt"), additional_headers=auth)
    assert refused.value.response.status_code in (200, 400, 404, 501)
    with pytest.raises(InvalidStatus) as closed:  # nothing listens
        ws_connect(_ws_url(platform, servers, 7997, "/"), additional_headers=auth)
    assert closed.value.response.status_code == 503
    with pytest.raises(InvalidStatus) as anonymous:
        ws_connect(_ws_url(platform, servers, WS_PORT, "/"))
    assert anonymous.value.response.status_code == 401
