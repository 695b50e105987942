"""Many runtime connections over one byte stream (a virtio-serial port or a vsock stream).

The edge accepts many concurrent connections on a sandbox's agent socket; a microVM has one
host<->guest stream. Both ends cut it into frames::

    +---------+---------------+----------------+-----------------+
    | type: 1 | channel: u32  | length: u32 BE | payload         |
    +---------+---------------+----------------+-----------------+

``OPEN`` (host) starts channel n: the guest connects to aether's socket for it. ``DATA``
carries bytes either way. ``CLOSE`` ends a channel (either side, either way; the other
side closes its end). ``HELLO`` (host) is the first frame after the host (re)connects:
the guest drops every channel it still had and applies the JSON identity it carries
(hostname, machine id, an RNG seed: set again in fork children; the host's clock, since
a restored guest's clock stood still). The guest answers
``READY``.

Flow control, per channel: a host that offers it puts ``"window": n`` in HELLO; a guest
that takes it answers READY with ``{"window": n}``. Then each side has at most ``n``
bytes of DATA unacknowledged per channel, and a receiver answers ``CREDIT`` (payload: a
u32 byte count) for what it has handed to its local socket. A receiver queues DATA per
channel and never blocks the link on one channel, so one stream nobody reads (a big
upload aether does not take yet, a download the caller does not read) holds up only
itself. Without the offer (an older peer) DATA is written through as it arrives.

The guest end of a microVM is the C port of this module (``guest/vmport.c`` of
``dsec.edge.backends.microvm``, linked into vminit): under TCG a restored or forked guest
translates again every code path it runs, the interpreter's too. ``main`` here is the
guest end of the full VM backend (a systemd unit in its image): one process, a reader
thread per channel, standard library only. tests/unit/test_microvm_mux.py runs both guest
ends against the same host end. virtio-serial reads return EOF while no host end is
connected (before the edge connects, after it restarts, across a snapshot restore), so
the guest keeps retrying: it waits for the SIGIO the virtio console driver sends when the
host end connects, not for a poll interval.
"""

from __future__ import annotations

import _queue
import _signal  # type: ignore[import-not-found]  # no stub; `signal` would import enum
import _socket
import _thread
import os
import struct
import time

from dsec.agent.threads import run_in_thread

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

HEADER = struct.Struct(">BII")
OPEN, DATA, CLOSE, HELLO, READY, CREDIT = 1, 2, 3, 4, 5, 6
MAX_PAYLOAD = 1 << 20
CHUNK = 64 * 1024
WINDOW = 256 * 1024  # unacknowledged DATA bytes per channel and direction
COUNT = struct.Struct(">I")
PORT_NAME = "dsec.agent"
VSOCK_PORT = 1027  # under Firecracker the host connects here (hybrid vsock)
VSOCK_DRIVER = "/sys/bus/virtio/drivers/vmw_vsock_virtio_transport"
AETHER_SOCKET = "/.dsec/run/aether.sock"


class MuxError(Exception):
    pass


def frame(kind: int, channel: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, channel, len(payload)) + payload


def parse(buf: bytearray) -> list[tuple[int, int, bytes]]:
    """Take every complete frame off the front of ``buf``."""
    out = []
    while len(buf) >= HEADER.size:
        kind, chan, n = HEADER.unpack_from(buf)
        if n > MAX_PAYLOAD or kind not in (OPEN, DATA, CLOSE, HELLO, READY, CREDIT):
            raise MuxError(f"bad frame: type {kind}, length {n}")
        if len(buf) < HEADER.size + n:
            break
        out.append((kind, chan, bytes(buf[HEADER.size : HEADER.size + n])))
        del buf[: HEADER.size + n]
    return out


# --- guest side -------------------------------------------------------------------------


def find_port(name: str = PORT_NAME, sys_dir: str = "/sys/class/virtio-ports") -> str | None:
    try:
        entries = os.listdir(sys_dir)
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(sys_dir, entry, "name")) as f:
                if f.read().strip() == name:
                    return "/dev/" + entry
        except OSError:
            continue
    return None


def window_of(payload: bytes) -> int:
    """The flow-control window a HELLO or READY payload offers (0: none)."""
    import json

    try:
        n = json.loads(payload).get("window") if payload else 0
    except (ValueError, AttributeError):
        return 0
    return min(n, WINDOW) if isinstance(n, int) and n >= CHUNK else 0


