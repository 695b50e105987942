"""chronus: keeps processes, PTYs and shell sessions alive across aether restarts.

aether forks it when it starts (or starts it on first use, when none runs). It detaches
at once (inside a container it becomes a child of init), takes an exclusive lock in the
run dir so only one instance serves, and listens on ``<run dir>/chronus.sock`` with the
same protocol as aether. On SIGTERM it kills everything it started and exits.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import threading
import time

from dsec.agent import args, procs, protocol, server
from dsec.agent.relay import run_dir
from dsec.agent.wire import KIND_CLOSE, KIND_IN, KIND_JSON, AgentError, Conn, ProtocolError, loads

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from dsec.agent.server import Handler
    from dsec.agent.shells import Sessions

NAME = "chronus"
STARTED = time.monotonic()
TABLE = procs.Table()
_sessions: Sessions | None = None  # imported on the first shell.* call (it is rarely used)
_sessions_lock = threading.Lock()
REPLAY_FRAME = protocol.CHUNK


def op_ping(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    uptime = round(time.monotonic() - STARTED, 3)
    return {"version": protocol.PROTOCOL_VERSION, "pid": os.getpid(), "uptime_s": uptime}


def op_start(conn: Conn, req: dict[str, Any]) -> dict[str, Any] | None:
    """Start a kept process; with ``follow: true`` announce ``started{pid}`` and go on as
    ``process.connect`` (one call instead of two)."""
    follow = args.opt_bool(req, "follow")
    proc = procs.start(req)
    TABLE.add(proc)
    if not follow:
        return {"pid": proc.pid}
    conn.event("started", pid=proc.pid)
    return _follow(conn, proc)


def op_list(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    return {"processes": TABLE.list()}


def op_signal(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    sig = args.signal_number(req.get("signal", 15))
    TABLE.get(req.get("pid")).signal(sig)
    return {}


def op_resize(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    TABLE.get(req.get("pid")).resize(req.get("cols"), req.get("rows"))
    return {}


def op_input(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    """``I`` frames go to stdin until ``C``; stdin stays open unless ``close`` is true."""
    proc = TABLE.get(req.get("pid"))
    close = args.opt_bool(req, "close")
    while True:
        frame = conn.read_frame()
        if frame is None or frame[0] == KIND_CLOSE:
            break
        if frame[0] == KIND_IN:
            proc.write_input(frame[1])
    if close:
        proc.close_input()
    return {}


def _control(proc: procs.Proc, frame: tuple[int, bytearray]) -> None:
    kind, payload = frame
    if kind == KIND_IN:
        proc.write_input(payload)
    elif kind == KIND_CLOSE:
        proc.close_input()
    elif kind == KIND_JSON:
        ctl = loads(payload)
        if "resize" in ctl:
            size = ctl["resize"]
            if not isinstance(size, list) or len(size) != 2:
                raise args.bad("'resize' must be [cols, rows]")
            proc.resize(size[0], size[1])
        if "signal" in ctl:
            proc.signal(args.signal_number(ctl["signal"]))


def op_connect(conn: Conn, req: dict[str, Any]) -> dict[str, Any] | None:
    """Replay the kept output, follow live output, pass input and controls on."""
    return _follow(conn, TABLE.get(req.get("pid")))


def _follow(conn: Conn, proc: procs.Proc) -> dict[str, Any] | None:
    gone = threading.Event()

    def pump_input() -> None:
        try:
            while (frame := conn.read_frame()) is not None:
                try:
                    _control(proc, frame)
                except AgentError:
                    pass  # input to a finished process, a bad resize: not fatal here
        except (OSError, ProtocolError):
            pass
        finally:
            gone.set()
            with proc.cond:
                proc.cond.notify_all()

    threading.Thread(target=pump_input, daemon=True).start()
    cursor = 0
    while True:
        with proc.cond:
            while True:
                chunks = proc.output.since(cursor)
                finished = proc.finished()
                if chunks or finished or gone.is_set():
                    break
                proc.cond.wait(0.25 if proc.exited_at else None)
        if gone.is_set():
            conn.answered = True  # nobody is listening any more
            return None
        if chunks:
            cursor = chunks[-1][0]
            _send_merged(conn, chunks)
        elif finished:
            return proc.exit_fields()


def _send_merged(conn: Conn, chunks: list[tuple[int, int, bytes]]) -> None:
    """Send chunks, joining neighbours of the same stream into frames of up to 256 KiB."""
    kind, size = chunks[0][1], 0
    parts: list[bytes] = []
    for _, k, data in chunks:
        if (k != kind or size + len(data) > REPLAY_FRAME) and parts:
            conn.send(kind, b"".join(parts))
            parts, size = [], 0
        kind = k
        parts.append(data)
        size += len(data)
    if parts:
        conn.send(kind, b"".join(parts))


def sessions() -> Sessions:
    global _sessions
    with _sessions_lock:
        if _sessions is None:
            from dsec.agent import shells

            _sessions = shells.Sessions()
        return _sessions


def op_shell_run(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    return sessions().run(conn, req)


def op_shell_list(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    return {"sessions": sessions().list()}


def op_shell_close(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    sessions().close(req)
    return {}


OPS: dict[str, Handler] = {
    "ping": op_ping,
    "process.start": op_start,
    "process.list": op_list,
    "process.signal": op_signal,
    "process.connect": op_connect,
    "process.input": op_input,
    "pty.resize": op_resize,
    "shell.run": op_shell_run,
    "shell.list": op_shell_list,
    "shell.close": op_shell_close,
}


def _stop(signum: int, frame: object) -> None:
    TABLE.kill_all()
    if _sessions is not None:
        _sessions.kill_all()
    try:
        os.unlink(os.path.join(run_dir(), "chronus.sock"))
    except OSError:
        pass
    os._exit(0)


def _ignore(signum: int, frame: object) -> None:
    pass


def listen() -> socket.socket | None:
    """Take the run dir's lock and bind the socket; ``None`` if another chronus serves."""
    rundir = run_dir()
    os.makedirs(rundir, mode=0o700, exist_ok=True)
    lock = os.open(os.path.join(rundir, "chronus.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        return None
    path = os.path.join(rundir, "chronus.sock")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(128)
    with open(os.path.join(rundir, "chronus.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")
    return sock  # the lock fd stays open (and locked) for the life of the process


def main(detach: bool = True) -> None:
    """Detach from the caller, then serve until SIGTERM."""
    if detach and os.fork():
        os._exit(0)
    sock = listen()
    if sock is None:
        return
    try:  # its name in ps (when forked from aether, its command line is aether's)
        with open("/proc/self/comm", "w") as f:
            f.write(NAME)
    except OSError:
        pass
    signal.signal(signal.SIGTERM, _stop)
    # Handled (not ignored) so that the commands chronus starts get the default back at exec;
    # an ignored SIGINT could not even be trapped by a shell session.
    signal.signal(signal.SIGHUP, _ignore)
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    server.serve(sock, OPS.get, NAME)


if __name__ == "__main__":
    main()
