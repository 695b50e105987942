"""The VM agent-channel multiplexer, host and guest ends, over socketpairs (no VM).

The guest end is ``guest/vmport.c``, which every microVM runs (linked into vminit) and the
full VM's image runs as a program: here that program, built as the image builds it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.edge.backends.microvm import frames
from dsec.edge.backends.microvm.mux import HostMux, SerialLink
from tests.unit.muxkit import PairLink, build_c_guest
from tests.unit.muxkit import sink_and_flood_server as _sink_and_flood_server
from tests.waits import auntil


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsmux-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def c_guest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed (scripts/install installs it)")
    return build_c_guest(tmp_path_factory.mktemp("vmport"))


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
    wire = frames.frame(frames.OPEN, 7) + frames.frame(frames.DATA, 7, b"hello")
    buf = bytearray(wire[:5])
    assert frames.parse(buf) == []
    buf += wire[5:]
    assert frames.parse(buf) == [(frames.OPEN, 7, b""), (frames.DATA, 7, b"hello")]
    assert buf == b""


def test_bad_frame_is_refused() -> None:
    with pytest.raises(frames.MuxError):
        frames.parse(bytearray(b"\x09" + b"\x00" * 8))
    with pytest.raises(frames.MuxError):
        frames.parse(bytearray(frames.HEADER.pack(frames.DATA, 1, frames.MAX_PAYLOAD + 1)))


@pytest.mark.asyncio
async def test_many_concurrent_channels(sock_dir: Path, c_guest: Path) -> None:
    srv = _echo_server(sock_dir / "aether.sock")
    link = PairLink(sock_dir / "aether.sock", c_guest)
    mux = HostMux(sock_dir / "agent.sock", link)
    await mux.start()
    try:
        await mux.wait_ready(5)
        payloads = [os.urandom(1 + i * 4099).hex().encode() for i in range(40)]
        got = await asyncio.gather(*(_roundtrip(mux.listen_path, p) for p in payloads))
        assert got == [p.upper() for p in payloads]
    finally:
        await mux.close()
        link.close()
        srv.close()
    assert not mux.listen_path.exists()


@pytest.mark.asyncio
async def test_guest_close_ends_the_call_and_unknown_target_closes(
    sock_dir: Path, c_guest: Path
) -> None:
    link = PairLink(sock_dir / "nothing-listens.sock", c_guest)
    mux = HostMux(sock_dir / "agent.sock", link)
    await mux.start()
    try:
        await mux.wait_ready(5)
        r, w = await asyncio.open_unix_connection(str(mux.listen_path))
        assert await asyncio.wait_for(r.read(), 5) == b""  # the guest could not connect
        w.close()
    finally:
        await mux.close()
        link.close()


@pytest.mark.asyncio
async def test_link_reconnects_after_loss(sock_dir: Path, c_guest: Path) -> None:
    srv = _echo_server(sock_dir / "aether.sock")
    link = PairLink(sock_dir / "aether.sock", c_guest)
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
        await auntil(lambda: mux.links_opened >= 2, "two links opened", 5)
        await mux.wait_ready(5)
        assert await _roundtrip(mux.listen_path, b"again") == b"AGAIN"
    finally:
        await mux.close()
        link.close()
        srv.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("slow", ["guest reader", "host reader"])
async def test_one_slow_stream_does_not_stall_the_others(
    sock_dir: Path, slow: str, c_guest: Path
) -> None:
    """Per-channel flow control: a channel whose receiver stops reading (aether not taking
    a big upload, or an edge caller not reading a big download) fills only its own
    window; calls on other channels go on."""
    srv = _sink_and_flood_server(sock_dir / "aether.sock")
    link = PairLink(sock_dir / "aether.sock", c_guest)
    mux = HostMux(sock_dir / "agent.sock", link)
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
        link.close()
        srv.close()


@pytest.mark.asyncio
async def test_the_guest_serves_links_from_a_listener_one_after_another(
    sock_dir: Path, c_guest: Path
) -> None:
    """Under Firecracker the guest listens (vsock) and the host connects, again after an
    edge restart or a restore; here the listener is a unix socket."""
    srv = _echo_server(sock_dir / "aether.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_dir / "guest.sock"))
    listener.listen(1)
    fd, target = listener.fileno(), str(sock_dir / "aether.sock")
    argv = [str(c_guest), "--listen-fd", str(fd), "--target", target]
    proc = subprocess.Popen(argv, pass_fds=(fd,))
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
    try:
        assert proc.wait(5) == 0  # returns once its listener is closed
    finally:
        proc.kill()
        proc.wait()


def _read_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    buf = bytearray()
    while not (got := frames.parse(buf)):
        data = sock.recv(65536)
        assert data, "the guest closed the link"
        buf += data
    assert len(got) == 1, got
    return got[0]


def test_c_guest_applies_the_hello_identity_and_takes_the_window(
    c_guest: Path, tmp_path: Path
) -> None:
    """HELLO's JSON (escapes, nested values it does not know) sets the hostname files and
    machine id, READY takes the window (at most ``frames.WINDOW``); a HELLO that is not
    JSON, or a window under a chunk, is answered READY without flow control. In a UTS
    namespace of its own: it sets the hostname."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a UTS namespace of the guest's own")
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "hosts").write_bytes(b"127.0.0.1\tlocalhost\r\n127.0.1.1\told-name\n\n::1\tip6\n")
    host, guest = socket.socketpair()
    fd = guest.fileno()
    argv = ["unshare", "--uts", str(c_guest), "--link-fd", str(fd), "--etc", str(etc),
            "--target", str(tmp_path / "none.sock")]  # fmt: skip
    proc = subprocess.Popen(argv, pass_fds=(fd,))
    guest.close()
    try:
        hello = json.dumps({
            "extra": {"a": [1, "}", {"b": None}], "c": True},
            "hostname": "sbx-\u00e9t\u00e9",
            "machine_id": 'ab\\c"d/e',
            "seed": "00ff" * 16,
            "time": time.time(),
            "window": 1 << 30,
        }, ensure_ascii=True).encode()  # fmt: skip
        host.sendall(frames.frame(frames.HELLO, 0, hello))
        assert _read_frame(host) == (frames.READY, 0, b'{"window": %d}' % frames.WINDOW)
        assert (etc / "hostname").read_text() == "sbx-\u00e9t\u00e9\n"
        assert (etc / "machine-id").read_text() == 'ab\\c"d/e\n'
        hosts = (etc / "hosts").read_text()
        assert hosts == "127.0.0.1\tlocalhost\n\n::1\tip6\n127.0.1.1\tsbx-\u00e9t\u00e9\n"
        for bad in (b"{nope", b'{"window": 4096}', b'{"window": 262144.0}', b"[]"):
            host.sendall(frames.frame(frames.HELLO, 0, bad))
            assert _read_frame(host) == (frames.READY, 0, b""), bad
        host.sendall(b"\x09" + b"\x00" * 8)  # not a frame type: the guest gives up the link
        assert proc.wait(10) == 1
    finally:
        host.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
