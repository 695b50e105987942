"""The blocking runtime handles of a sandbox: files, processes, PTYs and persistent shells.

Reached as ``sbx.files``, ``sbx.processes``, ``sbx.pty`` and ``sbx.shell(name)``; each holds
the sandbox id and the shared :class:`~dsec.sdk.sync_io.SyncTransport`.
``async_sandbox_runtime.py`` mirrors it name for name.
"""

from __future__ import annotations

import builtins
import os
import tempfile
import threading
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from dsec.agent.protocol import CHUNK
from dsec.core.errors import Internal, InvalidArgument, NotFound
from dsec.sdk import runtime_calls as rc
from dsec.sdk import streams
from dsec.sdk import trajectory_calls as tc
from dsec.sdk.models import ExecEvent, ExecResult, FileEntry, ProcessInfo, WriteResult
from dsec.sdk.sync_io import Content, SyncRuntimeSocket, SyncTransport

DOWNLOAD_MODE = 0o644  # mkstemp makes 0600; downloads get ordinary file permissions


class Files:
    """The sandbox's filesystem; transfers are streamed in chunks."""

    def __init__(self, sandbox_id: str, transport: SyncTransport) -> None:
        self._id = sandbox_id
        self._t = transport

    def read(self, path: str) -> bytes:
        return self._t.fetch(rc.read_file(self._id, path))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding)

    def read_stream(self, path: str, chunk_size: int = CHUNK) -> Generator[bytes, None, None]:
        """Yield the file's content in chunks without holding it in memory."""
        req = rc.read_file(self._id, path)
        with self._t.download(req, chunk_size) as chunks:
            yield from chunks

    def write(
        self,
        path: str,
        data: bytes | str | BinaryIO,
        mode: int | None = None,
        idempotent: bool = False,
    ) -> WriteResult:
        """Write (atomically replace) a file, creating missing parent directories."""
        call = tc.idempotent(rc.write_file(self._id, path, mode=mode), idempotent)
        content: Content
        if isinstance(data, str):
            content = data.encode()
        elif isinstance(data, bytes | bytearray | memoryview):
            content = bytes(data)
        else:
            content = _read_chunks(data)
        return self._t.call(call, content)

    def list(self, path: str, depth: int = 1) -> builtins.list[FileEntry]:
        return self._t.call(rc.list_files(self._id, path, depth))

    def stat(self, path: str) -> FileEntry:
        return self._t.call(rc.stat_file(self._id, path))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except NotFound:
            return False
        return True

    def mkdir(self, path: str, parents: bool = True) -> FileEntry:
        return self._t.call(rc.make_dir(self._id, path, parents))

    def remove(self, path: str, recursive: bool = False) -> None:
        self._t.call(rc.remove_file(self._id, path, recursive))

    def rename(self, src: str, dst: str) -> FileEntry:
        return self._t.call(rc.rename_file(self._id, src, dst))

    def upload(
        self, local_path: str | Path, remote_path: str, mode: int | None = None
    ) -> WriteResult:
        """Stream a local file into the sandbox."""
        call = rc.write_file(self._id, remote_path, mode=mode)
        try:
            f = open(local_path, "rb")  # noqa: SIM115 -- closed below
        except OSError as exc:
            raise InvalidArgument(f"cannot read {local_path}: {exc.strerror}") from None
        with f:
            return self._t.call(call, _read_chunks(f))

    def download(self, remote_path: str, local_path: str | Path) -> int:
        """Stream a file out of the sandbox into ``local_path``; returns the byte count."""
        dest = Path(local_path)
        req = rc.read_file(self._id, remote_path)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent or ".")
        except OSError as exc:
            raise InvalidArgument(f"cannot write into {dest.parent}: {exc.strerror}") from None
        size = 0
        try:
            with os.fdopen(fd, "wb") as out, self._t.download(req) as chunks:
                for chunk in chunks:
                    out.write(chunk)
                    size += len(chunk)
            os.chmod(tmp, DOWNLOAD_MODE)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size


def _read_chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk


