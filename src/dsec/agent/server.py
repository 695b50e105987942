"""The accept loop shared by aether and chronus: one thread per connection, one call each.

A thread that served its call waits for the next connection (up to ``IDLE_WORKERS`` wait)
instead of exiting, so a call usually starts no thread: in a restored or forked microVM
under TCG a new thread's clone, its Python thread state and its exit are kernel and
interpreter code translated again for the first call (and a thread still exiting when a
snapshot stopped the guest finished after the restore).

A handler gets the connection and the decoded request. It either returns the result
object (sent as the final frame) or answers itself through :class:`Conn` (streamed ops)
and returns ``None``. Errors it raises are answered as error frames.

The low-level ``_socket`` and ``_thread`` are used on purpose: ``socket`` and ``threading``
add milliseconds and hundreds of KiB to aether's startup for nothing it needs here.
"""

from __future__ import annotations

import _socket
import _thread
import os
import sys
import time

from dsec.agent.wire import AgentError, Conn, ProtocolError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    Handler = Callable[[Conn, dict[str, Any]], dict[str, Any] | None]
    Resolver = Callable[[str], Handler | None]


REQUEST_TIMEOUT_S = 60.0  # a client must send its request this soon after connecting
IDLE_WORKERS = 4  # threads kept waiting for a connection after their call


def log(name: str, message: str) -> None:
    """Write one line to stderr (the container's log)."""
    try:
        os.write(2, f"{name}[{os.getpid()}]: {message}\n".encode(errors="replace"))
    except OSError:
        pass


def serve(listener: _socket.socket, resolve: Resolver, name: str) -> None:
    """Accept connections forever, each served by an idle worker thread or a new one."""
    idle: list[_Worker] = []
    guard = _thread.allocate_lock()
    while True:
        try:
            fd, _ = listener._accept()  # type: ignore[attr-defined]  # C-level accept
        except OSError as exc:  # EMFILE and friends: back off instead of spinning
            log(name, f"accept failed: {exc}")
            time.sleep(0.1)
            continue
        sock = _socket.socket(listener.family, listener.type, listener.proto, fd)
        with guard:
            worker = idle.pop() if idle else None
        if worker is None:
            _thread.start_new_thread(_work, (_Worker(sock), idle, guard, resolve, name))
        else:
            worker.sock = sock
            worker.go.release()


class _Worker:
    """A (daemon) thread's connection to serve and the lock it waits on for the next one."""

    __slots__ = ("go", "sock")

    def __init__(self, sock: _socket.socket) -> None:
        self.sock: _socket.socket | None = sock
        self.go = _thread.allocate_lock()
        self.go.acquire()  # released by serve() when it hands this worker a connection


def _work(
    worker: _Worker, idle: list[_Worker], guard: _thread.LockType, resolve: Resolver, name: str
) -> None:
    """Serve the worker's connection, then wait in ``idle`` for the next (or exit when
    enough wait already)."""
    while True:
        sock, worker.sock = worker.sock, None
        assert sock is not None
        handle(sock, resolve, name)
        with guard:
            if len(idle) >= IDLE_WORKERS:
                return
            idle.append(worker)
        worker.go.acquire()


def handle(sock: _socket.socket, resolve: Resolver, name: str) -> None:
    """Serve one call on ``sock`` and close it."""
    conn = Conn(sock)
    try:
        sock.settimeout(REQUEST_TIMEOUT_S)
        req = conn.read_request()
        sock.settimeout(None)
        handler = resolve(req["op"])
        if handler is None:
            raise AgentError("invalid_argument", f"unknown op {req['op']!r}")
        value = handler(conn, req)
        if not conn.answered:
            conn.result(value)
    except AgentError as exc:
        _answer(conn, exc.code, exc.message)
    except ProtocolError as exc:
        _answer(conn, "invalid_argument", f"protocol error: {exc}")
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass  # the client went away (or never spoke)
    except Exception as exc:
        import traceback

        log(name, "".join(traceback.format_exception(exc)).rstrip())
        _answer(conn, "internal", f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def _answer(conn: Conn, code: str, message: str) -> None:
    if conn.answered:
        return
    try:
        conn.error(code, message)
    except OSError:
        pass


def listener_from_env(var: str = "DSEC_LISTEN_FD") -> _socket.socket:
    """The listening socket inherited from init (its fd number is in ``var``)."""
    raw = os.environ.get(var, "3")
    try:
        fd = int(raw)
    except ValueError:
        sys.exit(f"{var}={raw!r} is not a file descriptor number")
    sock = _socket.socket(fileno=fd)
    os.set_inheritable(fd, False)
    return sock
