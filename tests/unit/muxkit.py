"""A host mux and a real guest mux without a VM: each channel a socketpair, the guest's
"aether" a unix server. Shared by tests/unit/test_microvm_mux.py and bench/mux_flow.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from pathlib import Path

from dsec.agent import vmport
from dsec.edge.backends.microvm.mux import Stream


class PairLink:
    """A GuestLink whose every open() is a new socketpair with a guest mux on the far end."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.guest_socks: list[socket.socket] = []

    async def open(self) -> Stream:
        host, guest = socket.socketpair()
        self.guest_socks.append(guest)
        mux = vmport.GuestMux(guest.fileno(), str(self.target))

        def serve() -> None:
            with contextlib.suppress(OSError):  # the test closed the socket under it
                mux.run(retry_eof=False)

        threading.Thread(target=serve, daemon=True).start()
        return await asyncio.open_connection(sock=host)


def sink_and_flood_server(path: Path) -> socket.socket:
    """A guest-side 'aether': a connection that starts with ``SINK`` is never read again,
    one that starts with ``FLOOD`` gets endless bytes, any other is echoed upper-cased."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(64)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            first = conn.recv(5)
            if first.startswith(b"SINK"):
                stop.wait()
                return
            if first.startswith(b"FLOOD"):
                chunk = b"x" * 65536
                with contextlib.suppress(OSError):
                    while not stop.is_set():
                        conn.sendall(chunk)
                return
            data = first
            while data:
                conn.sendall(data.upper())
                data = conn.recv(65536)

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                stop.set()
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv
