"""The edge's client of a sandbox's aether: one unix-socket connection per runtime call.

``call`` sends a request (and optional stdin), collects output and events up to a limit and
returns the final frame as sent; ``open_stream`` hands back a bidirectional frame stream
for interactive calls (streamed exec, PTYs, process reattach). aether is inside the
sandbox and so untrusted: every frame is size-checked and aggregation is bounded.
Transport failures surface as ``OSError``/``asyncio.IncompleteReadError``/``ProtocolError``;
errors aether answers become :mod:`dsec.core.errors` only through :func:`raise_for_final`.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.agent import protocol
from dsec.agent.protocol import KIND_CLOSE, KIND_ERR, KIND_IN, KIND_JSON, KIND_OUT, ProtocolError
from dsec.core.errors import DeadlineExceeded, Internal, error_from_wire

DEFAULT_LIMIT = 32 * 1024 * 1024
CONNECT_RETRY_S = 5.0  # how long a socket that is not there yet (or refuses) is retried
MAX_EVENTS = 10_000
INLINE_STDIN = 64 * 1024  # sent with the request (the socket buffer takes it whole)
RECV_SIZE = 256 * 1024
_RETRY = (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN)

Frame = tuple[int, bytes]


@dataclass(frozen=True, slots=True)
class CallResult:
    """What one call produced: the final frame as sent, output bytes and events."""

    final: dict[str, Any]
    stdout: bytes = b""
    stderr: bytes = b""
    events: tuple[dict[str, Any], ...] = ()
    truncated: bool = False

    @property
    def result(self) -> dict[str, Any]:
        """The ``result`` object, raising the answered error instead (see raise_for_final)."""
        return raise_for_final(self.final)


def raise_for_final(final: dict[str, Any]) -> dict[str, Any]:
    """Return ``final["result"]`` or raise the :mod:`dsec.core.errors` error it carries."""
    err = final.get("error")
    if isinstance(err, dict):
        raise error_from_wire(str(err.get("code", "internal")), str(err.get("message", "")))
    res = final.get("result")
    if not isinstance(res, dict):
        raise Internal("the agent answered a final frame without result or error")
    return res


class AgentStream:
    """A live call: ``send`` frames in, iterate ``(kind, payload)`` frames out.

    Iteration yields every frame aether sends, the final ``J`` frame included, and stops
    after it (:attr:`final` is then set) or at end of stream.

    aether answers and closes without reading input it has no use for (a ``tcp`` port
    nobody listens on, an upload it refused, stdin a finished command never read). A
    write that fails because of that means aether is done: the input is dropped and the
    answer is still read (it is in the socket, and a bare socket's failed write leaves the
    reading side alone, unlike an asyncio transport's).
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self.input_refused = False  # aether stopped reading: later input is dropped
        self.final: dict[str, Any] | None = None

    async def send(self, kind: int, payload: bytes = b"") -> None:
        """Send one frame (``I`` data, ``C`` end of input, or a ``J`` control)."""
        if kind not in (KIND_IN, KIND_CLOSE, KIND_JSON):
            raise ProtocolError(f"a client cannot send frame kind {kind:#x}")
        for start in range(0, max(len(payload), 1), protocol.CHUNK):
            await self._write(protocol.encode(kind, payload[start : start + protocol.CHUNK]))
            if kind != KIND_IN:
                break

    async def send_json(self, obj: dict[str, Any]) -> None:
        await self._write(protocol.encode_json(obj))

    async def _write(self, data: bytes) -> None:
        if self.input_refused:
            return
        try:
            await asyncio.get_running_loop().sock_sendall(self._sock, data)
        except (BrokenPipeError, ConnectionResetError):
            self.input_refused = True  # aether answered and closed: recv() reads why

    async def _fill(self, size: int) -> bool:
        """Buffer at least ``size`` bytes; False at end of stream."""
        loop = asyncio.get_running_loop()
        while len(self._buf) < size:
            chunk = await loop.sock_recv(self._sock, RECV_SIZE)
            if not chunk:
                return False
            self._buf += chunk
        return True

    async def recv(self) -> Frame | None:
        """The next frame, or ``None`` once the final frame was received or the peer closed."""
        if self.final is not None:
            return None
        if not await self._fill(protocol.HEADER.size):
            if self._buf:
                raise ProtocolError("the agent closed the connection inside a frame")
            return None
        length, kind = protocol.parse_header(bytes(self._buf[: protocol.HEADER.size]))
        end = protocol.HEADER.size + length
        if not await self._fill(end):
            raise ProtocolError("the agent closed the connection inside a frame")
        payload = bytes(self._buf[protocol.HEADER.size : end])
        del self._buf[:end]
        if kind == KIND_JSON:
            obj = protocol.decode_json(payload)
            if protocol.is_final(obj):
                self.final = obj
        elif kind not in (KIND_OUT, KIND_ERR):
            raise ProtocolError(f"the agent sent frame kind {kind:#x}")
        return kind, payload

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Frame]:
        while (frame := await self.recv()) is not None:
            yield frame

    async def until_closed(self) -> None:
        """Wait until the agent closed its end (after its final frame: it has done with
        the call); anything still sent is dropped."""
        loop = asyncio.get_running_loop()
        self._buf.clear()
        while await loop.sock_recv(self._sock, RECV_SIZE):
            pass

    async def aclose(self) -> None:
        self._sock.close()


