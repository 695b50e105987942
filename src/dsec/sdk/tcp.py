"""Raw TCP streams to a port inside a sandbox: ``sbx.connect_tcp(port)``.

Each stream is one ``tcp`` runtime call over the runtime WebSocket (``docs/runtime-api.md``):
bytes sent become ``I`` frames, the server's bytes come back as ``O`` frames, and
``close_write`` half-closes the sandbox side. The sandbox needs no network rule for it.
:class:`TcpStream` blocks; :class:`AsyncTcpStream` is its asyncio twin, name for name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import TracebackType

from dsec.core.errors import InvalidArgument
from dsec.sdk.async_io import AsyncRuntimeSocket, AsyncTransport
from dsec.sdk.models import JSON
from dsec.sdk.streams import json_message
from dsec.sdk.sync_io import SyncRuntimeSocket, SyncTransport

CONNECTED_EVENT = "connected"


def tcp_request(port: int) -> bytes:
    """The first message of a ``tcp`` call to ``port`` (checked here, not in the sandbox)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgument(f"port must be between 1 and 65535, got {port!r}")
    return json_message({"op": "tcp", "port": port})


def _data(payload: bytes | bytearray | memoryview | str) -> bytes:
    return payload.encode() if isinstance(payload, str) else bytes(payload)


class TcpStream:
    """A connected TCP stream: ``send``, ``recv`` (``b""`` at end), ``close_write``, ``close``.

    Iterating yields what the server sends until it closes its side. After that,
    ``result`` holds the byte counts ``{"sent": n, "received": n}``.
    """

    def __init__(self, sock: SyncRuntimeSocket, port: int) -> None:
        self.port = port
        self._sock = sock
        self.result: JSON | None = None

    @classmethod
    def open(cls, transport: SyncTransport, sandbox_id: str, port: int) -> TcpStream:
        sock = transport.open_runtime(sandbox_id, tcp_request(port))
        try:
            sock.wait_event(CONNECTED_EVENT)
        except BaseException:
            sock.close()
            raise
        return cls(sock, port)

    def send(self, data: bytes | bytearray | memoryview | str) -> None:
        self._sock.send_input(_data(data))

    def recv(self) -> bytes:
        """The next bytes from the server; ``b""`` once it has closed its side."""
        event = self._sock.next_event()
        if event is None or event.kind == "exit":
            self.result = self._sock.stream.result
            return b""
        return event.data

    def close_write(self) -> None:
        """Tell the server nothing more is coming (TCP half-close); replies still arrive."""
        self._sock.close_input()

    def close(self) -> None:
        """Drop the connection (both directions)."""
        self._sock.close()

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.recv():
            yield chunk

    def __enter__(self) -> TcpStream:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncTcpStream:
    """The asyncio twin of :class:`TcpStream`."""

    def __init__(self, sock: AsyncRuntimeSocket, port: int) -> None:
        self.port = port
        self._sock = sock
        self.result: JSON | None = None

    @classmethod
    async def open(cls, transport: AsyncTransport, sandbox_id: str, port: int) -> AsyncTcpStream:
        sock = await transport.open_runtime(sandbox_id, tcp_request(port))
        try:
            await sock.wait_event(CONNECTED_EVENT)
        except BaseException:
            await sock.close()
            raise
        return cls(sock, port)

    async def send(self, data: bytes | bytearray | memoryview | str) -> None:
        await self._sock.send_input(_data(data))

    async def recv(self) -> bytes:
        """The next bytes from the server; ``b""`` once it has closed its side."""
        event = await self._sock.next_event()
        if event is None or event.kind == "exit":
            self.result = self._sock.stream.result
            return b""
        return event.data

    async def close_write(self) -> None:
        """Tell the server nothing more is coming (TCP half-close); replies still arrive."""
        await self._sock.close_input()

    async def aclose(self) -> None:
        """Drop the connection (both directions)."""
        await self._sock.close()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.recv():
            yield chunk

    async def __aenter__(self) -> AsyncTcpStream:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
