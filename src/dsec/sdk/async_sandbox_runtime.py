"""The asyncio runtime handles of a sandbox: files, processes, PTYs and persistent shells.

The twin of ``sandbox_runtime.py``; local file work (upload, download, writing from a file
object) runs in a worker thread so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from dsec.agent.protocol import CHUNK
from dsec.core.errors import Internal, InvalidArgument, NotFound
from dsec.sdk import runtime_calls as rc
from dsec.sdk import streams
from dsec.sdk import trajectory_calls as tc
from dsec.sdk.async_io import AsyncContent, AsyncRuntimeSocket, AsyncTransport
from dsec.sdk.models import ExecEvent, ExecResult, FileEntry, ProcessInfo, WriteResult
from dsec.sdk.sandbox_runtime import DOWNLOAD_MODE


class AsyncFiles:
    """The sandbox's filesystem; transfers are streamed in chunks."""

    def __init__(self, sandbox_id: str, transport: AsyncTransport) -> None:
        self._id = sandbox_id
        self._t = transport

    async def read(self, path: str) -> bytes:
        return await self._t.fetch(rc.read_file(self._id, path))

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def read_stream(self, path: str, chunk_size: int = CHUNK) -> AsyncGenerator[bytes, None]:
        """Yield the file's content in chunks without holding it in memory."""
        req = rc.read_file(self._id, path)
        async with self._t.download(req, chunk_size) as chunks:
            async for chunk in chunks:
                yield chunk

    async def write(
        self,
        path: str,
        data: bytes | str | BinaryIO,
        mode: int | None = None,
        idempotent: bool = False,
    ) -> WriteResult:
        """Write (atomically replace) a file, creating missing parent directories."""
        call = tc.idempotent(rc.write_file(self._id, path, mode=mode), idempotent)
        content: AsyncContent
        if isinstance(data, str):
            content = data.encode()
        elif isinstance(data, bytes | bytearray | memoryview):
            content = bytes(data)
        else:
            content = _read_chunks(data)
        return await self._t.call(call, content)

    async def list(self, path: str, depth: int = 1) -> builtins.list[FileEntry]:
        return await self._t.call(rc.list_files(self._id, path, depth))

    async def stat(self, path: str) -> FileEntry:
        return await self._t.call(rc.stat_file(self._id, path))

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def mkdir(self, path: str, parents: bool = True) -> FileEntry:
        return await self._t.call(rc.make_dir(self._id, path, parents))

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._t.call(rc.remove_file(self._id, path, recursive))

    async def rename(self, src: str, dst: str) -> FileEntry:
        return await self._t.call(rc.rename_file(self._id, src, dst))

    async def upload(
        self, local_path: str | Path, remote_path: str, mode: int | None = None
    ) -> WriteResult:
        """Stream a local file into the sandbox."""
        call = rc.write_file(self._id, remote_path, mode=mode)
        try:
            f = await asyncio.to_thread(open, local_path, "rb")
        except OSError as exc:
            raise InvalidArgument(f"cannot read {local_path}: {exc.strerror}") from None
        try:
            return await self._t.call(call, _read_chunks(f))
        finally:
            await asyncio.to_thread(f.close)

    async def download(self, remote_path: str, local_path: str | Path) -> int:
        """Stream a file out of the sandbox into ``local_path``; returns the byte count."""
        dest = Path(local_path)
        req = rc.read_file(self._id, remote_path)
        try:
            fd, tmp = await asyncio.to_thread(
                tempfile.mkstemp, prefix=f".{dest.name}.", dir=dest.parent or "."
            )
        except OSError as exc:
            raise InvalidArgument(f"cannot write into {dest.parent}: {exc.strerror}") from None
        size = 0
        out = os.fdopen(fd, "wb")
        try:
            async with self._t.download(req) as chunks:
                async for chunk in chunks:
                    await asyncio.to_thread(out.write, chunk)
                    size += len(chunk)
            await asyncio.to_thread(out.close)
            await asyncio.to_thread(os.chmod, tmp, DOWNLOAD_MODE)
            await asyncio.to_thread(os.replace, tmp, dest)
        except BaseException:
            out.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return size


async def _read_chunks(f: BinaryIO) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(f.read, CHUNK):
        yield chunk


