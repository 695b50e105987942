"""The microVM agent-channel multiplexer, host and guest ends, over socketpairs (no VM)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dsec.agent import vmport
from dsec.edge.backends.microvm.mux import HostMux, SerialLink
from tests.unit.muxkit import PairLink
from tests.unit.muxkit import sink_and_flood_server as _sink_and_flood_server


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsmux-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _echo_server(path: Path) -> socket.socket:
    """A guest-side 'aether' that echoes every connection, upper-cased."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(64)

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data.upper())

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv


async def _roundtrip(path: Path, payload: bytes) -> bytes:
    r, w = await asyncio.open_unix_connection(str(path))
    w.write(payload)
    await w.drain()
    got = await r.readexactly(len(payload))
    w.close()
    return got


def test_frames_parse_across_chunks() -> None:
    wire = vmport.frame(vmport.OPEN, 7) + vmport.frame(vmport.DATA, 7, b"hello")
    buf = bytearray(wire[:5])
    assert vmport.parse(buf) == []
    buf += wire[5:]
    assert vmport.parse(buf) == [(vmport.OPEN, 7, b""), (vmport.DATA, 7, b"hello")]
    assert buf == b""


def test_bad_frame_is_refused() -> None:
    with pytest.raises(vmport.MuxError):
        vmport.parse(bytearray(b"\x09" + b"\x00" * 8))
    with pytest.raises(vmport.MuxError):
        vmport.parse(bytearray(vmport.HEADER.pack(vmport.DATA, 1, vmport.MAX_PAYLOAD + 1)))


@pytest.mark.asyncio
async def test_many_concurrent_channels(sock_dir: Path) -> None:
    srv = _echo_server(sock_dir / "aether.sock")
    mux = HostMux(sock_dir / "agent.sock", PairLink(sock_dir / "aether.sock"))
    await mux.start()
    try:
        await mux.wait_ready(5)
        payloads = [os.urandom(1 + i * 4099).hex().encode() for i in range(40)]
        got = await asyncio.gather(*(_roundtrip(mux.listen_path, p) for p in payloads))
        assert got == [p.upper() for p in payloads]
    finally:
        await mux.close()
        srv.close()
    assert not mux.listen_path.exists()


@pytest.mark.asyncio
async def test_guest_close_ends_the_call_and_unknown_target_closes(sock_dir: Path) -> None:
    link = PairLink(sock_dir / "nothing-listens.sock")
    mux = HostMux(sock_dir / "agent.sock", link)
    await mux.start()
    try:
        await mux.wait_ready(5)
        r, w = await asyncio.open_unix_connection(str(mux.listen_path))
        assert await asyncio.wait_for(r.read(), 5) == b""  # the guest could not connect
        w.close()
    finally:
        await mux.close()


@pytest.mark.asyncio
async def test_link_reconnects_after_loss(sock_dir: Path) -> None:
    srv = _echo_server(sock_dir / "aether.sock")
    link = PairLink(sock_dir / "aether.sock")
    mux = HostMux(sock_dir / "agent.sock", link)
    await mux.start()
    try:
        await mux.wait_ready(5)
        r, w = await asyncio.open_unix_connection(str(mux.listen_path))
        w.write(b"abc")
        assert await r.readexactly(3) == b"ABC"
        link.guest_socks[-1].shutdown(socket.SHUT_RDWR)  # the VMM went away
        assert await asyncio.wait_for(r.read(), 5) == b""  # calls in flight end
        w.close()
        await asyncio.wait_for(_until(lambda: mux.links_opened >= 2), 5)
        await mux.wait_ready(5)
        assert await _roundtrip(mux.listen_path, b"again") == b"AGAIN"
    finally:
        await mux.close()
        srv.close()


