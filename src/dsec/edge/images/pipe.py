"""Bounded byte pipes between a worker thread and the event loop (save/load streams).

``ChunkReader`` is a file object a thread reads from while the loop :meth:`feeds
<ChunkReader.feed>` it; ``ChunkWriter`` is one a thread writes to while the loop takes
chunks of about :data:`CHUNK` bytes. Either side can give up: ``close``/``abort`` wake the
other, which then sees an end (reader) or an error (writer), so neither thread nor task
waits forever.
"""

from __future__ import annotations

import asyncio
import io
import queue
import threading

CHUNK = 1 << 20
DEPTH = 8  # chunks in flight: the memory a pipe holds is about DEPTH * CHUNK
_POLL_S = 0.2


class PipeClosed(Exception):
    """The other side went away."""


class ChunkReader(io.RawIOBase):
    """A readable file fed chunk by chunk from the event loop."""

    def __init__(self) -> None:
        self._q: queue.Queue[bytes | None] = queue.Queue(DEPTH)
        self._buf = b""
        self._eof = False
        self.closed_by_reader = threading.Event()

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview | bytearray) -> int:  # type: ignore[override]
        while not self._buf and not self._eof:
            item = self._q.get()
            if item is None:
                self._eof = True
            else:
                self._buf = item
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    async def feed(self, data: bytes | None) -> None:
        """Queue ``data`` (``None``: the end); raises PipeClosed once the reader stopped."""
        try:
            self._q.put_nowait(data)
        except queue.Full:
            await asyncio.to_thread(self._put, data)

    def _put(self, data: bytes | None) -> None:
        while not self.closed_by_reader.is_set():
            try:
                self._q.put(data, timeout=_POLL_S)
                return
            except queue.Full:
                continue
        raise PipeClosed("the reader stopped")

    def stop(self) -> None:
        """Called by the reading thread when it is done (the feeder stops waiting)."""
        self.closed_by_reader.set()


class ChunkWriter(io.RawIOBase):
    """A writable file drained chunk by chunk by the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._q: asyncio.Queue[bytes | None] = asyncio.Queue(DEPTH)
        self._buf = bytearray()
        self.aborted = threading.Event()

    def writable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self._buf += b
        if len(self._buf) >= CHUNK:
            self._put(bytes(self._buf))
            self._buf.clear()
        return len(b)

    def finish(self) -> None:
        """Called by the writing thread at its end (flushes, then signals the end)."""
        if self._buf:
            self._put(bytes(self._buf))
            self._buf.clear()
        self._put(None)

    def _put(self, item: bytes | None) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._q.put(item), self._loop)
        while not self.aborted.is_set():
            try:
                fut.result(timeout=_POLL_S)
                return
            except TimeoutError:
                continue
        fut.cancel()
        raise PipeClosed("the receiver went away")

    async def next_chunk(self) -> bytes | None:
        """The next chunk, or None at the end."""
        return await self._q.get()
