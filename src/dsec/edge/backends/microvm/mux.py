"""The host end of the microVM agent channel: the sandbox's agent socket, multiplexed.

The edge (``agent_client``) opens one unix connection per runtime call on
``SandboxPaths.agent_socket``. :class:`HostMux` listens there and carries every connection
as a channel over one :class:`GuestLink` stream (frames in :mod:`.frames`).
The link is reconnected whenever it drops: after an edge restart (re-adoption), after a
snapshot restore, or while the guest has not opened its end yet. Channels are flow
controlled (``frames.CREDIT``) when the guest takes the offer: a call nobody reads stalls
only itself. Two links exist:

* :class:`SerialLink`: QEMU's virtio-serial chardev, a unix socket QEMU listens on;
* :class:`HybridVsockLink`: Firecracker's vsock, a unix socket where the host writes
  ``CONNECT <port>\\n`` and reads ``OK <n>\\n`` before the stream starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dsec.edge.backends.microvm import frames
from dsec.edge.backends.microvm.frames import CLOSE, CREDIT, DATA, HELLO, OPEN, READY, frame

_log = logging.getLogger(__name__)
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
LINK_WAIT_S = 10.0  # a call waits this long for a link that is down


class GuestLink(Protocol):
    async def open(self) -> Stream:
        """A fresh byte stream to the guest's multiplexer (raise OSError if not now)."""
        ...


class SerialLink:
    """A virtio-serial port whose host end is a unix socket QEMU serves."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def open(self) -> Stream:
        return await asyncio.open_unix_connection(str(self.path))


class HybridVsockLink:
    """Firecracker's host-initiated vsock: ``CONNECT <port>`` on its unix socket."""

    def __init__(self, path: Path, port: int) -> None:
        self.path = path
        self.port = port

    async def open(self) -> Stream:
        reader, writer = await asyncio.open_unix_connection(str(self.path))
        writer.write(f"CONNECT {self.port}\n".encode())
        line = await asyncio.wait_for(reader.readline(), 5)
        if not line.startswith(b"OK "):
            writer.close()
            raise ConnectionRefusedError(f"vsock port {self.port}: {line!r}")
        return reader, writer


@dataclass(eq=False)
class _Chan:
    """One call: the caller's connection, and with flow control (``window`` > 0) what
    the guest may still send us (``credit``) and the queue a task writes to the caller."""

    writer: asyncio.StreamWriter
    window: int
    credit: int = 0
    more: asyncio.Event = field(default_factory=asyncio.Event)  # credit came, or the end
    out: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None


