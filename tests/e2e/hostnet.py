"""Test-only name resolution and listeners for host-style routing (``*.dsec.test``).

Nothing on the machine changes: names under :data:`DOMAIN` resolve to 127.0.0.1 only in
this test process (a patched ``socket.getaddrinfo``), and clients that do their own DNS
(the E2B SDK's Rust HTTP stack) reach the same listener through :class:`ConnectProxy`, an
HTTP CONNECT proxy they are pointed at with ``HTTPS_PROXY``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dsec.testing.platform import RunningPlatform
from dsec.testing.ports import free_port_base

DOMAIN = "dsec.test"


@contextlib.contextmanager
def resolve_domain_locally(mp: pytest.MonkeyPatch) -> Iterator[None]:
    real = socket.getaddrinfo

    def fake(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and (host == DOMAIN or host.endswith("." + DOMAIN)):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    mp.setattr(socket, "getaddrinfo", fake)
    yield


@contextlib.contextmanager
def daemon(argv: list[str], health: str, env: dict[str, str]) -> Iterator[None]:
    """Run a platform daemon until the block ends (killed by its pid)."""
    log = open(os.devnull, "wb")  # noqa: SIM115 -- closed below
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                assert proc.stderr is not None
                raise RuntimeError(f"{argv[2]} exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(health, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{argv[2]} did not start"
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def domain_apiserver(platform: RunningPlatform) -> Iterator[tuple[str, int]]:
    """A second apiserver of the platform with ``--domain``; yields (plain URL, TLS port)."""
    base = free_port_base(2)
    lay = platform.layout
    argv = [
        sys.executable,
        "-m",
        "dsec.apiserver",
        "--home",
        str(platform.paths.home),
        "--listen",
        f"127.0.0.1:{base}",
        "--tls-listen",
        f"127.0.0.1:{base + 1}",
        "--domain",
        DOMAIN,
        "--iam",
        lay.iam,
        "--watcher",
        lay.watcher,
    ]
    url = f"http://127.0.0.1:{base}"
    with daemon(argv, f"{url}/healthz", platform.env()):
        yield url, base + 1


@contextlib.contextmanager
def domain_gateway(platform: RunningPlatform, api_url: str) -> Iterator[tuple[str, int]]:
    """An E2B gateway with ``--domain`` and TLS; yields (plain URL, TLS port)."""
    base = free_port_base(2)
    argv = [
        sys.executable,
        "-m",
        "dsec.gateway",
        "--home",
        str(platform.paths.home),
        "--listen",
        f"127.0.0.1:{base}",
        "--tls-listen",
        f"127.0.0.1:{base + 1}",
        "--domain",
        DOMAIN,
        "--api-url",
        api_url,
    ]
    url = f"http://127.0.0.1:{base}"
    with daemon(argv, f"{url}/healthz", platform.env()):
        yield url, base + 1


class ConnectProxy:
    """An HTTP CONNECT proxy that sends ``*.<DOMAIN>:443`` to one local port, refuses the rest."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.hosts: list[str] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stop:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(client,), daemon=True).start()

    def _one(self, client: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = client.recv(4096)
            if not chunk:
                client.close()
                return
            head += chunk
        line = head.split(b"\r\n", 1)[0].decode()
        method, target, _ = line.split(" ", 2)
        host, _, port = target.rpartition(":")
        if method != "CONNECT" or port != "443" or not host.endswith("." + DOMAIN):
            client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            client.close()
            return
        self.hosts.append(host)
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        client.sendall(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        client.close()
        upstream.close()

    def close(self) -> None:
        self._stop = True
        self._sock.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)
