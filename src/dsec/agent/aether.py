"""aether: the runtime API server inside every sandbox.

init starts it with the listening socket as ``DSEC_LISTEN_FD``. It serves one call per
connection in its own thread. Startup imports only the framing and the accept loop; each
op's module is imported the first time the op is used, which keeps an idle aether small
and lets it reach ``accept()`` quickly. ``process.*``, ``pty.*`` and ``shell.*`` are passed
through to chronus unchanged.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # no stub; `signal` would import enum
import os
import time

from dsec.agent import protocol, server, users

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from dsec.agent.server import Handler
    from dsec.agent.wire import Conn

NAME = "aether"
STARTED = time.monotonic()

# op -> (module under dsec.agent, function); imported on first use.
OPS: dict[str, tuple[str, str]] = {
    "exec": ("execop", "op_exec"),
    "files.read": ("fileops", "op_read"),
    "files.write": ("fileops", "op_write"),
    "files.stat": ("fileops", "op_stat"),
    "files.list": ("fileops", "op_list"),
    "files.mkdir": ("fileops", "op_mkdir"),
    "files.remove": ("fileops", "op_remove"),
    "files.rename": ("fileops", "op_rename"),
    "http": ("httpop", "op_http"),
    "tcp": ("tcpop", "op_tcp"),
}
FORWARDED_PREFIXES = ("process.", "pty.", "shell.")

_cache: dict[str, Handler] = {}


def op_ping(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    return {
        "version": protocol.PROTOCOL_VERSION,
        "pid": os.getpid(),
        "uptime_s": round(time.monotonic() - STARTED, 3),
    }


def op_sync(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    """Write out every filesystem's dirty data and commit their journals (``sync(2)``): the
    edge asks for it before it snapshots a microVM, so restored guests do not do it again."""
    os.sync()
    return {}


def resolve(op: str) -> Handler | None:
    """The handler of ``op``, importing its module on first use."""
    handler = _cache.get(op)
    if handler is not None:
        return handler
    if op == "ping":
        handler = op_ping
    elif op == "sync":
        handler = op_sync
    elif op.startswith(FORWARDED_PREFIXES):
        handler = _load("relay", "op_forward")
    elif op in OPS:
        handler = _load(*OPS[op])
    else:
        return None
    _cache[op] = handler
    return handler


def _load(module: str, func: str) -> Handler:
    mod = __import__(f"dsec.agent.{module}", fromlist=[func])
    handler: Handler = getattr(mod, func)
    return handler


LAZY_CHRONUS_ENV = "DSEC_AGENT_LAZY_CHRONUS"


def fork_chronus(listen_fd: int) -> None:
    """Start chronus as a fork of this interpreter (still one thread: nothing is locked),
    so no second interpreter has to start; it imports its modules while aether serves.

    The child detaches (a second fork, reaped here at once), so chronus is a child of init,
    as when started on first use. If another chronus serves, the new one just exits.
    """
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    code = 1
    try:
        os.close(listen_fd)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.setsid()
        if os.fork():
            code = 0
        else:
            os.environ.pop("DSEC_LISTEN_FD", None)
            try:  # ps tells it from aether at once
                with open("/proc/self/comm", "w") as f:
                    f.write("chronus")
            except OSError:
                pass
            from dsec.agent import chronus

            chronus.main(detach=False)
            code = 0
    finally:
        os._exit(code)


def main() -> None:
    """Serve forever on the inherited listening socket."""
    listener = server.listener_from_env()
    users.freeze_env()
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)  # never pass an ignored SIGINT on
    try:  # commands default to the home directory; starting there lets exec use vfork
        os.chdir(os.environ.get("HOME") or "/")
    except OSError:
        pass
    if not os.environ.get(LAZY_CHRONUS_ENV):  # host-run agents of tests start it on use
        fork_chronus(listener.fileno())
    server.serve(listener, resolve, NAME)


if __name__ == "__main__":
    main()
