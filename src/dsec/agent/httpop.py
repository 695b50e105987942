"""The ``http`` op: one HTTP/1.1 exchange with a server listening inside the sandbox.

A deliberately small client (``http.client`` would pull the ``email`` package into the
agent, ~3 MiB): it sends the request with ``Connection: close``, streams the client's body
(``Content-Length`` when the caller gave one, chunked otherwise), then answers the event
``response{status, headers}`` and the decoded body as ``O`` frames.

A server that stops answering does not hold the call forever: each read from it, and each
write of the client's body to it, may wait at most ``read_timeout`` seconds (60 by default,
like common reverse proxies); past that the call fails ``deadline_exceeded`` (504 before the
response head, an aborted body after it).
"""

from __future__ import annotations

import socket

from dsec.agent import args
from dsec.agent.protocol import CHUNK
from dsec.agent.wire import KIND_CLOSE, KIND_IN, KIND_OUT, AgentError, Conn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
MAX_HEAD = 64 * 1024
MAX_HEADERS = 256
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "upgrade"})
TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _token(value: str, what: str) -> str:
    if not value or not set(value) <= TOKEN:
        raise args.bad(f"invalid {what} {value!r}")
    return value


def _no_ctl(value: str, what: str) -> str:
    if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in value):
        raise args.bad(f"{what} contains control characters")
    return value


def _request_headers(req: dict[str, Any]) -> list[tuple[str, str]]:
    raw = req.get("headers") or []
    if not isinstance(raw, list):
        raise args.bad("'headers' must be a list of [name, value] pairs")
    out = []
    for pair in raw:
        ok = isinstance(pair, list) and len(pair) == 2
        if not ok or not all(isinstance(x, str) for x in pair):
            raise args.bad("'headers' must be a list of [name, value] pairs")
        name = _token(pair[0], "header name")
        if name.lower() not in HOP_BY_HOP:
            out.append((name, _no_ctl(pair[1], f"header {name}")))
    return out


class _Reader:
    """Buffered reads from the upstream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.eof = False

    def _fill(self) -> bool:
        if self.eof:
            return False
        data = self.sock.recv(CHUNK)
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def line(self, limit: int = MAX_HEAD) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0:
                out = bytes(self.buf[: i + 1])
                del self.buf[: i + 1]
                return out
            if len(self.buf) > limit:
                raise AgentError("internal", "the upstream sent an over-long line")
            if not self._fill():
                raise AgentError("unavailable", "the upstream closed the connection early")

    def some(self, limit: int) -> bytes:
        if not self.buf and not self._fill():
            return b""
        out = bytes(self.buf[:limit])
        del self.buf[:limit]
        return out


def op_http(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    port = args.req_int(req, "port")
    if not 1 <= port <= 65535:
        raise args.bad("'port' must be between 1 and 65535")
    method = _token(args.req_str(req, "method"), "method").upper()
    path = args.req_str(req, "path")
    if not (path.startswith("/") or path == "*") or " " in path:
        raise args.bad(f"invalid request path {path!r}")
    _no_ctl(path, "the path")
    headers = _request_headers(req)
    idle = args.opt_timeout(req, "read_timeout") or READ_TIMEOUT_S
    names = {k.lower() for k, _ in headers}
    first = conn.read_frame()
    has_body = first is not None and first[0] == KIND_IN
    chunked = has_body and "content-length" not in names
    headers = [(k, v) for k, v in headers if not (chunked and k.lower() == "transfer-encoding")]
    if "host" not in names:
        headers.insert(0, ("Host", f"127.0.0.1:{port}"))
    if chunked:
        headers.append(("Transfer-Encoding", "chunked"))
    elif not has_body and "content-length" not in names and method in ("POST", "PUT", "PATCH"):
        headers.append(("Content-Length", "0"))
    headers.append(("Connection", "close"))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        up.settimeout(CONNECT_TIMEOUT_S)
        up.connect(("127.0.0.1", port))  # numeric: no resolver, no NSS
    except OSError as exc:
        up.close()
        raise AgentError("unavailable", f"cannot connect to port {port}: {exc.strerror}") from None
    try:
        up.settimeout(idle)
        up.sendall((head + "\r\n").encode("latin-1", errors="replace"))
        if has_body:
            assert first is not None
            _send_body(conn, up, first[1], chunked)
        return _relay_response(conn, _Reader(up), method)
    except TimeoutError:
        raise AgentError(
            "deadline_exceeded", f"the server on port {port} was silent for {idle:g} s"
        ) from None
    finally:
        up.close()


def _send_body(conn: Conn, up: socket.socket, first: bytearray, chunked: bool) -> None:
    """Copy the client's ``I`` frames upstream until ``C``; stop writing if upstream stops."""
    data: bytearray | None = first
    writable = True
    while True:
        if data and writable:
            try:
                if chunked:
                    up.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                else:
                    up.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                writable = False  # the server answered early; read its response
        frame = conn.read_frame()
        if frame is None:
            raise BrokenPipeError("the client closed the connection during the body")
        if frame[0] == KIND_CLOSE:
            break
        data = frame[1] if frame[0] == KIND_IN else None
    if chunked and writable:
        try:
            up.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass


def _read_head(reader: _Reader) -> tuple[int, list[list[str]]]:
    status_line = reader.line().decode("latin-1").rstrip("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise AgentError("internal", f"the upstream answered {status_line[:80]!r}, not HTTP")
    headers: list[list[str]] = []
    while True:
        line = reader.line().decode("latin-1").rstrip("\r\n")
        if not line:
            return int(parts[1]), headers
        if len(headers) >= MAX_HEADERS:
            raise AgentError("internal", "the upstream sent too many headers")
        name, _, value = line.partition(":")
        headers.append([name.strip(), value.strip()])


def _relay_response(conn: Conn, reader: _Reader, method: str) -> dict[str, Any]:
    status, headers = _read_head(reader)
    while 100 <= status < 200 and status != 101:  # skip interim answers
        status, headers = _read_head(reader)
    conn.event("response", status=status, headers=headers)
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return {}
    lower = {k.lower(): v for k, v in headers}
    if "chunked" in lower.get("transfer-encoding", "").lower():
        _relay_chunked(conn, reader)
    elif lower.get("content-length", "").strip().isdigit():
        _relay_length(conn, reader, int(lower["content-length"]))
    else:
        _relay_length(conn, reader, -1)
    return {}


def _relay_length(conn: Conn, reader: _Reader, length: int) -> None:
    while length:
        data = reader.some(CHUNK if length < 0 else min(CHUNK, length))
        if not data:
            if length > 0:
                raise AgentError("unavailable", "the upstream closed the connection mid-body")
            return
        conn.send(KIND_OUT, data)
        if length > 0:
            length -= len(data)


def _relay_chunked(conn: Conn, reader: _Reader) -> None:
    while True:
        size_line = reader.line(1024).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise AgentError("internal", "the upstream sent a bad chunk size") from None
        if size == 0:
            while reader.line().strip():  # trailers
                pass
            return
        _relay_length(conn, reader, size)
        reader.line(16)
