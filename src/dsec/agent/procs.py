"""chronus's process table: background processes and PTYs with replayable output.

Every process runs in its own session (pid = process group). A reader thread moves its
output into an :class:`Output` (the last ``RING`` bytes of each stream, in order) and a
waiter thread records its exit; ``process.connect`` replays what is kept, then follows live.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import struct
import subprocess
import termios
import threading
import time
from collections import deque

from dsec.agent import args, execop
from dsec.agent.protocol import CHUNK
from dsec.agent.wire import KIND_ERR, KIND_OUT, AgentError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

RING = 1 << 20  # bytes kept per stream
MAX_EXITED = 128  # finished processes kept in the table
DRAIN_AFTER_EXIT_S = 0.5


class Output:
    """Chunks of stdout and stderr with one global sequence number, bounded per stream."""

    def __init__(self) -> None:
        self.seq = 0
        self.streams: dict[int, deque[tuple[int, bytes]]] = {KIND_OUT: deque(), KIND_ERR: deque()}
        self.sizes = {KIND_OUT: 0, KIND_ERR: 0}

    def add(self, kind: int, data: bytes) -> None:
        if len(data) > RING:
            data = data[-RING:]
        self.seq += 1
        chunks = self.streams[kind]
        chunks.append((self.seq, data))
        self.sizes[kind] += len(data)
        while self.sizes[kind] > RING:
            _, old = chunks.popleft()
            self.sizes[kind] -= len(old)

    def since(self, cursor: int) -> list[tuple[int, int, bytes]]:
        """Chunks newer than ``cursor`` as ``(seq, kind, data)``, oldest first."""
        out: list[tuple[int, int, bytes]] = []
        for kind, chunks in self.streams.items():
            for seq, data in reversed(chunks):
                if seq <= cursor:
                    break
                out.append((seq, kind, data))
        out.sort()
        return out


class Proc:
    """One started process (or PTY) and its output."""

    def __init__(self, popen: subprocess.Popen[bytes], cmd: Any, tag: Any, master: int) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.cmd = cmd
        self.tag = tag
        self.master = master  # the PTY master, or -1
        self.started_at = time.time()
        self.output = Output()
        self.cond = threading.Condition()
        self.eof = False
        self.exited_at = 0.0
        self.input_lock = threading.Lock()
        self.stdin_fd = master if master >= 0 else popen.stdin.fileno() if popen.stdin else -1

    @property
    def pty(self) -> bool:
        return self.master >= 0

    @property
    def running(self) -> bool:
        return self.popen.returncode is None

    def finished(self) -> bool:
        """Exited, and its output is drained (or leftovers kept it open for too long)."""
        if not self.exited_at:
            return False
        return self.eof or time.monotonic() > self.exited_at + DRAIN_AFTER_EXIT_S

    def exit_fields(self) -> dict[str, Any]:
        code = self.popen.returncode
        return {"exit_code": None, "signal": None} if code is None else execop.exit_fields(code)

    def info(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "cmd": self.cmd,
            "tag": self.tag,
            "pty": self.pty,
            "running": self.running,
            "exit_code": self.exit_fields()["exit_code"],
            "started_at": self.started_at,
        }

    def write_input(self, data: bytes | bytearray) -> None:
        with self.input_lock:
            fd = self.stdin_fd
            if fd < 0 or not self.running:
                raise AgentError("invalid_state", f"the input of process {self.pid} is closed")
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as exc:
                raise AgentError("invalid_state", f"process {self.pid}: {exc.strerror}") from None

    def close_input(self) -> None:
        """Close stdin; a PTY gets end-of-file (^D) instead."""
        if self.pty:
            if self.running:
                self.write_input(b"\x04")
            return
        self._close_stdin()

    def resize(self, cols: Any, rows: Any) -> None:
        if not self.pty:
            raise AgentError("invalid_argument", f"process {self.pid} has no terminal")
        set_winsize(self.master, *_size(cols, rows))

    def signal(self, sig: int) -> None:
        if not self.running:
            raise AgentError("invalid_state", f"process {self.pid} has exited")
        try:
            os.killpg(self.pid, sig)
        except OSError:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                raise AgentError("process_not_found", f"process {self.pid} is gone") from None

    def _record(self, kind: int, data: bytes) -> None:
        with self.cond:
            self.output.add(kind, data)
            self.cond.notify_all()

    def read_loop(self) -> None:
        """Reader thread: pipes or the PTY master into :attr:`output` until end of file."""
        fds = {self.master: KIND_OUT} if self.pty else {}
        if not self.pty:
            assert self.popen.stdout is not None
            assert self.popen.stderr is not None
            fds = {self.popen.stdout.fileno(): KIND_OUT, self.popen.stderr.fileno(): KIND_ERR}
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        while fds:
            for fd, _ in poller.poll():
                try:
                    data = os.read(fd, CHUNK)
                except OSError as exc:
                    if exc.errno != errno.EIO:  # EIO: the PTY's last slave closed
                        raise
                    data = b""
                if data:
                    self._record(fds[fd], data)
                else:
                    poller.unregister(fd)
                    del fds[fd]
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def wait_loop(self) -> None:
        """Waiter thread: record the exit, then release the pipes and the PTY."""
        self.popen.wait()
        with self.cond:
            self.exited_at = time.monotonic()
            self.cond.notify_all()
        deadline = time.monotonic() + DRAIN_AFTER_EXIT_S
        with self.cond:
            while not self.eof and time.monotonic() < deadline:
                self.cond.wait(0.1)
        self._close_stdin()

    def _close_stdin(self) -> None:
        with self.input_lock:
            if self.popen.stdin is not None and self.stdin_fd >= 0:
                self.stdin_fd = -1
                try:
                    self.popen.stdin.close()
                except OSError:
                    pass


def _size(cols: Any, rows: Any) -> tuple[int, int]:
    for v in (cols, rows):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 65536:
            raise args.bad("a terminal size is two positive integers (cols, rows)")
    return cols, rows


def set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_terminal() -> None:
    """In the child, after setsid: make the PTY on fd 0 the controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def start(req: dict[str, Any]) -> Proc:
    """Start the process described by a ``process.start`` request."""
    from dsec.agent import users

    argv, original = args.cmd(req)
    spec = args.user(req)
    user = users.resolve(spec)
    env = users.child_env(user, args.env(req), explicit_user=spec is not None)
    cwd = args.check_text(users.resolve_cwd(args.opt_str(req, "cwd"), user), "'cwd'")
    tag = req.get("tag")
    if tag is not None and not isinstance(tag, str):
        raise args.bad("'tag' must be a string")
    pty = req.get("pty")
    if pty is not None and not isinstance(pty, dict):
        raise args.bad("'pty' must be an object {cols, rows}")
    kwargs = users.spawn_kwargs(user, spec is not None)
    master = slave = -1
    try:
        if pty is not None:
            env.setdefault("TERM", "xterm-256color")
            master, slave = os.openpty()
            os.set_inheritable(master, False)
            set_winsize(slave, *_size(pty.get("cols", 80), pty.get("rows", 24)))
            stdio: dict[str, Any] = {"stdin": slave, "stdout": slave, "stderr": slave}
            kwargs["preexec_fn"] = _take_terminal
        else:
            stdio = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        popen = subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True, **stdio, **kwargs)
    except (OSError, subprocess.SubprocessError) as exc:
        if master >= 0:
            os.close(master)
        if isinstance(exc, OSError) and (exc.filename == cwd or not os.path.isdir(cwd)):
            raise AgentError("not_found", f"working directory {cwd}: {exc.strerror}") from None
        code = "not_found" if isinstance(exc, FileNotFoundError) else "invalid_argument"
        raise AgentError(code, f"cannot start {argv[0]}: {exc}") from None
    finally:
        if slave >= 0:
            os.close(slave)
    proc = Proc(popen, original, tag, master)
    for loop in (proc.read_loop, proc.wait_loop):
        threading.Thread(target=loop, daemon=True).start()
    return proc


class Table:
    """All processes chronus started, by pid."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: dict[int, Proc] = {}

    def add(self, proc: Proc) -> None:
        with self.lock:
            self.procs[proc.pid] = proc
            done = [p for p in self.procs.values() if not p.running]
            for old in done[: max(0, len(done) - MAX_EXITED)]:
                self.procs.pop(old.pid, None)
                if old.master >= 0:
                    os.close(old.master)
                    old.master = -1

    def get(self, pid: Any) -> Proc:
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise args.bad("'pid' must be an integer")
        with self.lock:
            proc = self.procs.get(pid)
        if proc is None:
            raise AgentError("process_not_found", f"no process {pid} was started here")
        return proc

    def list(self) -> list[dict[str, Any]]:
        with self.lock:
            return [p.info() for p in self.procs.values()]

    def kill_all(self) -> None:
        """Terminate every running process (chronus is stopping)."""
        with self.lock:
            running = [p for p in self.procs.values() if p.running]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in running:
                try:
                    os.killpg(p.pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + 1.0
            while any(p.running for p in running) and time.monotonic() < deadline:
                time.sleep(0.02)
