"""Blocking frame I/O for aether and chronus, JSON for frames, and the errors they answer.

One :class:`Conn` wraps one accepted connection. It reads exactly one frame at a time (no
read-ahead, so a connection can be handed on to chronus byte for byte) and writes frames
with ``sendmsg`` so data chunks are never copied into a bigger buffer.

JSON goes through the C accelerator ``_json`` directly: the ``json`` package imports ``re``
(and with it ``enum``), which would cost aether a third of its startup time.
"""

from __future__ import annotations

import _json
import _socket
import errno

from dsec.agent import protocol
from dsec.agent.protocol import (
    HEADER,
    KIND_CLOSE,
    KIND_ERR,
    KIND_IN,
    KIND_JSON,
    KIND_OUT,
    ProtocolError,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "KIND_CLOSE",
    "KIND_ERR",
    "KIND_IN",
    "KIND_JSON",
    "KIND_OUT",
    "AgentError",
    "Conn",
    "ProtocolError",
    "dumps",
    "from_oserror",
    "json_frame",
    "loads",
]

_CONSTANTS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


class _ScanContext:
    """The settings ``_json.make_scanner`` reads (those of ``json.loads`` by default)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__
    memo: dict[str, str] = {}


def _unencodable(obj: object) -> object:
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


_scan = _json.make_scanner(_ScanContext())  # type: ignore[arg-type]  # duck-typed settings
_encode = _json.make_encoder(
    None, _unencodable, _json.encode_basestring_ascii, None, ":", ",", False, False, True
)


def loads(data: bytes | bytearray) -> dict[str, Any]:
    """Decode a JSON object frame payload (as ``json.loads`` would)."""
    try:
        text = bytes(data).decode("utf-8").strip(" \t\n\r")
        obj, end = _scan(text, 0)
    except StopIteration:
        raise ProtocolError("invalid JSON frame") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError(f"invalid JSON frame: {exc}") from None
    if end != len(text):
        raise ProtocolError("invalid JSON frame: extra data")
    if not isinstance(obj, dict):
        raise ProtocolError("JSON frame must be an object")
    return obj


def dumps(obj: dict[str, Any]) -> bytes:
    """Encode compactly, ASCII-only (as ``json.dumps(separators=(",", ":"))``)."""
    return "".join(_encode(obj, 0)).encode()


def json_frame(obj: dict[str, Any]) -> bytes:
    return protocol.encode(KIND_JSON, dumps(obj))


class AgentError(Exception):
    """An error answered to the client as ``{"error": {code, message}}``.

    ``code`` is one of the wire codes of ``dsec.core.errors`` (the agent does not import
    that package: only ``dsec.agent`` is shipped in the bundle).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.ESRCH: "process_not_found",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.EEXIST: "already_exists",
    errno.EISDIR: "invalid_argument",
    errno.ENOTDIR: "invalid_argument",
    errno.ENOTEMPTY: "invalid_argument",
    errno.ENAMETOOLONG: "invalid_argument",
    errno.ELOOP: "invalid_argument",
    errno.EINVAL: "invalid_argument",
    errno.EXDEV: "invalid_argument",
    errno.ENOSPC: "payload_too_large",
    errno.EDQUOT: "payload_too_large",
    errno.EFBIG: "payload_too_large",
}


def from_oserror(exc: OSError, what: str = "") -> AgentError:
    """Translate an ``OSError`` into the wire error a client should see."""
    code = _ERRNO_CODES.get(exc.errno or 0, "internal")
    reason = exc.strerror or str(exc)
    subject = what or (str(exc.filename) if exc.filename is not None else "")
    return AgentError(code, f"{subject}: {reason}" if subject else reason)


class Conn:
    """One client connection: read frames, write frames, answer once."""

    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self.answered = False
        self._head = bytearray(HEADER.size)

    def fileno(self) -> int:
        return self.sock.fileno()

    def _recv_into(self, buf: bytearray | memoryview) -> bool:
        view = memoryview(buf)
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                if got == 0:
                    return False
                raise ProtocolError("connection closed inside a frame")
            got += n
        return True

    def read_frame(self) -> tuple[int, bytearray] | None:
        """Return the next ``(kind, payload)``, or ``None`` at a clean end of stream."""
        if not self._recv_into(self._head):
            return None
        length, kind = protocol.parse_header(bytes(self._head))
        payload = bytearray(length)
        if length and not self._recv_into(payload):
            raise ProtocolError("connection closed inside a frame")
        return kind, payload

    def read_request(self) -> dict[str, Any]:
        """Read the first frame, which must be a JSON request with an ``op``."""
        frame = self.read_frame()
        if frame is None:
            raise ProtocolError("connection closed before the request")
        kind, payload = frame
        if kind != KIND_JSON:
            raise ProtocolError("the first frame must be a JSON request")
        req = loads(payload)
        if not isinstance(req.get("op"), str):
            raise ProtocolError("the request has no 'op'")
        return req

    def send(self, kind: int, data: bytes | bytearray | memoryview = b"") -> None:
        """Send one frame; ``data`` may be a view of a reused buffer."""
        size = len(data)
        if size > protocol.MAX_FRAME:
            raise ProtocolError(f"frame of {size} bytes exceeds {protocol.MAX_FRAME}")
        head = HEADER.pack(size + 1, kind)
        if not size:
            self.sock.sendall(head)
            return
        sent = self.sock.sendmsg([head, data])
        total = len(head) + size
        if sent < total:  # a partial write: finish the rest plainly
            rest = memoryview(head + bytes(data))[sent:]
            self.sock.sendall(rest)

    def event(self, event_name: str, /, **fields: Any) -> None:
        self.sock.sendall(json_frame({"event": event_name, **fields}))

    def result(self, value: dict[str, Any] | None = None) -> None:
        try:
            frame = json_frame({"result": value or {}})
        except ProtocolError:
            raise AgentError("payload_too_large", "the result is too large for one frame") from None
        self.answered = True
        self.sock.sendall(frame)

    def error(self, code: str, message: str) -> None:
        self.answered = True
        self.sock.sendall(json_frame({"error": {"code": code, "message": message[:4000]}}))

    def close(self) -> None:
        """Shut down (waking any thread still reading) and close."""
        try:
            self.sock.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
