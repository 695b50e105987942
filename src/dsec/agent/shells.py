"""chronus's shell sessions: long-lived bash (else sh) processes that keep cwd, env and jobs.

Each run writes a small script to the shell's stdin::

    __dsec_run() { eval "$1"; }; trap 'return 130' INT
    [export K='v'] [cd -- 'cwd' &&] __dsec_run '<cmd>' </dev/null
    __dsec_rc=$?; printf '__dsec_%s_%d__\\n' NONCE "$__dsec_rc"; (the same on stderr)

The command runs inside a function so that SIGINT (the timeout) makes the trap return from
it, even out of a loop the shell runs itself, and the session lives on. The marker (with a
fresh random nonce) ends the command's output on each stream, so output stays byte-exact
with no newline added; its digits are the exit code. When the marker does not come one
second after SIGINT, the processes the command started get SIGKILL; one second after that
the whole session is killed. A shell that exits (``exit 3``) answers its own exit code and
the next run starts a new session.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import threading
import time

from dsec.agent import args, execop, users
from dsec.agent.protocol import CHUNK
from dsec.agent.wire import KIND_ERR, KIND_OUT, AgentError, Conn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

GRACE_S = 1.0  # between SIGINT, SIGKILL of the command's processes, and killing the session
DRAIN_AFTER_EXIT_S = 0.3
NAME_RE = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PRELUDE = "__dsec_run() { eval \"$1\"; }; trap 'return 130' INT\n"


def quote(text: str) -> str:
    """Single-quote ``text`` for the shell."""
    return "'" + text.replace("'", "'\\''") + "'"


def find_shell() -> list[str]:
    for path in ("/bin/bash", "/usr/bin/bash", "/usr/local/bin/bash"):
        if os.access(path, os.X_OK):
            return [path, "--noprofile", "--norc"]
    return ["/bin/sh"]


def descendants(root: int) -> set[int]:
    """Pids of every process below ``root`` (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


class _Run:
    """The output of one command: passes bytes on until each stream's marker arrives."""

    def __init__(self, nonce: str) -> None:
        self.prefix = f"__dsec_{nonce}_".encode()
        self.pending = {KIND_OUT: bytearray(), KIND_ERR: bytearray()}
        self.done = {KIND_OUT: False, KIND_ERR: False}
        self.ready: list[tuple[int, bytes]] = []
        self.code: int | None = None

    def complete(self) -> bool:
        return self.done[KIND_OUT] and self.done[KIND_ERR]

    def feed(self, kind: int, data: bytes) -> None:
        if self.done[kind]:
            return  # after the marker: a background job's output, dropped
        buf = self.pending[kind]
        buf += data
        i = buf.find(self.prefix)
        if i < 0:
            keep = len(self.prefix) - 1  # a marker may start in the tail
            if len(buf) > keep:
                self._emit(kind, buf[:-keep])
                del buf[:-keep]
            return
        self._emit(kind, buf[:i])
        del buf[:i]
        end = buf.find(b"__\n", len(self.prefix))
        if end < 0:
            return
        digits = bytes(buf[len(self.prefix) : end])
        buf.clear()
        self.done[kind] = True
        if kind == KIND_OUT:
            self.code = int(digits) if digits.isdigit() else 1

    def _emit(self, kind: int, data: bytearray) -> None:
        if data:
            self.ready.append((kind, bytes(data)))

    def flush(self) -> None:
        """The shell died: whatever is held back is output after all."""
        for kind, buf in self.pending.items():
            self._emit(kind, buf)
            buf.clear()


class Session:
    """One shell process, its output reader and its exit waiter."""

    def __init__(self, name: str, req: dict[str, Any]) -> None:
        self.name = name
        self.user_spec = args.user(req)
        user = users.resolve(self.user_spec)
        self.uid = user.uid
        env = users.child_env(user, {}, explicit_user=self.user_spec is not None)
        try:
            self.popen = subprocess.Popen(
                find_shell(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=users.default_cwd(user),
                env=env,
                start_new_session=True,
                **users.spawn_kwargs(user, self.user_spec is not None),
            )
        except OSError as exc:
            raise AgentError("internal", f"cannot start a shell: {exc}") from None
        self.pid = self.popen.pid
        self.cond = threading.Condition()
        self.sink: _Run | None = None
        self.eof = 0  # streams at end of file
        self.busy = threading.Lock()
        threading.Thread(target=self._read_loop, daemon=True).start()
        threading.Thread(target=self._wait_loop, daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.popen.returncode is None

    def info(self) -> dict[str, Any]:
        try:
            cwd: str | None = os.readlink(f"/proc/{self.pid}/cwd")
        except OSError:
            cwd = None
        return {"name": self.name, "pid": self.pid, "cwd": cwd, "busy": self.busy.locked()}

    def _read_loop(self) -> None:
        assert self.popen.stdout is not None
        assert self.popen.stderr is not None
        fds = {self.popen.stdout.fileno(): KIND_OUT, self.popen.stderr.fileno(): KIND_ERR}
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        while fds:
            for fd, _ in poller.poll():
                data = os.read(fd, CHUNK)
                with self.cond:
                    if data:
                        if self.sink is not None:
                            self.sink.feed(fds[fd], data)
                    else:
                        poller.unregister(fd)
                        del fds[fd]
                        self.eof += 1
                    self.cond.notify_all()

    def _wait_loop(self) -> None:
        self.popen.wait()
        with self.cond:
            self.cond.notify_all()

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass

    def run(self, conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
        """Run one command and stream its output to ``conn``; see the module docstring."""
        cmd = args.req_str(req, "cmd")
        args.check_text(cmd, "'cmd'")
        script = self._script(cmd, req)
        timeout = args.opt_timeout(req)
        if not self.busy.acquire(blocking=False):
            raise AgentError("invalid_state", f"shell session {self.name!r} is busy")
        try:
            nonce = os.urandom(12).hex()
            sink = _Run(nonce)
            before = descendants(self.pid)
            with self.cond:
                self.sink = sink
            try:
                assert self.popen.stdin is not None
                os.write(self.popen.stdin.fileno(), script.replace("NONCE", nonce).encode())
            except OSError:
                pass  # the shell is gone: the loop below reports its exit
            return self._follow(conn, sink, timeout, before)
        finally:
            with self.cond:
                self.sink = None
            self.busy.release()

    def _script(self, cmd: str, req: dict[str, Any]) -> str:
        lines = [PRELUDE]
        for key, value in args.env(req).items():
            if not ENV_NAME_RE.fullmatch(key):
                raise args.bad(f"invalid environment variable name {key!r}")
            lines.append(f"export {key}={quote(value)}\n")
        cwd = args.opt_str(req, "cwd")
        cd = "cd -- " + quote(args.check_text(cwd, "'cwd'")) + " && " if cwd else ""
        lines.append(f"{cd}__dsec_run {quote(cmd)} </dev/null\n")
        mark = "printf '__dsec_%s_%d__\\n' NONCE \"$__dsec_rc\""
        lines.append(f"__dsec_rc=$?; {mark}; {mark} >&2\n")
        return "".join(lines)

    def _follow(
        self, conn: Conn, sink: _Run, timeout: float | None, before: set[int]
    ) -> dict[str, Any]:
        next_step = time.monotonic() + timeout if timeout else None
        step = 0  # 0 running, 1 SIGINT sent, 2 SIGKILL sent to its processes, 3 session killed
        exited_at = 0.0
        client = True
        while True:
            with self.cond:
                while True:
                    now = time.monotonic()
                    if not exited_at and not self.alive:
                        exited_at = now
                    drained = exited_at and (self.eof == 2 or now > exited_at + DRAIN_AFTER_EXIT_S)
                    if drained:
                        sink.flush()
                    timers = [t for t in (next_step, exited_at) if t]
                    if exited_at:
                        timers[-1] += DRAIN_AFTER_EXIT_S
                    if sink.ready or sink.complete() or drained or any(now >= t for t in timers):
                        break
                    self.cond.wait(min(timers) - now if timers else None)
                ready, sink.ready = sink.ready, []
                complete = sink.complete()  # decided together with the output taken
            for kind, data in ready:
                if client:
                    try:
                        conn.send(kind, data)
                    except OSError:
                        client = False  # the caller left; the command still finishes
            if complete:
                return {"exit_code": sink.code, "timed_out": step > 0}
            if drained:
                assert self.popen.returncode is not None
                code = execop.exit_fields(self.popen.returncode)["exit_code"]
                return {"exit_code": code, "timed_out": step > 0, "session_ended": True}
            if next_step is not None and time.monotonic() >= next_step:
                step += 1
                next_step = time.monotonic() + GRACE_S
                if step == 1:
                    _signal_group(self.pid, signal.SIGINT)
                elif step == 2:
                    for pid in descendants(self.pid) - before:
                        _signal(pid, signal.SIGKILL)
                else:
                    self.kill()
                    next_step = None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


class Sessions:
    """Named sessions; a session whose shell has exited is replaced on the next run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: dict[str, Session] = {}

    def _name(self, req: dict[str, Any]) -> str:
        name = req.get("session") or "default"
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise args.bad("'session' must be 1-128 letters, digits or _.:@-")
        return name

    def run(self, conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
        name = self._name(req)
        with self.lock:
            session = self.sessions.get(name)
            if session is not None and not session.alive and not session.busy.locked():
                session = None
            if session is None:
                session = self.sessions[name] = Session(name, req)
        spec = args.user(req)
        if spec is not None and users.resolve(spec).uid != session.uid:
            raise args.bad(f"session {name!r} runs as uid {session.uid}; close it to switch")
        result = session.run(conn, req)
        if result.pop("session_ended", False):
            with self.lock:
                if self.sessions.get(name) is session:
                    del self.sessions[name]
        return result

    def list(self) -> list[dict[str, Any]]:
        with self.lock:
            return [s.info() for s in self.sessions.values() if s.alive]

    def close(self, req: dict[str, Any]) -> None:
        name = self._name(req)
        with self.lock:
            session = self.sessions.pop(name, None)
        if session is None:
            raise AgentError("not_found", f"no shell session {name!r}")
        session.kill()

    def kill_all(self) -> None:
        with self.lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for session in sessions:
            session.kill()
