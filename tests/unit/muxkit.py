"""A host mux and a real guest mux without a VM: each link a socketpair, the guest's
"aether" a unix server. The guest end is the C multiplexer every VM runs
(``guest/vmport.c``, built as the program the full VM's image runs, :func:`build_c_guest`).
Shared by tests/unit/test_microvm_mux.py and bench/mux_flow.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
from pathlib import Path

from dsec.edge.backends.microvm.disks import build_vmport
from dsec.edge.backends.microvm.mux import Stream


def build_c_guest(dest_dir: Path) -> Path:
    """``guest/vmport.c`` as the program the full VM runs, which also serves an inherited
    link fd (``--link-fd``) or listening socket (``--listen-fd``): the code vminit runs in
    every microVM. Warnings fail the build here."""
    return build_vmport(dest_dir / "vmport", "-Werror")


class PairLink:
    """A GuestLink whose every open() is a new socketpair with a guest mux on the far end:
    the C program ``c_guest`` in a process of its own."""

    def __init__(self, target: Path, c_guest: Path) -> None:
        self.target = target
        self.c_guest = c_guest
        self.guest_socks: list[socket.socket] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    def close(self) -> None:
        """End the guest processes (each ends by itself once its link is closed)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for s in self.guest_socks:
            s.close()

    async def open(self) -> Stream:
        host, guest = socket.socketpair()
        self.guest_socks.append(guest)
        fd = guest.fileno()
        argv = [str(self.c_guest), "--link-fd", str(fd), "--target", str(self.target)]
        self.procs.append(subprocess.Popen(argv, pass_fds=(fd,)))
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