class HostMux:
    """Accept calls on ``listen_path`` and carry them over ``link`` as channels."""

    def __init__(
        self, listen_path: Path, link: GuestLink, identity: dict[str, Any] | None = None
    ) -> None:
        self.listen_path = listen_path
        self.link = link
        self.identity = identity
        self._server: asyncio.AbstractServer | None = None
        self._link_task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._up = asyncio.Event()
        self._ready = asyncio.Event()
        self._channels: dict[int, _Chan] = {}
        self._next = 1
        self._window = 0  # per-channel flow control, when the guest's READY took it
        self.links_opened = 0

    async def start(self) -> None:
        self.listen_path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(
            self._client, str(self.listen_path), backlog=128
        )
        self.listen_path.chmod(0o600)
        self._link_task = asyncio.create_task(self._link_loop())

    @property
    def started(self) -> bool:
        return self._server is not None

    async def wait_ready(self, timeout_s: float) -> None:
        """Until the guest answered HELLO on the current link."""
        await asyncio.wait_for(self._ready.wait(), timeout_s)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._link_task is not None:
            self._link_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._link_task
            self._link_task = None
        self._drop_all()
        self.listen_path.unlink(missing_ok=True)

    # --- link --------------------------------------------------------------------------

    async def _link_loop(self) -> None:
        delay = 0.01
        while True:
            try:
                reader, writer = await self.link.open()
            except OSError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.2)
                continue
            delay = 0.01
            self.links_opened += 1
            self._writer = writer
            # The guest's clock stood still while it was paused or snapshotted: set it too.
            hello = json.dumps(
                {**(self.identity or {}), "time": time.time(), "window": frames.WINDOW}
            ).encode()
            writer.write(frame(HELLO, 0, hello))
            self._up.set()
            try:
                await self._read_link(reader)
            except (OSError, frames.MuxError) as exc:
                _log.info("microvm agent link %s lost: %s", self.listen_path.name, exc)
            finally:
                self._up.clear()
                self._ready.clear()
                self._writer = None
                writer.close()
                self._drop_all()

    async def _read_link(self, reader: asyncio.StreamReader) -> None:
        buf = bytearray()
        while True:
            data = await reader.read(frames.CHUNK)
            if not data:
                return
            buf += data
            for kind, chan, payload in frames.parse(buf):
                if kind == READY:
                    self._window = frames.window_of(payload)
                    self._ready.set()
                    continue
                c = self._channels.get(chan)
                if c is None:
                    continue
                if kind == DATA:
                    if c.window:
                        c.out.put_nowait(payload)  # its task writes it: the link reads on
                    else:
                        c.writer.write(payload)
                        with contextlib.suppress(OSError):
                            await c.writer.drain()
                elif kind == CREDIT:
                    if len(payload) == frames.COUNT.size:
                        c.credit += frames.COUNT.unpack(payload)[0]
                        c.more.set()
                elif kind == CLOSE:
                    if c.window:
                        c.out.put_nowait(None)  # after what is queued for the caller
                    else:
                        self._end(chan, c)

    async def _deliver(self, chan: int, c: _Chan, link: asyncio.StreamWriter) -> None:
        """guest -> caller for one flow-controlled channel; CREDIT for what was written."""
        try:
            while (data := await c.out.get()) is not None:
                c.writer.write(data)
                await c.writer.drain()
                if self._channels.get(chan) is c and not link.is_closing():
                    link.write(frame(CREDIT, chan, frames.COUNT.pack(len(data))))
        except OSError:
            if self._channels.get(chan) is c and not link.is_closing():
                link.write(frame(CLOSE, chan))
        self._end(chan, c)

    def _end(self, chan: int, c: _Chan) -> None:
        if self._channels.get(chan) is c:
            del self._channels[chan]
        c.writer.close()
        c.more.set()

    def _drop_all(self) -> None:
        for chan, c in list(self._channels.items()):
            if c.task is not None:
                c.task.cancel()
            self._end(chan, c)

    # --- calls -------------------------------------------------------------------------

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:  # the guest's READY says whether channels are flow controlled
            await asyncio.wait_for(self._ready.wait(), LINK_WAIT_S)
        except TimeoutError:
            writer.close()
            return
        link = self._writer
        if link is None:
            writer.close()
            return
        chan = self._next
        self._next = self._next % 0xFFFFFFFF + 1
        c = _Chan(writer, self._window, credit=self._window)
        self._channels[chan] = c
        if c.window:
            c.task = asyncio.create_task(self._deliver(chan, c, link))
        link.write(frame(OPEN, chan))
        size = min(frames.CHUNK, c.window) if c.window else frames.CHUNK
        try:
            while True:
                data = await reader.read(size)
                if not data or self._channels.get(chan) is not c or link.is_closing():
                    break
                while c.window and c.credit < len(data) and self._channels.get(chan) is c:
                    c.more.clear()
                    await c.more.wait()  # the guest has not taken the window in yet
                if self._channels.get(chan) is not c or link.is_closing():
                    break
                c.credit -= len(data)
                link.write(frame(DATA, chan, data))
                await link.drain()
        except OSError:
            pass
        if self._channels.get(chan) is c:
            if not link.is_closing():
                link.write(frame(CLOSE, chan))
            if c.task is not None:
                c.task.cancel()
            self._end(chan, c)
