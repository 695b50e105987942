"""A small HTTP/1.1 client for Firecracker's API, which listens on a unix socket.

One connection per request (Firecracker's API server is single-threaded and cheap to
connect to); JSON bodies; an error status raises :class:`FirecrackerApiError` carrying
the ``fault_message`` Firecracker answers with.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from dsec.core.errors import SandboxFailed

MAX_RESPONSE = 1 << 20


class FirecrackerApiError(SandboxFailed):
    """Firecracker refused a request (its ``fault_message`` is in the message)."""


def encode_request(method: str, path: str, body: object | None = None) -> bytes:
    payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
    head = [f"{method} {path} HTTP/1.1", "Host: localhost", "Accept: application/json"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status code and lower-cased headers of a response head (without the blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"bad header line: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def fault_of(body: bytes) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")[:500]
    if isinstance(obj, dict) and isinstance(obj.get("fault_message"), str):
        return str(obj["fault_message"])
    return json.dumps(obj)[:500]


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status, headers = parse_head(head[:-4])
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit() or int(length) > MAX_RESPONSE:
            raise ValueError(f"bad Content-Length {length!r}")
        body = await reader.readexactly(int(length))
    elif status in (204, 304) or 100 <= status < 200:
        body = b""
    else:
        body = await reader.read(MAX_RESPONSE)
    return status, body


class FirecrackerApi:
    """Requests to one Firecracker process through its ``--api-sock``."""

    def __init__(self, socket: Path, timeout_s: float = 30.0) -> None:
        self.socket = socket
        self.timeout_s = timeout_s

    async def request(self, method: str, path: str, body: object | None = None) -> Any:
        """Send one request; answer the decoded JSON body (None for 204)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                reader, writer = await asyncio.open_unix_connection(str(self.socket))
                try:
                    writer.write(encode_request(method, path, body))
                    await writer.drain()
                    status, data = await read_response(reader)
                finally:
                    writer.close()
                    try:
                        await writer.wait_closed()
                    except OSError:
                        pass
        except TimeoutError:
            raise FirecrackerApiError(
                f"firecracker API {method} {path}: no answer within {self.timeout_s:g}s"
            ) from None
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            raise FirecrackerApiError(f"firecracker API {method} {path}: {exc}") from None
        if status >= 300:
            raise FirecrackerApiError(f"firecracker API {method} {path}: {status} {fault_of(data)}")
        return json.loads(data) if data.strip() else None

    async def put(self, path: str, body: object) -> None:
        await self.request("PUT", path, body)

    async def patch(self, path: str, body: object) -> None:
        await self.request("PATCH", path, body)

    async def get(self, path: str) -> Any:
        return await self.request("GET", path)
