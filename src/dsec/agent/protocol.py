"""The runtime protocol: framed messages over one stream socket per call.

Every backend carries this same protocol between the edge and aether (a unix socket for
containers, vsock for VMs), and aether uses it to talk to chronus. One connection is one
call. A frame is::

    +----------------+---------+-----------------+
    | length: u32 BE | kind: 1 | payload: length-1 bytes |
    +----------------+---------+-----------------+

Kinds:

* ``J`` -- a JSON object (UTF-8). The first frame from the client is the request
  ``{"op": "...", ...args}``; later client ``J`` frames are controls such as
  ``{"resize": [cols, rows]}`` or ``{"signal": 15}``. From the server, ``J`` frames are
  events ``{"event": ...}`` and exactly one final frame: ``{"result": {...}}`` or
  ``{"error": {"code": ..., "message": ...}}``, after which the server closes, unread
  input or not: a client whose write then fails still reads the final frame.
* ``I`` -- bytes into the sandbox (stdin, upload chunks, request bodies, PTY input).
* ``C`` -- end of the client's ``I`` stream (closes stdin, finishes an upload).
* ``O`` -- bytes out of the sandbox (stdout, download chunks, response bodies, PTY output).
* ``E`` -- stderr bytes.

Only the standard library is used: this module is imported by aether and chronus inside
the sandbox as well as by the edge. ``json`` and ``typing`` are imported lazily (or only
for type checking): aether's startup time and idle memory depend on what it imports.
"""

from __future__ import annotations

import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

KIND_JSON = 0x4A  # J
KIND_IN = 0x49  # I
KIND_CLOSE = 0x43  # C
KIND_OUT = 0x4F  # O
KIND_ERR = 0x45  # E
KINDS = frozenset({KIND_JSON, KIND_IN, KIND_CLOSE, KIND_OUT, KIND_ERR})

HEADER = struct.Struct(">IB")
MAX_FRAME = 4 * 1024 * 1024  # payload bytes; data is chunked well below this
CHUNK = 256 * 1024  # preferred data chunk size

PROTOCOL_VERSION = 1


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


def encode(kind: int, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(len(payload) + 1, kind) + payload


def encode_json(obj: dict[str, Any]) -> bytes:
    import json

    return encode(KIND_JSON, json.dumps(obj, separators=(",", ":")).encode())


def decode_json(payload: bytes) -> dict[str, Any]:
    import json

    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"invalid JSON frame: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("JSON frame must be an object")
    return obj


def is_final(obj: dict[str, Any]) -> bool:
    """Whether a decoded ``J`` frame is the server's last one (``result`` or ``error``)."""
    return "result" in obj or "error" in obj


def parse_header(header: bytes) -> tuple[int, int]:
    """Return (payload length, kind) from the 5 header bytes."""
    length, kind = HEADER.unpack(header)
    if length < 1 or length - 1 > MAX_FRAME:
        raise ProtocolError(f"bad frame length {length}")
    if kind not in KINDS:
        raise ProtocolError(f"unknown frame kind {kind:#x}")
    return length - 1, kind


def result(value: dict[str, Any] | None = None) -> bytes:
    return encode_json({"result": value or {}})


def error(code: str, message: str) -> bytes:
    return encode_json({"error": {"code": code, "message": message}})


def event(name: str, **fields: Any) -> bytes:
    return encode_json({"event": name, **fields})
