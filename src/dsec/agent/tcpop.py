"""The ``tcp`` op: a raw TCP stream to a port inside the sandbox.

``I`` frames are written to the connection and what the server sends comes back as ``O``
frames; ``C`` half-closes the sandbox side (shutdown for writing). Once connected it sends
the event ``connected`` (so a client knows the port answered before sending). The call ends when the
server closes its side (or resets the connection), with ``{"sent": n, "received": n}``. A
server that stops reading (closes while input still comes) gets no more of it (``sent``
counts what it was given) and what it sent is still answered. It reaches the server
through the runtime channel, so the sandbox needs no network rule for it.
"""

from __future__ import annotations

import select
import socket

from dsec.agent import args
from dsec.agent.protocol import CHUNK
from dsec.agent.wire import KIND_CLOSE, KIND_IN, KIND_OUT, AgentError, Conn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CONNECT_TIMEOUT_S = 10.0


def op_tcp(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    port = args.req_int(req, "port")
    if not 1 <= port <= 65535:
        raise args.bad("'port' must be between 1 and 65535")
    up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        up.settimeout(CONNECT_TIMEOUT_S)
        up.connect(("127.0.0.1", port))  # numeric: no resolver (the bundle has no idna codec)
    except OSError as exc:
        up.close()
        raise AgentError("unavailable", f"cannot connect to port {port}: {exc.strerror}") from None
    up.settimeout(None)
    conn.event("connected")
    sent = received = 0
    reading = True  # the server still takes input
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    poller.register(up.fileno(), select.POLLIN)
    try:
        while True:
            for fd, _ in poller.poll():
                if fd == up.fileno():
                    try:
                        data = up.recv(CHUNK)
                    except ConnectionResetError:
                        data = b""
                    if not data:  # the server is done: so is the call
                        return {"sent": sent, "received": received}
                    conn.send(KIND_OUT, data)
                    received += len(data)
                    continue
                frame = conn.read_frame()
                if frame is None:
                    raise BrokenPipeError("the client closed the connection")
                kind, payload = frame
                if kind == KIND_IN and reading:
                    try:
                        up.sendall(payload)
                        sent += len(payload)
                    except (BrokenPipeError, ConnectionResetError):
                        reading = False  # it closed: what it sent before still comes
                elif kind == KIND_CLOSE:
                    if reading:
                        up.shutdown(socket.SHUT_WR)
                    poller.unregister(conn.fileno())
    finally:
        up.close()