class Processes:
    """Background processes that outlive the call that started them."""

    def __init__(self, sandbox_id: str, transport: SyncTransport) -> None:
        self._id = sandbox_id
        self._t = transport

    def start(
        self,
        cmd: rc.Command,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        tag: str | None = None,
    ) -> ProcessInfo:
        return self._t.call(rc.start_process(self._id, cmd, env=env, cwd=cwd, user=user, tag=tag))

    def list(self) -> builtins.list[ProcessInfo]:
        return self._t.call(rc.list_processes(self._id))

    def signal(self, pid: int, sig: int) -> None:
        self._t.call(rc.signal_process(self._id, pid, sig))

    def kill(self, pid: int) -> None:
        self._t.call(rc.signal_process(self._id, pid, rc.SIGKILL))

    def send_input(self, pid: int, data: bytes | str) -> None:
        self._t.call(rc.send_input(self._id, pid, data))

    def connect(self, pid: int) -> Generator[ExecEvent, None, None]:
        """Replay the process's buffered output, follow it live, end with its ``exit``."""
        return self._t.events(self._id, streams.connect_request(pid))


class Ptys:
    """Interactive terminals inside the sandbox."""

    def __init__(self, sandbox_id: str, transport: SyncTransport) -> None:
        self._id = sandbox_id
        self._t = transport

    def create(
        self,
        cols: int = 80,
        rows: int = 24,
        cmd: rc.Command | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> Pty:
        """Start ``cmd`` (a login shell by default) on a new terminal of ``cols`` x ``rows``."""
        call = rc.start_process(
            self._id,
            cmd or rc.DEFAULT_PTY_CMD,
            env=rc.pty_env(env),
            cwd=cwd,
            pty=(cols, rows),
        )
        return Pty(self._id, self._t, self._t.call(call).pid)

    def connect(self, pid: int) -> Pty:
        """Reattach to a running PTY process."""
        return Pty(self._id, self._t, pid)


class Pty:
    """A terminal: iterate for output bytes, ``send`` keystrokes, ``wait`` for the exit code."""

    def __init__(self, sandbox_id: str, transport: SyncTransport, pid: int) -> None:
        self.pid = pid
        self._id = sandbox_id
        self._t = transport
        self._sock: SyncRuntimeSocket | None = None
        self._lock = threading.Lock()
        self._exit: ExecEvent | None = None

    def _socket(self) -> SyncRuntimeSocket:
        with self._lock:
            if self._sock is None:
                self._sock = self._t.open_runtime(self._id, streams.connect_request(self.pid))
            return self._sock

    def send(self, data: bytes | str) -> None:
        self._socket().send_input(data.encode() if isinstance(data, str) else bytes(data))

    def resize(self, cols: int, rows: int) -> None:
        self._socket().send(streams.resize_message(cols, rows))

    def __iter__(self) -> Generator[bytes, None, None]:
        if self._exit is not None:
            return
        for event in self._socket():
            if event.kind == "exit":
                self._exit = event
                return
            yield event.data

    def wait(self) -> int:
        """Wait for the process to end; its exit code, or minus the signal that killed it."""
        for _ in self:
            pass
        if self._exit is None:
            raise Internal("the PTY stream ended without an exit status")
        return self._exit.returncode

    def kill(self) -> None:
        self._t.call(rc.signal_process(self._id, self.pid, rc.SIGKILL))

    def close(self) -> None:
        """Detach from the terminal (the process keeps running)."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> Pty:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Shell:
    """A named persistent shell: ``cd``, ``export`` and background jobs carry over."""

    def __init__(self, sandbox_id: str, transport: SyncTransport, name: str) -> None:
        self.name = name
        self._id = sandbox_id
        self._t = transport

    def run(
        self,
        cmd: str,
        timeout: float | None = 60,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        idempotent: bool = False,
    ) -> ExecResult:
        call = rc.run_in_shell(
            self._id, self.name, cmd, timeout=timeout, env=env, cwd=cwd, user=user
        )
        return self._t.call(tc.idempotent(call, idempotent))

    def close(self) -> None:
        """End the session (its shell process exits)."""
        self._t.call(rc.close_shell(self._id, self.name))