async def _until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
@pytest.mark.parametrize("slow", ["guest reader", "host reader"])
async def test_one_slow_stream_does_not_stall_the_others(sock_dir: Path, slow: str) -> None:
    """Per-channel flow control: a channel whose receiver stops reading (aether not taking
    a big upload, or an edge caller not reading a big download) fills only its own
    window; calls on other channels go on."""
    srv = _sink_and_flood_server(sock_dir / "aether.sock")
    mux = HostMux(sock_dir / "agent.sock", PairLink(sock_dir / "aether.sock"))
    await mux.start()
    stuck_w: asyncio.StreamWriter | None = None
    pusher: asyncio.Task[None] | None = None
    try:
        await mux.wait_ready(5)
        _stuck_r, stuck_w = await asyncio.open_unix_connection(str(mux.listen_path))
        if slow == "guest reader":  # 32 MiB towards a guest socket nobody reads

            async def push() -> None:
                assert stuck_w is not None
                stuck_w.write(b"SINK ")
                for _ in range(512):
                    stuck_w.write(b"y" * 65536)
                    await stuck_w.drain()

            pusher = asyncio.create_task(push())
        else:  # the guest floods a caller that never reads
            stuck_w.write(b"FLOOD")
            await stuck_w.drain()
        await asyncio.sleep(1.0)  # every buffer on the stuck path fills up
        payloads = [os.urandom(20_000).hex().encode() for _ in range(4)]
        got = await asyncio.wait_for(
            asyncio.gather(*(_roundtrip(mux.listen_path, p) for p in payloads)), 10
        )
        assert got == [p.upper() for p in payloads]
        if pusher is not None:
            assert not pusher.done()  # the stuck upload really is held back, not dropped
    finally:
        if pusher is not None:
            pusher.cancel()
            with contextlib.suppress(BaseException):
                await pusher
        if stuck_w is not None:
            stuck_w.close()
        await mux.close()
        srv.close()


@pytest.mark.asyncio
async def test_the_guest_serves_links_from_a_listener_one_after_another(sock_dir: Path) -> None:
    """Under Firecracker the guest listens (vsock) and the host connects, again after an
    edge restart or a restore; here the listener is a unix socket."""
    srv = _echo_server(sock_dir / "aether.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_dir / "guest.sock"))
    listener.listen(1)
    guest = threading.Thread(
        target=vmport.serve_listener,
        args=(listener, str(sock_dir / "aether.sock")),
        daemon=True,
    )
    guest.start()
    try:
        for attempt in (b"first", b"second"):  # the second mux is a restarted edge
            link = SerialLink(sock_dir / "guest.sock")
            mux = HostMux(sock_dir / "agent.sock", link)
            await mux.start()
            try:
                await mux.wait_ready(5)
                assert await _roundtrip(mux.listen_path, attempt) == attempt.upper()
            finally:
                await mux.close()
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        srv.close()
    guest.join(5)
    assert not guest.is_alive()  # returns once its listener is closed


def test_vsock_is_recognised_by_its_virtio_driver(tmp_path: Path) -> None:
    assert not vmport.vsock_present(str(tmp_path / "none"))
    (tmp_path / "bind").touch()
    assert not vmport.vsock_present(str(tmp_path))
    (tmp_path / "virtio3").symlink_to(tmp_path)
    assert vmport.vsock_present(str(tmp_path))


_SIGIO_CHECK = """
import signal, socket, time
from dsec.agent import vmport
a, b = socket.socketpair()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGIO})
wait = vmport.host_signal(a.fileno())
assert wait is not None
t = time.monotonic(); wait(); idle = time.monotonic() - t
b.send(b"x")
t = time.monotonic(); wait(); woken = time.monotonic() - t
print(idle, woken)
"""


def test_guest_waits_for_the_hosts_sigio_not_a_poll_interval() -> None:
    """``host_signal``: the wait ends when the port's owner gets SIGIO (here: data on a
    socket, as the virtio console driver sends it on a host (dis)connect), else times out.
    In a process of its own: SIGIO goes to any thread that does not block it."""
    out = subprocess.run(
        [sys.executable, "-c", _SIGIO_CHECK], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    idle, woken = map(float, out.stdout.split())
    assert idle >= 0.4, idle  # nothing happened: the whole timeout
    assert woken < 0.2, woken  # the signal ended it at once
