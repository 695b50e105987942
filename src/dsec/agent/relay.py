"""aether's side of chronus: find or start it, and pass ``process.*``/``pty.*``/``shell.*`` on.

chronus is started on first use as a detached process (it forks away, so inside a
container it becomes a child of init and outlives any aether). aether reaches it over
``<run dir>/chronus.sock`` and splices the call through byte for byte.
"""

from __future__ import annotations

import _socket
import os
import select
import socket
import sys
import threading
import time

from dsec.agent import protocol
from dsec.agent.wire import AgentError, Conn, json_frame

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

RUN_DIR_ENV = "DSEC_AGENT_RUN_DIR"
DEFAULT_RUN_DIR = "/.dsec/run"
START_TIMEOUT_S = 10.0
CHRONUS_MAIN = "from dsec.agent.chronus import main; main()"

_start_lock = threading.Lock()


def run_dir() -> str:
    """Where chronus keeps its socket, pid and lock files."""
    return os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR


def chronus_socket() -> str:
    return os.path.join(run_dir(), "chronus.sock")


def bundle_root() -> str | None:
    """The bundle directory this code runs from (``<bundle>/site/dsec/agent``), if any."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    if os.path.exists(os.path.join(root, "lib", "ld.so")):
        return root
    return None


def python_argv() -> list[str]:
    """The command that starts the agent's own interpreter (through the bundle's loader)."""
    root = bundle_root()
    if root is None:
        return [sys.executable, "-s", "-S", "-P"]
    lib = os.path.join(root, "lib")
    py = os.path.join(root, "python", "bin", "python3")
    return [os.path.join(lib, "ld.so"), "--library-path", lib, py, "-s", "-S", "-P"]


def _try_connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        return sock
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None


def spawn_chronus() -> None:
    """Start chronus; it detaches itself and the first process exits at once."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "DSEC_LISTEN_FD"}
    proc = subprocess.Popen(
        [*python_argv(), "-c", CHRONUS_MAIN],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    proc.wait(timeout=START_TIMEOUT_S)


def connect_chronus() -> socket.socket:
    """A connection to chronus, starting it first when nothing listens."""
    path = chronus_socket()
    sock = _try_connect(path)
    if sock is not None:
        return sock
    with _start_lock:
        sock = _try_connect(path)
        if sock is not None:
            return sock
        spawn_chronus()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            sock = _try_connect(path)
            if sock is not None:
                return sock
            time.sleep(0.005)
    raise AgentError("unavailable", f"chronus did not start (no socket at {path})")


def op_forward(conn: Conn, req: dict[str, Any]) -> None:
    up = connect_chronus()
    try:
        up.sendall(json_frame(req))
        if not _splice(conn.sock, up):
            raise AgentError("unavailable", "chronus closed the connection without an answer")
        conn.answered = True
    finally:
        up.close()


def _splice(client: _socket.socket, up: socket.socket) -> bool:
    """Copy bytes both ways until chronus closes; return whether it sent anything.

    chronus answers and closes without reading input it has no use for: a failed write
    to it stops the input (the caller's next write fails in turn) and its answer, already
    in the socket, is still relayed.
    """
    poller = select.poll()
    poller.register(client, select.POLLIN)
    poller.register(up, select.POLLIN)
    cfd, ufd = client.fileno(), up.fileno()
    relayed = False
    while True:
        for fd, _ in poller.poll():
            if fd == ufd:
                try:
                    data = up.recv(protocol.CHUNK)
                except ConnectionResetError:  # closed with our input unread: after its answer
                    data = b""
                if not data:
                    return relayed
                client.sendall(data)
                relayed = True
            elif fd == cfd:
                data = client.recv(protocol.CHUNK)
                if not data:  # the caller went away: so does the call
                    return True
                try:
                    up.sendall(data)
                except (BrokenPipeError, ConnectionResetError):
                    poller.unregister(cfd)
