"""The Connect protocol (JSON codec) as the E2B SDK speaks it to envd.

Unary calls: the request body is one bare JSON message (``application/json``); success is
``200`` with one JSON message, an error is a non-200 status with ``{"code", "message"}``.
Streaming calls (``application/connect+json``): both bodies are sequences of envelopes
``[flags:1][length:4 big-endian][JSON]``; the server ends with one envelope of flags
``0x02`` holding ``{}`` or ``{"error": {...}}`` and always answers HTTP 200. Request bodies
may arrive chunked; they are read envelope by envelope, never assumed to be whole.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import StreamReader, web

from dsec.core.errors import (
    AlreadyExists,
    DeadlineExceeded,
    DsecError,
    InvalidArgument,
    InvalidState,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    QuotaExceeded,
    SandboxNotFound,
    Unauthenticated,
    Unavailable,
)

FLAG_COMPRESSED = 0x01
FLAG_END = 0x02
MAX_MESSAGE = 16 * 1024 * 1024
STREAM_TYPE = "application/connect+json"

# Connect code -> the HTTP status a unary error answers with.
HTTP_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}

_BY_CLASS: list[tuple[type[DsecError], str]] = [
    (InvalidArgument, "invalid_argument"),
    (Unauthenticated, "unauthenticated"),
    (PermissionDenied, "permission_denied"),
    (NotFound, "not_found"),
    (AlreadyExists, "already_exists"),
    (InvalidState, "failed_precondition"),
    (PayloadTooLarge, "resource_exhausted"),
    (QuotaExceeded, "resource_exhausted"),
    (DeadlineExceeded, "deadline_exceeded"),
    (Unavailable, "unavailable"),
]


class ConnectError(Exception):
    """An error to answer with a Connect ``code`` (one of :data:`HTTP_STATUS`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}


def connect_error(exc: BaseException) -> ConnectError:
    """The Connect error for an OpenDsec error (or anything else: ``internal``)."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, SandboxNotFound):  # as E2B's proxy says it: the SDK keys on the text
        return ConnectError("unavailable", f"The sandbox was not found ({exc.message})")
    if isinstance(exc, DsecError):
        for cls, code in _BY_CLASS:
            if isinstance(exc, cls):
                return ConnectError(code, exc.message)
        return ConnectError("internal", exc.message)
    return ConnectError("internal", f"{type(exc).__name__}: {exc}")


def envelope(obj: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def _decode(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data) if data else {}
    except ValueError:
        raise ConnectError("invalid_argument", "the request message is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ConnectError("invalid_argument", "the request message must be a JSON object")
    return obj


async def read_envelopes(content: StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The messages of an enveloped (possibly chunked) request body, as they arrive."""
    while True:
        try:
            head = await content.readexactly(5)
        except EOFError as exc:
            if getattr(exc, "partial", b""):
                raise ConnectError("invalid_argument", "truncated envelope header") from None
            return
        flags, length = struct.unpack(">BI", head)
        if flags & FLAG_COMPRESSED:
            raise ConnectError("unimplemented", "compressed messages are not supported")
        if length > MAX_MESSAGE:
            raise ConnectError("resource_exhausted", f"message of {length} bytes is too large")
        try:
            data = await content.readexactly(length)
        except EOFError:
            raise ConnectError("invalid_argument", "truncated envelope") from None
        if flags & FLAG_END:
            return
        yield _decode(data)


async def read_request(request: web.Request) -> dict[str, Any]:
    """The one request message of a unary or server-streaming call."""
    if request.content_type == STREAM_TYPE:
        async for msg in read_envelopes(request.content):
            return msg
        raise ConnectError("invalid_argument", "the request stream carried no message")
    if request.content_type not in ("application/json", ""):
        raise ConnectError(
            "unimplemented", f"content type {request.content_type!r} is not supported (use JSON)"
        )
    data = await request.content.read(MAX_MESSAGE + 1)
    if len(data) > MAX_MESSAGE:
        raise ConnectError("resource_exhausted", "request message too large")
    return _decode(data)


def unary_ok(obj: dict[str, Any]) -> web.Response:
    return web.json_response(obj)


def unary_error(err: ConnectError) -> web.Response:
    return web.json_response(err.to_json(), status=HTTP_STATUS.get(err.code, 500))


def timeout_s(request: web.Request) -> float | None:
    """The call's deadline from ``Connect-Timeout-Ms`` (None when absent)."""
    raw = request.headers.get("Connect-Timeout-Ms", "")
    if not raw:
        return None
    if not raw.isdigit() or len(raw) > 10:
        raise ConnectError("invalid_argument", f"invalid Connect-Timeout-Ms {raw!r}")
    return int(raw) / 1000 or None


class ServerStream:
    """The response of a streaming call: send messages, then :meth:`end` exactly once."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._resp: web.StreamResponse | None = None
        self.ended = False

    async def _prepare(self) -> web.StreamResponse:
        if self._resp is None:
            self._resp = web.StreamResponse(
                status=200, headers={"Content-Type": STREAM_TYPE, "Cache-Control": "no-store"}
            )
            self._resp.enable_chunked_encoding()
            await self._resp.prepare(self._request)
        return self._resp

    async def send(self, obj: dict[str, Any]) -> None:
        resp = await self._prepare()
        await resp.write(envelope(obj))

    async def end(self, err: ConnectError | None = None) -> web.StreamResponse:
        resp = await self._prepare()
        if not self.ended:
            self.ended = True
            await resp.write(envelope({"error": err.to_json()} if err else {}, FLAG_END))
            await resp.write_eof()
        return resp

    @property
    def started(self) -> bool:
        return self._resp is not None

    def response_or_empty(self) -> web.StreamResponse:
        """What to return from a handler whose client went away."""
        return self._resp if self._resp is not None else web.Response(status=499)

    @property
    def client_gone(self) -> bool:
        transport = self._request.transport
        return transport is None or transport.is_closing()