class AsyncProcesses:
    """Background processes that outlive the call that started them."""

    def __init__(self, sandbox_id: str, transport: AsyncTransport) -> None:
        self._id = sandbox_id
        self._t = transport

    async def start(
        self,
        cmd: rc.Command,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        tag: str | None = None,
    ) -> ProcessInfo:
        call = rc.start_process(self._id, cmd, env=env, cwd=cwd, user=user, tag=tag)
        return await self._t.call(call)

    async def list(self) -> builtins.list[ProcessInfo]:
        return await self._t.call(rc.list_processes(self._id))

    async def signal(self, pid: int, sig: int) -> None:
        await self._t.call(rc.signal_process(self._id, pid, sig))

    async def kill(self, pid: int) -> None:
        await self._t.call(rc.signal_process(self._id, pid, rc.SIGKILL))

    async def send_input(self, pid: int, data: bytes | str) -> None:
        await self._t.call(rc.send_input(self._id, pid, data))

    def connect(self, pid: int) -> AsyncGenerator[ExecEvent, None]:
        """Replay the process's buffered output, follow it live, end with its ``exit``."""
        return self._t.events(self._id, streams.connect_request(pid))


class AsyncPtys:
    """Interactive terminals inside the sandbox."""

    def __init__(self, sandbox_id: str, transport: AsyncTransport) -> None:
        self._id = sandbox_id
        self._t = transport

    async def create(
        self,
        cols: int = 80,
        rows: int = 24,
        cmd: rc.Command | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> AsyncPty:
        """Start ``cmd`` (a login shell by default) on a new terminal of ``cols`` x ``rows``."""
        call = rc.start_process(
            self._id,
            cmd or rc.DEFAULT_PTY_CMD,
            env=rc.pty_env(env),
            cwd=cwd,
            pty=(cols, rows),
        )
        return AsyncPty(self._id, self._t, (await self._t.call(call)).pid)

    def connect(self, pid: int) -> AsyncPty:
        """Reattach to a running PTY process."""
        return AsyncPty(self._id, self._t, pid)


class AsyncPty:
    """A terminal: ``async for`` output bytes, ``send`` keystrokes, ``wait`` for the exit code."""

    def __init__(self, sandbox_id: str, transport: AsyncTransport, pid: int) -> None:
        self.pid = pid
        self._id = sandbox_id
        self._t = transport
        self._sock: AsyncRuntimeSocket | None = None
        self._lock = asyncio.Lock()
        self._exit: ExecEvent | None = None

    async def _socket(self) -> AsyncRuntimeSocket:
        async with self._lock:
            if self._sock is None:
                self._sock = await self._t.open_runtime(self._id, streams.connect_request(self.pid))
            return self._sock

    async def send(self, data: bytes | str) -> None:
        sock = await self._socket()
        await sock.send_input(data.encode() if isinstance(data, str) else bytes(data))

    async def resize(self, cols: int, rows: int) -> None:
        await (await self._socket()).send(streams.resize_message(cols, rows))

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        if self._exit is not None:
            return
        async for event in await self._socket():
            if event.kind == "exit":
                self._exit = event
                return
            yield event.data

    async def wait(self) -> int:
        """Wait for the process to end; its exit code, or minus the signal that killed it."""
        async for _ in self:
            pass
        if self._exit is None:
            raise Internal("the PTY stream ended without an exit status")
        return self._exit.returncode

    async def kill(self) -> None:
        await self._t.call(rc.signal_process(self._id, self.pid, rc.SIGKILL))

    async def aclose(self) -> None:
        """Detach from the terminal (the process keeps running)."""
        async with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            await sock.close()

    async def __aenter__(self) -> AsyncPty:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class AsyncShell:
    """A named persistent shell: ``cd``, ``export`` and background jobs carry over."""

    def __init__(self, sandbox_id: str, transport: AsyncTransport, name: str) -> None:
        self.name = name
        self._id = sandbox_id
        self._t = transport

    async def run(
        self,
        cmd: str,
        timeout: float | None = 60,  # noqa: ASYNC109 -- enforced inside the sandbox
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        idempotent: bool = False,
    ) -> ExecResult:
        call = rc.run_in_shell(
            self._id, self.name, cmd, timeout=timeout, env=env, cwd=cwd, user=user
        )
        return await self._t.call(tc.idempotent(call, idempotent))

    async def close(self) -> None:
        """End the session (its shell process exits)."""
        await self._t.call(rc.close_shell(self._id, self.name))
