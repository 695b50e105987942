"""A small asyncio client of QEMU's QMP (JSON lines over a unix socket)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from dsec.core.errors import Internal


class QmpError(Internal):
    pass


class Qmp:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.events: list[dict[str, Any]] = []
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, path: Path, timeout_s: float) -> Qmp:
        """Connect (retrying until QEMU listens), read the greeting, enter command mode."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.005)
        qmp = cls(reader, writer)
        try:
            greeting = await asyncio.wait_for(qmp._read(), max(0.1, deadline - time.monotonic()))
            if "QMP" not in greeting:
                raise QmpError(f"not a QMP greeting: {greeting}")
            await qmp.cmd("qmp_capabilities")
        except BaseException:
            qmp.close()
            raise
        return qmp

    async def _read(self) -> dict[str, Any]:
        line = await self.reader.readline()
        if not line:
            raise ConnectionResetError("QMP connection closed")
        msg: dict[str, Any] = json.loads(line)
        return msg

    async def cmd(
        self,
        name: str,
        args: dict[str, Any] | None = None,
        timeout_s: float = 30,
        *,
        fd: int | None = None,
    ) -> Any:
        """Run command ``name``; ``fd`` goes along with it (SCM_RIGHTS), as ``getfd`` needs."""
        return (await self.cmds((name, args), timeout_s=timeout_s, fd=fd))[0]

    async def cmds(
        self,
        *calls: tuple[str, dict[str, Any] | None],
        timeout_s: float = 30,
        fd: int | None = None,
    ) -> list[Any]:
        """Run ``calls`` (name, arguments) in order, written at once: one round trip
        (``fd`` goes along with the write). Raises the first error; QEMU runs the later
        commands regardless."""
        async with self._lock:
            data = b"".join(
                json.dumps({"execute": n, **({"arguments": a} if a else {})}).encode() + b"\n"
                for n, a in calls
            )
            if fd is None:
                self.writer.write(data)
                await self.writer.drain()
            else:  # nothing is buffered (drained under the lock): send on the socket itself
                _send_with_fd(self.writer, data, fd)
            replies: list[dict[str, Any]] = []
            async with asyncio.timeout(timeout_s):
                while len(replies) < len(calls):
                    reply = await self._read()
                    if "event" in reply:
                        self.events.append(reply)
                    else:
                        replies.append(reply)
        for (name, _), reply in zip(calls, replies, strict=True):
            if "error" in reply:
                err = reply["error"]
                raise QmpError(f"QMP {name}: {err.get('class')}: {err.get('desc')}")
        return [r.get("return") for r in replies]

    def close(self) -> None:
        self.writer.close()


def _send_with_fd(writer: asyncio.StreamWriter, data: bytes, fd: int) -> None:
    raw = writer.get_extra_info("socket")
    sock = socket.socket(fileno=os.dup(raw.fileno()))  # asyncio's wrapper has no sendmsg
    try:
        sock.setblocking(True)
        if socket.send_fds(sock, [data], [fd]) != len(data):
            raise QmpError("short write of a QMP command")
    finally:
        sock.close()
