"""The SDK's unary calls over pooled HTTP/1.1 keep-alive connections (``http.client``).

A request through httpx (httpcore + h11) costs ~1.8 ms of client CPU on the development
machine, one through the standard library's ``http.client`` ~0.5 ms
(``bench/sdk_http.py``). Every JSON call of the blocking client (exec, create, kill, ...)
goes through this pool; uploads, downloads, port requests, WebSockets, a custom transport
(tests) and proxied URLs stay with httpx.

A connection is reused while the server keeps it open: an idle one the server closed is
seen readable and dropped before use. A request that fails while it is being sent on a
reused connection is sent once more on a new one (the server cannot have answered it);
one whose reused connection closes before any answer is sent again only if its method is
idempotent (RFC 9110 9.2.2), so a POST such as ``exec`` never runs twice.
"""

from __future__ import annotations

import http.client
import select
import ssl
import threading
import urllib.request
from collections.abc import Mapping
from urllib.parse import SplitResult, urlencode, urlsplit

from dsec.core.errors import DeadlineExceeded
from dsec.sdk.wire import CONNECT_TIMEOUT_S, Request, connection_error

MAX_IDLE = 64
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


def usable(api_url: str) -> bool:
    """Whether requests to ``api_url`` may skip httpx (http/https, no proxy configured)."""
    parts = urlsplit(api_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    proxies = urllib.request.getproxies()
    if parts.scheme not in proxies and "all" not in proxies:
        return True
    return bool(urllib.request.proxy_bypass(parts.hostname))


def endpoint(
    parts: SplitResult, tls: ssl.SSLContext | bool
) -> tuple[bool, str, int, str, ssl.SSLContext]:
    """Whether ``parts`` (an apiserver URL) is https, its host, port, path prefix, TLS context."""
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    ctx = tls if isinstance(tls, ssl.SSLContext) else ssl.create_default_context()
    return https, parts.hostname or "", port, parts.path.rstrip("/"), ctx


class Http1Pool:
    """Thread-safe pool of keep-alive connections to one apiserver."""

    def __init__(
        self, api_url: str, headers: Mapping[str, str], tls: ssl.SSLContext | bool
    ) -> None:
        parts = urlsplit(api_url)
        self._url = api_url
        self._https, self._host, self._port, self._prefix, self._tls = endpoint(parts, tls)
        self._headers = dict(headers)
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _new(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=CONNECT_TIMEOUT_S, context=self._tls
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=CONNECT_TIMEOUT_S)

    def _take(self) -> http.client.HTTPConnection | None:
        """An idle connection the server has not closed, or None."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn = self._idle.pop()
            if conn.sock is not None and not _readable(conn.sock.fileno()):
                return conn
            conn.close()  # closed by the server (or it sent something unasked)

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def request(self, req: Request, body: bytes | None) -> tuple[int, bytes]:
        """Send ``req`` and return (status, body).

        Raises:
            DeadlineExceeded: no answer within ``req.timeout`` seconds.
            Unavailable: the apiserver could not be reached.
        """
        target = self._prefix + req.path
        if req.params:
            target += "?" + urlencode(req.params)
        headers = {**self._headers, **dict(req.headers)}
        conn = self._take()
        for attempt in range(2):
            reused = conn is not None
            if conn is None:
                conn = self._new()
            sent = False
            try:
                if conn.sock is None:
                    conn.connect()
                assert conn.sock is not None
                conn.sock.settimeout(req.timeout)
                conn.request(req.method, target, body=body, headers=headers)
                sent = True
                resp = conn.getresponse()
                data = resp.read()
            except TimeoutError as exc:
                conn.close()
                if not sent:
                    raise connection_error(self._url, exc) from None
                raise DeadlineExceeded(
                    f"no answer from the apiserver at {self._url} within {req.timeout} s"
                ) from None
            except _STALE as exc:
                conn.close()
                if reused and not attempt and (not sent or req.method in IDEMPOTENT):
                    conn = None  # the server closed it meanwhile: once more, on a new one
                    continue
                raise connection_error(self._url, exc) from None
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise connection_error(self._url, exc) from None
            if resp.will_close:
                conn.close()
            else:
                self._give_back(conn)
            return resp.status, data
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _readable(fd: int) -> bool:
    """Whether ``fd`` has data or EOF waiting (poll: fds above 1023 work too)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))