async def open_stream(
    path: str | Path, request: dict[str, Any], *, connect_retry_s: float = CONNECT_RETRY_S
) -> AgentStream:
    """Connect to aether at ``path`` and send ``request``; the caller drives the stream."""
    stream = AgentStream(await _connect_socket(path, connect_retry_s))
    try:
        await stream.send_json(request)
    except BaseException:
        await stream.aclose()
        raise
    return stream


async def call(
    path: str | Path,
    request: dict[str, Any],
    stdin: bytes | None = None,
    *,
    limit: int = DEFAULT_LIMIT,
    timeout: float | None = None,  # noqa: ASYNC109 (the edge passes its RPC deadline through)
) -> CallResult:
    """Run one call to completion; ``stdin`` (if given) is sent as ``I`` frames and ``C``.

    Output beyond ``limit`` bytes (stdout, stderr and events together) is dropped and
    ``truncated`` set; the call still runs to its final frame.

    Raises:
        DeadlineExceeded: no final frame within ``timeout`` seconds.
        ProtocolError: the peer broke the protocol or closed without a final frame.
    """
    try:
        async with asyncio.timeout(timeout):
            return await _call(path, request, stdin, limit)
    except TimeoutError:
        raise DeadlineExceeded(f"no answer from the agent within {timeout:g} s") from None


async def _call(
    path: str | Path, request: dict[str, Any], stdin: bytes | None, limit: int
) -> CallResult:
    """One call on a bare non-blocking socket (no transport, stream reader or tasks: this
    is every exec's path). Small stdin goes out with the request; larger stdin is sent by
    a task while the output is read, so neither side can block the other."""
    loop = asyncio.get_running_loop()
    sock = await _connect_socket(path, CONNECT_RETRY_S)
    sender: asyncio.Future[None] | None = None
    try:
        head = protocol.encode_json(request)
        if stdin is not None and len(stdin) <= INLINE_STDIN:
            head += (protocol.encode(KIND_IN, stdin) if stdin else b"") + protocol.encode(
                KIND_CLOSE
            )
            stdin = None
        await loop.sock_sendall(sock, head)
        if stdin is not None:
            sender = asyncio.ensure_future(_send_stdin_socket(sock, stdin))
        out, err = bytearray(), bytearray()
        events: list[dict[str, Any]] = []
        used, truncated = 0, False
        buf = bytearray()
        final: dict[str, Any] | None = None
        while final is None:
            chunk = await loop.sock_recv(sock, RECV_SIZE)
            if not chunk:
                raise ProtocolError("the agent closed the connection without a final frame")
            buf += chunk
            pos = 0
            while final is None and len(buf) - pos >= protocol.HEADER.size:
                length, kind = protocol.parse_header(bytes(buf[pos : pos + protocol.HEADER.size]))
                start = pos + protocol.HEADER.size
                if len(buf) - start < length:
                    break
                payload = bytes(buf[start : start + length])
                pos = start + length
                if kind == KIND_JSON:
                    obj = protocol.decode_json(payload)
                    if protocol.is_final(obj):
                        final = obj
                        break
                elif kind not in (KIND_OUT, KIND_ERR):
                    raise ProtocolError(f"the agent sent frame kind {kind:#x}")
                if used + length > limit or (kind == KIND_JSON and len(events) >= MAX_EVENTS):
                    truncated = True
                    continue
                used += length
                if kind == KIND_OUT:
                    out += payload
                elif kind == KIND_ERR:
                    err += payload
                else:
                    events.append(obj)
            del buf[:pos]
        return CallResult(final, bytes(out), bytes(err), tuple(events), truncated)
    finally:
        try:
            if sender is not None:
                sender.cancel()
                try:
                    await sender
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise
        finally:
            sock.close()


async def _connect_socket(path: str | Path, retry_s: float) -> socket.socket:
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + retry_s
    delay = 0.005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, str(path))
            return sock
        except BaseException as exc:
            sock.close()
            if not isinstance(exc, OSError) or exc.errno not in _RETRY:
                raise
            if time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.1)


async def _send_stdin_socket(sock: socket.socket, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    try:
        for start in range(0, len(data), protocol.CHUNK):
            await loop.sock_sendall(
                sock, protocol.encode(KIND_IN, data[start : start + protocol.CHUNK])
            )
        await loop.sock_sendall(sock, protocol.encode(KIND_CLOSE))
    except (ConnectionError, OSError):
        pass  # the call ended (or failed) before taking all input; its answer says why
