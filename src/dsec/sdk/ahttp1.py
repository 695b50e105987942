"""The async SDK's unary calls over pooled HTTP/1.1 keep-alive connections: the asyncio twin
of ``http1.py``, one small protocol object per connection.

A request through ``httpx.AsyncClient`` (httpcore + h11 + anyio) costs ~1.8 ms of client CPU,
one through aiohttp's client ~0.6 ms, one through this pool ~0.15 ms (``bench/cluster.py``
drives its load through it). Every JSON call of the asyncio client goes through it; uploads,
downloads, port requests, WebSockets, a custom transport (tests) and proxied URLs stay with
httpx.

The same rules as the blocking pool: an idle connection the server closed is dropped before
use; a request whose reused connection closes before any answer arrives is sent again on a
new one only if its method is idempotent (RFC 9110 9.2.2), so a POST is never sent twice.
Answers are read by ``Content-Length``, chunked, or until the server closes.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from urllib.parse import urlencode, urlsplit

from dsec.core.errors import DeadlineExceeded, InvalidArgument
from dsec.sdk.http1 import IDEMPOTENT, MAX_IDLE, endpoint
from dsec.sdk.wire import CONNECT_TIMEOUT_S, Request, connection_error

MAX_HEAD = 64 * 1024  # bytes of status line and headers
_NO_BODY = frozenset({204, 304})
_FORBIDDEN = frozenset(map(chr, [*range(0x21), 0x7F]))  # in a request target
_Answer = tuple[int, bytes, bool]  # status, body, whether the connection stays usable


class _Lost(ConnectionError):
    """The connection closed before the whole answer; ``answered``: some of it came."""

    def __init__(self, answered: bool, cause: BaseException | None) -> None:
        super().__init__(str(cause) if cause else "the server closed the connection")
        self.answered = answered


class _Conn(asyncio.Protocol):
    """One connection: a request written, its answer parsed as its bytes arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._buf = bytearray()
        self._waiter: asyncio.Future[_Answer] | None = None
        self._head: tuple[int, int, bool, bool] | None = None  # status, length, chunked, keep
        self._no_body = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():  # nothing asked: not ours to keep
            self.close()
            return
        self._buf += data
        try:
            answer = self._parse()
        except ValueError as exc:
            self.close()
            self._waiter.set_exception(_Lost(True, exc))
            return
        if answer is not None:
            self._waiter.set_result(answer)

    def eof_received(self) -> bool:
        self.closed = True
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self._waiter
        if w is None or w.done():
            return
        h = self._head
        if h is not None and h[1] < 0 and not h[2]:  # the body runs until the close
            w.set_result((h[0], bytes(self._buf), False))
        else:
            w.set_exception(_Lost(bool(self._buf) or h is not None, exc))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, payload: bytes, no_body: bool) -> _Answer:
        assert self.transport is not None
        self._buf.clear()
        self._head = None
        self._no_body = no_body
        self._waiter = self.loop.create_future()
        self.transport.write(payload)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def _parse(self) -> _Answer | None:
        buf = self._buf
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise ValueError("answer headers too long")
                return None
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            del buf[: end + 4]
            version, _, rest = lines[0].partition(" ")
            status = int(rest[:3])
            length, chunked, keep = -1, False, version == "HTTP/1.1"
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "transfer-encoding":
                    chunked = "chunked" in value.lower()
                elif name == "connection":
                    v = value.strip().lower()
                    keep = v == "keep-alive" or (keep and v != "close")
            if status < 200:  # an interim answer (we send no Expect): wait for the real one
                return self._parse()
            if self._no_body or status in _NO_BODY:
                length, chunked = 0, False
            self._head = (status, length, chunked, keep)
        status, length, chunked, keep = self._head
        if chunked:
            got = _dechunk(buf)
            return None if got is None else (status, got, keep)
        if length < 0:
            return None  # until the server closes (connection_lost)
        if len(buf) < length:
            return None
        if len(buf) > length:
            raise ValueError("the server sent more than it announced")
        return status, bytes(buf), keep


