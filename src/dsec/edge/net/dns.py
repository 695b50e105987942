"""The sandboxes' DNS resolver: answers allowed names only, and opens what it answers.

Queries arrive on one UDP socket in the gateway namespace (the firewall redirects every
sandbox's port 53 to it) and are attributed to a sandbox by source address (the firewall
drops spoofed sources). A name that the sandbox's policy allows (and does not deny) is
forwarded to the upstream resolver; the addresses in the answer (A, and AAAA when the
sandboxes have IPv6) are added to the sandbox's allow sets with the record's TTL as
timeout *before* the answer is sent, so the connection that follows is never refused.
Other names get NXDOMAIN, other opcodes and multi-question queries REFUSED; without IPv6,
AAAA records are dropped from answers.
Nothing but allowed names reaches the upstream, so DNS cannot tunnel data to arbitrary
resolvers (only to the authorities of allowed domains).

DNS over TCP (RFC 7766: two-byte length prefix, several queries per connection) is served
on the same port with the same rules, for clients that retry a truncated answer over TCP or
use TCP outright; the upstream is still asked over UDP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dnslib import QTYPE, RCODE, DNSRecord
from dnslib.dns import DNSError

from dsec.core.netpolicy import NetworkPolicy
from dsec.obs import log

_log = logging.getLogger(__name__)
UPSTREAM_TIMEOUT_S = 2.0
MAX_TTL_S = 3600
MAX_PENDING = 4096
TCP_IDLE_S = 10.0
MAX_TCP_CONNECTIONS = 256


@dataclass(frozen=True, slots=True)
class Asker:
    """The sandbox a query came from."""

    sandbox_id: str
    policy: NetworkPolicy


Lookup = Callable[[str], Asker | None]
OnAnswer = Callable[[str, str, list[tuple[str, int]]], Awaitable[None]]


class _Proto(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, tuple[str, int]], None]) -> None:
        self.on_datagram = on_datagram

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.on_datagram(data, addr)


class DnsProxy:
    """See the module docstring. Both sockets are made by the caller (in the gateway)."""

    def __init__(
        self,
        *,
        listen: socket.socket,
        upstream_sock: socket.socket,
        upstream: tuple[str, int],
        lookup: Lookup,
        on_answer: OnAnswer,
        listen_tcp: socket.socket | None = None,
        ipv6: bool = False,
    ) -> None:
        self._ipv6 = ipv6  # sandboxes have IPv6 addresses: AAAA answers open them too
        self._listen_sock = listen
        self._listen_tcp = listen_tcp
        self._tcp_server: asyncio.Server | None = None
        self._tcp_conns = 0
        self._up_sock = upstream_sock
        self._upstream = upstream
        self._lookup = lookup
        self._on_answer = on_answer
        self._pending: dict[int, asyncio.Future[DNSRecord]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.DatagramTransport | None = None
        self._client: asyncio.DatagramTransport | None = None
        self.stats = {"answered": 0, "refused": 0, "failed": 0}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._listen_sock.setblocking(False)
        self._up_sock.setblocking(False)
        self._server, _ = await loop.create_datagram_endpoint(
            lambda: _Proto(self._on_query), sock=self._listen_sock
        )
        self._client, _ = await loop.create_datagram_endpoint(
            lambda: _Proto(self._on_upstream), sock=self._up_sock
        )
        if self._listen_tcp is not None:
            self._listen_tcp.setblocking(False)
            self._tcp_server = await asyncio.start_server(self._on_tcp, sock=self._listen_tcp)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for tr in (self._server, self._client):
            if tr is not None:
                tr.close()
        if self._tcp_server is not None:
            self._tcp_server.close()

    def _on_query(self, data: bytes, addr: tuple[str, int]) -> None:
        asker = self._lookup(addr[0])
        if asker is None or len(self._tasks) >= MAX_PENDING:
            return
        task = asyncio.create_task(self._answer(data, addr, asker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_upstream(self, data: bytes, addr: tuple[str, int]) -> None:
        if addr[:2] != self._upstream:
            return
        try:
            reply = DNSRecord.parse(data)
        except (DNSError, ValueError, IndexError):
            return
        fut = self._pending.get(reply.header.id)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _send(self, reply: DNSRecord, addr: tuple[str, int]) -> None:
        if self._server is not None:
            self._server.sendto(reply.pack(), addr)

    async def _answer(self, data: bytes, addr: tuple[str, int], asker: Asker) -> None:
        reply = await self._reply(data, asker)
        if reply is not None:
            self._send(reply, addr)

    async def _on_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        asker = self._lookup(peer[0]) if peer else None
        if asker is None or self._tcp_conns >= MAX_TCP_CONNECTIONS:
            writer.close()
            return
        self._tcp_conns += 1
        try:
            while True:
                async with asyncio.timeout(TCP_IDLE_S):
                    size = int.from_bytes(await reader.readexactly(2), "big")
                    data = await reader.readexactly(size)
                reply = await self._reply(data, asker)
                if reply is None:
                    return
                packed = reply.pack()
                writer.write(len(packed).to_bytes(2, "big") + packed)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._tcp_conns -= 1
            writer.close()

    async def _reply(self, data: bytes, asker: Asker) -> DNSRecord | None:
        """The answer to one query from ``asker`` (None: not a DNS query at all)."""
        try:
            query = DNSRecord.parse(data)
        except (DNSError, ValueError, IndexError):
            return None
        if query.header.opcode != 0 or len(query.questions) != 1 or query.header.qr:
            self.stats["refused"] += 1
            return _error(query, RCODE.REFUSED)
        qname = str(query.q.qname).rstrip(".")
        if not asker.policy.name_allowed(qname):
            self.stats["refused"] += 1
            return _error(query, RCODE.NXDOMAIN)
        try:
            reply = await self._forward(query)
        except (TimeoutError, OSError) as exc:
            self.stats["failed"] += 1
            log(_log, "upstream dns failed", logging.WARNING, name=qname, err=repr(exc))
            return _error(query, RCODE.SERVFAIL)
        reply.header.id = query.header.id
        if not self._ipv6:
            reply.rr = [rr for rr in reply.rr if rr.rtype != QTYPE.AAAA]
        addrs = [
            (str(rr.rdata), max(1, min(MAX_TTL_S, rr.ttl)))
            for rr in reply.rr
            if rr.rtype in (QTYPE.A, QTYPE.AAAA)
        ]
        if addrs:
            try:
                await self._on_answer(asker.sandbox_id, qname, addrs)
            except Exception as exc:  # the sandbox may be going away
                log(_log, "opening resolved addresses failed", logging.WARNING, err=repr(exc))
                return _error(query, RCODE.SERVFAIL)
        self.stats["answered"] += 1
        return reply

    async def _forward(self, query: DNSRecord) -> DNSRecord:
        out = DNSRecord.parse(query.pack())
        qid = secrets.randbelow(65536)
        while qid in self._pending:
            qid = secrets.randbelow(65536)
        out.header.id = qid
        fut: asyncio.Future[DNSRecord] = asyncio.get_running_loop().create_future()
        self._pending[qid] = fut
        try:
            if self._client is None:
                raise OSError("resolver is not running")
            self._client.sendto(out.pack(), self._upstream)
            async with asyncio.timeout(UPSTREAM_TIMEOUT_S):
                reply = await fut
        finally:
            self._pending.pop(qid, None)
        if str(reply.q.qname).lower() != str(query.q.qname).lower():
            raise OSError("upstream answered another question")
        return reply


def _error(query: DNSRecord, rcode: int) -> DNSRecord:
    reply = query.reply()
    reply.header.rcode = rcode
    return reply
