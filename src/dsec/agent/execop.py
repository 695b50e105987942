"""The ``exec`` op: run a command to completion, streaming its output.

The command runs in a new session (its pid is its process group), so a timeout, a client
that goes away, or a ``{"signal": n}`` control reaches everything it started. One poll
loop multiplexes stdout, stderr, stdin, the client socket and a pidfd for the exit.
Killed commands report ``exit_code`` = 128 + signal (the shell's convention) and ``signal``.
"""

from __future__ import annotations

import errno
import os
import select
import time

from dsec.agent import args, callfiles, spawn, users
from dsec.agent.protocol import CHUNK
from dsec.agent.wire import (
    KIND_CLOSE,
    KIND_ERR,
    KIND_IN,
    KIND_JSON,
    KIND_OUT,
    AgentError,
    Conn,
    from_oserror,
    loads,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol

    class Spawner(Protocol):
        """Starts a command like :func:`spawn.spawn` (the function backend has its own)."""

        def __call__(
            self, argv: list[str], *, env: dict[str, str], cwd: str, stdin: bool,
            uid: int | None = None, gid: int | None = None, groups: tuple[int, ...] = (),
        ) -> spawn.Child: ...  # fmt: skip

    from collections.abc import Callable

    Resolver = Callable[[str | int | None], users.User]  # users.resolve or the caller's own


DRAIN_AFTER_EXIT_S = 0.5  # output still arriving from leftovers after the command exited
STDIN_HIGH_WATER = 1 << 20  # stop reading the client while this much stdin is pending


SIGKILL = 9


def start(
    req: dict[str, Any],
    *,
    stdin: bool,
    spawner: Spawner | None = None,
    resolve: Resolver = users.resolve,
) -> spawn.Child:
    """Start the command of ``req`` (``cmd, env, cwd, user``) in its own session."""
    argv, _ = args.cmd(req)
    spec = args.user(req)
    user = resolve(spec)
    env = users.child_env(user, args.env(req), explicit_user=spec is not None)
    cwd = users.resolve_cwd(args.opt_str(req, "cwd"), user)
    args.check_text(cwd, "'cwd'")
    ids = users.spawn_kwargs(user, spec is not None)
    try:
        return (spawner or spawn.spawn)(
            argv,
            env=env,
            cwd=cwd,
            stdin=stdin,
            uid=ids.get("user"),
            gid=ids.get("group"),
            groups=tuple(ids.get("extra_groups", ())),
        )
    except OSError as exc:
        if exc.filename == cwd or not os.path.isdir(cwd):
            raise AgentError("not_found", f"working directory {cwd}: {exc.strerror}") from None
        if exc.filename not in (None, argv[0]):
            raise from_oserror(exc) from None
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        raise _NotStarted(code, f"{argv[0]}: {exc.strerror}\n") from None


class _NotStarted(Exception):
    """The program could not be executed: answered like a shell would (126/127)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def exit_fields(returncode: int) -> dict[str, Any]:
    if returncode < 0:
        return {"exit_code": 128 - returncode, "signal": -returncode}
    return {"exit_code": returncode, "signal": None}


def _files_in(req: dict[str, Any], budget: list[int], resolve: Resolver) -> str:
    """Write the call's ``files``; return the directory relative paths resolve against."""
    spec = args.user(req)
    user = resolve(spec)
    cwd = users.resolve_cwd(args.opt_str(req, "cwd"), user)
    if req.get("files") is not None:
        explicit = spec is not None
        uid, gid = (user.uid, user.gid) if explicit else (os.getuid(), os.getgid())
        callfiles.write_files(req["files"], uid, gid, cwd, budget)
    return cwd


def op_exec(
    conn: Conn,
    req: dict[str, Any],
    spawner: Spawner | None = None,
    resolve: Resolver = users.resolve,
) -> dict[str, Any] | None:
    """Run ``req``'s command to completion; ``spawner`` and ``resolve`` (user lookup) are
    the function backend's own, aether's defaults otherwise."""
    timeout = args.opt_timeout(req)
    want_stdin = args.opt_bool(req, "stdin")
    outputs = callfiles.check_outputs(req)
    budget = [callfiles.MAX_BYTES]
    cwd = _files_in(req, budget, resolve) if req.get("files") is not None or outputs else ""
    started = time.monotonic()
    try:
        proc = start(req, stdin=want_stdin, spawner=spawner, resolve=resolve)
    except _NotStarted as exc:
        if want_stdin:
            _discard_input(conn)
        conn.send(KIND_ERR, exc.message.encode())
        return {"exit_code": exc.code, "signal": None, "timed_out": False, "duration_ms": 0.0}
    try:
        conn.event("started", pid=proc.pid)
        timed_out = _pump(conn, proc, want_stdin, started + timeout if timeout else 0.0)
    except BaseException:
        _kill_group(proc.pid, SIGKILL)
        proc.wait()
        raise
    finally:
        proc.close_pipes()
    # ms to the µs without round(): its float formatting and parsing were code a restored
    # microVM translated again for its first exec
    duration = int((time.monotonic() - started) * 1e6 + 0.5) / 1000
    assert proc.returncode is not None
    result = {**exit_fields(proc.returncode), "timed_out": timed_out, "duration_ms": duration}
    if outputs is not None:
        result["files"] = callfiles.read_outputs(outputs, cwd, budget)
    return result


def _discard_input(conn: Conn) -> None:
    while True:
        frame = conn.read_frame()
        if frame is None or frame[0] == KIND_CLOSE:
            return


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def _pump(conn: Conn, proc: spawn.Child, want_stdin: bool, deadline: float) -> bool:
    """Move bytes until the command exits and its output is drained; return timed_out."""
    pump = _Pump(conn, proc, want_stdin)
    try:
        return pump.run(deadline)
    finally:
        os.close(pump.pidfd)


class _Pump:
    """The poll loop of one ``exec``: output out, stdin in, controls, exit and deadline."""

    def __init__(self, conn: Conn, proc: spawn.Child, want_stdin: bool) -> None:
        self.conn = conn
        self.proc = proc
        self.poller = select.poll()
        self.outputs = {proc.stdout: KIND_OUT, proc.stderr: KIND_ERR}
        for fd in self.outputs:
            self.poller.register(fd, select.POLLIN)
        self.pidfd = proc.exit_fd()
        self.poller.register(self.pidfd, select.POLLIN)
        self.sock = conn.fileno()
        self.sock_registered = False
        self.stdin_fd = -1
        self.stdin_registered = False
        self.stdin_eof = not want_stdin
        if want_stdin and proc.stdin >= 0:
            self.stdin_fd = proc.stdin
            os.set_blocking(self.stdin_fd, False)
        self.pending = bytearray()
        self.buf = memoryview(bytearray(CHUNK))
        self.exited_at = 0.0

    def run(self, deadline: float) -> bool:
        timed_out = False
        while True:
            now = time.monotonic()
            if self.exited_at and (not self.outputs or now > self.exited_at + DRAIN_AFTER_EXIT_S):
                return timed_out
            if deadline and not timed_out and now >= deadline:
                timed_out = True
                _kill_group(self.proc.pid, SIGKILL)
            if self.exited_at:
                wait: float | None = self.exited_at + DRAIN_AFTER_EXIT_S - now
            else:
                wait = deadline - now if deadline and not timed_out else None
            self._arm()
            wait_ms = None if wait is None else max(0, int(wait * 1000) + 1)
            for fd, _ in self.poller.poll(wait_ms):
                if fd in self.outputs:
                    self._read_output(fd)
                elif fd == self.pidfd:
                    self.proc.wait()
                    self.exited_at = time.monotonic()
                    self.poller.unregister(fd)
                    self._close_stdin()
                elif fd == self.sock:
                    self._read_client()
            self._flush_stdin()

    def _arm(self) -> None:
        """Register the client socket unless too much stdin is pending, stdin for POLLOUT."""
        want_sock = len(self.pending) < STDIN_HIGH_WATER
        if want_sock != self.sock_registered:
            if want_sock:
                self.poller.register(self.sock, select.POLLIN)
            else:
                self.poller.unregister(self.sock)
            self.sock_registered = want_sock
        want_out = self.stdin_fd >= 0 and bool(self.pending)
        if want_out != self.stdin_registered:
            if want_out:
                self.poller.register(self.stdin_fd, select.POLLOUT)
            else:
                self.poller.unregister(self.stdin_fd)
            self.stdin_registered = want_out

    def _read_output(self, fd: int) -> None:
        n = os.readv(fd, [self.buf])
        if n:
            self.conn.send(self.outputs[fd], self.buf[:n])
        else:
            self.poller.unregister(fd)
            del self.outputs[fd]

    def _read_client(self) -> None:
        frame = self.conn.read_frame()
        if frame is None:  # the client went away: op_exec kills the command
            raise BrokenPipeError("the client closed the connection")
        kind, payload = frame
        if kind == KIND_IN and not self.stdin_eof:
            if self.stdin_fd >= 0:
                self.pending += payload
        elif kind == KIND_CLOSE:
            self.stdin_eof = True
        elif kind == KIND_JSON:
            ctl = loads(payload)
            if "signal" in ctl:
                _kill_group(self.proc.pid, args.signal_number(ctl["signal"]))

    def _flush_stdin(self) -> None:
        if self.stdin_fd < 0:
            return
        try:
            while self.pending:
                n = os.write(self.stdin_fd, self.pending[:CHUNK])
                del self.pending[:n]
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            self._close_stdin()
            return
        if self.stdin_eof:
            self._close_stdin()

    def _close_stdin(self) -> None:
        if self.stdin_fd < 0:
            return
        if self.stdin_registered:
            self.poller.unregister(self.stdin_fd)
            self.stdin_registered = False
        self.pending.clear()
        self.stdin_fd = -1
        try:
            os.close(self.proc.stdin)
        except OSError:
            pass
        self.proc.stdin = -1