def _dechunk(buf: bytearray) -> bytes | None:
    """The body of a whole chunked answer in ``buf``, or None while more is to come."""
    out, at = bytearray(), 0
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size = int(bytes(buf[at:eol]).split(b";", 1)[0], 16)
        at = eol + 2
        if size == 0:  # trailers (ignored) up to an empty line
            end = buf.find(b"\r\n", at)
            while end > at:
                at = end + 2
                end = buf.find(b"\r\n", at)
            return None if end < 0 else bytes(out)
        if len(buf) < at + size + 2:
            return None
        out += buf[at : at + size]
        at += size + 2


class AsyncHttp1Pool:
    """Keep-alive connections to one apiserver, for one event loop at a time."""

    def __init__(
        self, api_url: str, headers: Mapping[str, str], tls: ssl.SSLContext | bool
    ) -> None:
        parts = urlsplit(api_url)
        self._url = api_url
        self._https, self._host, self._port, self._prefix, self._tls = endpoint(parts, tls)
        host = self._host if parts.port is None else f"{self._host}:{parts.port}"
        if ":" in self._host:  # an IPv6 literal
            host = f"[{self._host}]" if parts.port is None else f"[{self._host}]:{parts.port}"
        fixed = {"Host": host, "Accept-Encoding": "identity", **headers}
        self._fixed = _header_lines(fixed)
        self._idle: list[_Conn] = []

    async def _new(self) -> _Conn:
        loop = asyncio.get_running_loop()
        tls, name = (self._tls, self._host) if self._https else (None, None)
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    _Conn, self._host, self._port, ssl=tls, server_hostname=name
                ),
                CONNECT_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as exc:
            raise connection_error(self._url, exc) from None
        return conn

    def _take(self) -> _Conn | None:
        """An idle connection of this loop the server has not closed, or None."""
        loop = asyncio.get_running_loop()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.loop is loop:
                return conn
            conn.close()
        return None

    def _give_back(self, conn: _Conn) -> None:
        if len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()

    def _payload(self, req: Request, body: bytes | None) -> bytes:
        target = self._prefix + req.path
        if req.params:
            target += "?" + urlencode(req.params)
        if not _FORBIDDEN.isdisjoint(target):
            raise InvalidArgument(f"request path has a space or control character: {target!r}")
        head = f"{req.method} {target} HTTP/1.1\r\n{self._fixed}"
        if req.headers:
            head += _header_lines(dict(req.headers))
        if body is not None or req.method in ("POST", "PUT", "PATCH"):
            head += f"Content-Length: {len(body or b'')}\r\n"
        return (head + "\r\n").encode("latin-1") + (body or b"")

    async def request(self, req: Request, body: bytes | None) -> tuple[int, bytes]:
        """Send ``req`` and return (status, body).

        Raises:
            DeadlineExceeded: no answer within ``req.timeout`` seconds.
            Unavailable: the apiserver could not be reached.
        """
        payload = self._payload(req, body)
        no_body = req.method == "HEAD"
        conn = self._take()
        for attempt in range(2):
            reused = conn is not None
            if conn is None:
                conn = await self._new()
            try:
                async with asyncio.timeout(req.timeout):
                    status, data, keep = await conn.exchange(payload, no_body)
            except TimeoutError:
                conn.close()
                raise DeadlineExceeded(
                    f"no answer from the apiserver at {self._url} within {req.timeout} s"
                ) from None
            except _Lost as exc:
                conn.close()
                if reused and not attempt and not exc.answered and req.method in IDEMPOTENT:
                    conn = None  # the server closed it meanwhile: once more, on a new one
                    continue
                raise connection_error(self._url, exc) from None
            except BaseException:  # cancelled mid-answer: the connection's state is unknown
                conn.close()
                raise
            if keep and not conn.closed:
                self._give_back(conn)
            else:
                conn.close()
            return status, data
        raise AssertionError("unreachable")

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _header_lines(headers: Mapping[str, str]) -> str:
    out = ""
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0") or not name or ":" in name:
            raise InvalidArgument(f"invalid HTTP header {name!r}")
        out += f"{name}: {value}\r\n"
    return out