class _Chan:
    """One channel in the guest: aether's socket, and with flow control the queue of
    bytes for it (written by its own thread) and the credits the host granted."""

    def __init__(self, sock: _socket.socket, window: int) -> None:
        self.sock = sock
        self.window = window
        self.out: Any = _queue.SimpleQueue()  # bytes for aether; None: stop
        self.grants: Any = _queue.SimpleQueue()  # CREDIT byte counts; -1: the channel ended


class GuestMux:
    """The guest end: frames from ``fd`` open connections to ``target`` (aether)."""

    def __init__(
        self, fd: int, target: str = AETHER_SOCKET, wait_host: Callable[[], None] | None = None
    ) -> None:
        self.fd = fd
        self.target = target
        self.wait_host = wait_host  # returns when the host end may have connected
        self.channels: dict[int, _Chan] = {}
        self.lock = _thread.allocate_lock()  # one writer of frames at a time
        self.window = 0  # per-channel flow control, as the host's HELLO offered

    def send(self, kind: int, chan: int, payload: bytes = b"") -> None:
        data = memoryview(frame(kind, chan, payload))
        with self.lock:
            while data:
                n = os.write(self.fd, data)
                data = data[n:]

    def drop_all(self) -> None:
        for chan in list(self.channels):
            self.close(chan)

    def close(self, chan: int) -> None:
        c = self.channels.pop(chan, None)
        if c is not None:
            try:
                c.sock.shutdown(_socket.SHUT_RDWR)
            except OSError:
                pass
            c.sock.close()
            c.grants.put(-1)
            c.out.put(None)

    def handle(self, kind: int, chan: int, payload: bytes) -> None:
        if kind == HELLO:
            self.drop_all()
            if payload:
                apply_identity(payload)
            self.window = window_of(payload)
            ready = b'{"window": %d}' % self.window if self.window else b""
            self.send(READY, 0, ready)
        elif kind == OPEN:
            self.close(chan)
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            try:
                sock.connect(self.target)
            except OSError:
                sock.close()
                self.send(CLOSE, chan)
                return
            new = _Chan(sock, self.window)
            self.channels[chan] = new
            run_in_thread(self.pump, chan, new)
            if new.window:
                run_in_thread(self.deliver, chan, new)
        elif kind == DATA:
            c = self.channels.get(chan)
            if c is None:
                return
            if c.window:
                c.out.put(payload)  # its own thread writes it: the link reads on
                return
            try:
                c.sock.sendall(payload)
            except OSError:
                self.close(chan)
                self.send(CLOSE, chan)
        elif kind == CREDIT:
            c = self.channels.get(chan)
            if c is not None and len(payload) == COUNT.size:
                c.grants.put(COUNT.unpack(payload)[0])
        elif kind == CLOSE:
            c = self.channels.get(chan)
            if c is not None and c.window:
                c.out.put(None)  # after what is queued for aether
            else:
                self.close(chan)

    def deliver(self, chan: int, c: _Chan) -> None:
        """host -> aether for one flow-controlled channel; CREDIT for what was written."""
        while True:
            data = c.out.get()
            if data is None or self.channels.get(chan) is not c:
                break
            try:
                c.sock.sendall(data)
            except OSError:
                if self.channels.get(chan) is c:
                    self.close(chan)
                    self._send_quietly(CLOSE, chan)
                return
            if self.channels.get(chan) is c:
                self._send_quietly(CREDIT, chan, COUNT.pack(len(data)))
        if self.channels.get(chan) is c:  # the host closed the channel: all written
            self.close(chan)

    def pump(self, chan: int, c: _Chan) -> None:
        """aether -> host for one channel (within the host's credit), then CLOSE."""
        credit = c.window
        try:
            while True:
                data = c.sock.recv(min(CHUNK, c.window) if c.window else CHUNK)
                if not data:
                    break
                while c.window and credit < len(data):
                    grant = c.grants.get()
                    if grant < 0:
                        return
                    credit += grant
                credit -= len(data)
                self.send(DATA, chan, data)
        except OSError:
            pass
        if self.channels.get(chan) is c:
            self.close(chan)
            self._send_quietly(CLOSE, chan)

    def _send_quietly(self, kind: int, chan: int, payload: bytes = b"") -> None:
        try:
            self.send(kind, chan, payload)
        except OSError:
            pass

    def run(self, retry_eof: bool = True) -> None:
        """Read frames until the stream fails; EOF (no host end yet) is retried."""
        buf = bytearray()
        while True:
            data = os.read(self.fd, CHUNK)
            if not data:  # the host end is not connected (yet, or any more)
                if self.channels or buf:
                    self.drop_all()
                    buf.clear()
                if not retry_eof:
                    return
                if self.wait_host is not None:
                    self.wait_host()
                else:
                    time.sleep(0.02)
                continue
            buf += data
            for kind, chan, payload in parse(buf):
                self.handle(kind, chan, payload)


