"""aether: the runtime API server inside every sandbox.

init starts it with the listening socket as ``DSEC_LISTEN_FD``. It serves one call per
connection in its own thread. Startup imports only the framing and the accept loop; each
op's module is imported the first time the op is used, which keeps an idle aether small
and lets it reach ``accept()`` quickly. ``process.*``, ``pty.*`` and ``shell.*`` are passed
through to chronus unchanged.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # no stub; `signal` would import enum
import _thread
import os
import time

from dsec.agent import protocol, server

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


def resolve(op: str) -> Handler | None:
    """The handler of ``op``, importing its module on first use."""
    handler = _cache.get(op)
    if handler is not None:
        return handler
    if op == "ping":
        handler = op_ping
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


def start_chronus() -> None:
    """Start chronus now (if none runs), so the first ``process.*`` call finds it up.

    Run in a thread beside the accept loop; a failure is left to that first call, which
    starts chronus itself and reports why it cannot.
    """
    try:
        __import__("dsec.agent.relay", fromlist=["connect_chronus"]).connect_chronus().close()
    except Exception:
        pass


def main() -> None:
    """Serve forever on the inherited listening socket."""
    listener = server.listener_from_env()
    if not os.environ.get(LAZY_CHRONUS_ENV):  # host-run agents of tests start it on use
        _thread.start_new_thread(start_chronus, ())
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)  # never pass an ignored SIGINT on
    try:  # commands default to the home directory; starting there lets exec use vfork
        os.chdir(os.environ.get("HOME") or "/")
    except OSError:
        pass
    server.serve(listener, resolve, NAME)


if __name__ == "__main__":
    main()