def apply_identity(payload: bytes) -> None:
    """Hostname, machine id and an RNG seed from the host (a fork child's own).

    Files are read and written with ``os`` calls on bytes, not ``open()``: a fork child
    runs this right after its restore, when every guest code path is translated again
    under TCG, and the io and codec layers are a large part of the interpreter."""
    import json

    ident: dict[str, Any] = json.loads(payload)
    host = ident.get("hostname")
    if isinstance(host, str) and host and os.uname().nodename != host:
        name = host.encode()
        _write("/proc/sys/kernel/hostname", name)
        _write("/etc/hostname", name + b"\n")
        hosts = _read("/etc/hosts")
        if hosts is not None:
            lines = [ln for ln in hosts.splitlines() if not ln.startswith(b"127.0.1.1")]
            _write("/etc/hosts", b"\n".join([*lines, b"127.0.1.1\t" + name]) + b"\n")
    mid = ident.get("machine_id")
    if isinstance(mid, str) and mid:
        _write("/etc/machine-id", mid.encode() + b"\n")
    now = ident.get("time")
    if isinstance(now, int | float) and abs(time.time() - now) > 0.5:
        try:
            time.clock_settime(time.CLOCK_REALTIME, float(now))
        except OSError:
            pass
    seed = ident.get("seed")
    if isinstance(seed, str) and seed:
        _write("/dev/urandom", seed.encode())


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _write(path: str, data: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    except OSError:
        return
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass
    finally:
        os.close(fd)


def vsock_present(driver_dir: str = VSOCK_DRIVER) -> bool:
    """The guest has a virtio vsock device (Firecracker gives one; QEMU here does not)."""
    try:
        return any(e.startswith("virtio") for e in os.listdir(driver_dir))
    except OSError:
        return False


def serve_listener(srv: _socket.socket, target: str = AETHER_SOCKET) -> None:
    """One link at a time from a listening socket (vsock: the host connects, and connects
    again after an edge restart or a snapshot restore reset the connection). Returns when
    the listener is closed."""
    while True:
        try:
            fd, _ = srv._accept()  # type: ignore[attr-defined]  # _socket: no socket module
        except OSError:
            return
        mux = GuestMux(fd, target)
        try:
            mux.run(retry_eof=False)
        except (OSError, MuxError) as exc:
            os.write(2, f"vmport: {exc}\n".encode())
        finally:
            mux.drop_all()
            os.close(fd)


def host_signal(fd: int) -> Callable[[], None] | None:
    """A wait that ends when the host end of virtio port ``fd`` (dis)connects or sends: the
    driver signals SIGIO to the fd's owner (O_ASYNC) on each. SIGIO must be blocked in
    every thread (``main`` does it first). None when the port cannot signal."""
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    except (ImportError, OSError):
        return None

    def wait() -> None:  # a signal pending from earlier data costs one more EOF read
        _signal.sigtimedwait((_signal.SIGIO,), 0.5)

    return wait


def main() -> None:
    _signal.pthread_sigmask(_signal.SIG_BLOCK, (_signal.SIGIO,))  # before any thread
    while True:
        port = find_port()
        if port is None:
            if vsock_present():
                srv = _socket.socket(_socket.AF_VSOCK, _socket.SOCK_STREAM)
                srv.bind((0xFFFFFFFF, VSOCK_PORT))  # VMADDR_CID_ANY
                srv.listen(1)
                serve_listener(srv)
            time.sleep(0.1)
            continue
        try:
            fd = os.open(port, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            time.sleep(0.1)
            continue
        mux = GuestMux(fd, wait_host=host_signal(fd))
        try:
            mux.run()
        except (OSError, MuxError) as exc:
            os.write(2, f"vmport: {exc}\n".encode())
        finally:
            mux.drop_all()
            os.close(fd)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
