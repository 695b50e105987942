"""Set elements of the edge's table written as one raw nf_tables netlink batch.

libnftables reads the whole table before every command (one element dump per set: seven
sets per sandbox), so filling a warm slot's sets or swapping a policy grew with the number
of sandboxes (70 ms with 300). This writes the same elements directly: one batch (flush
and add messages, atomic like an nft transaction), one acknowledgement per message.

Element encoding follows what nft sends for these set types: an ``interval`` set of IPv4
addresses holds interval starts and ``INTERVAL_END`` elements one past each end (plus an
end marker at 0.0.0.0 (::) when the first interval starts later; an interval that runs
to the last address has no end element; IPv6 keys are 16 bytes); a concatenated
``interval`` set (address . proto . port, each field in 4-byte registers) holds one
element with ``KEY`` and ``KEY_END``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END = 0x10, 0x11
NFT_MSG_NEWSETELEM, NFT_MSG_DELSETELEM = 12, 14
NLM_F_REQUEST, NLM_F_ACK, NLM_F_CREATE = 0x1, 0x4, 0x400
NLMSG_ERROR = 2
NLA_F_NESTED = 0x8000
NFPROTO_INET = 1
# attributes
LIST_TABLE, LIST_SET, LIST_ELEMENTS, LIST_ELEM = 1, 2, 3, 1
ELEM_KEY, ELEM_DATA, ELEM_FLAGS, ELEM_TIMEOUT, ELEM_USERDATA, ELEM_KEY_END = 1, 2, 3, 4, 6, 10
DATA_VALUE, DATA_VERDICT, VERDICT_CODE, VERDICT_CHAIN = 1, 2, 1, 2
NFT_JUMP = -3
IFNAMSIZ = 16
INTERVAL_END = 1
OPEN_INTERVAL_UDATA = b"\x01\x04\x01\x00\x00\x00"  # nft's marker: runs to the top
PROTO = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP}


@dataclass(frozen=True, slots=True)
class Ported:
    """One element of an ``ipv4_addr . inet_proto . inet_service`` interval set."""

    network: str
    proto: str
    port_lo: int
    port_hi: int


def _attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def _nest(kind: int, parts: Iterable[bytes]) -> bytes:
    return _attr(kind | NLA_F_NESTED, b"".join(parts))


def _key(kind: int, data: bytes) -> bytes:
    return _nest(kind, [_attr(DATA_VALUE, data)])


def interval_elements(networks: Iterable[str]) -> list[bytes]:
    """Elements of a plain interval set of one family's addresses (IPv4 or IPv6, not
    mixed); overlapping networks are merged first."""
    nets = list(ipaddress.collapse_addresses(ipaddress.ip_network(n) for n in networks))  # type: ignore[type-var]
    elems: list[bytes] = []
    if not nets:
        return elems
    width = nets[0].max_prefixlen // 8
    if int(nets[0].network_address) != 0:
        elems.append(_elem(bytes(width), flags=INTERVAL_END))
    for net in nets:
        start, end = int(net.network_address), int(net.broadcast_address) + 1
        if end == 1 << (8 * width):
            elems.append(_elem(start.to_bytes(width, "big"), udata=OPEN_INTERVAL_UDATA))
        else:
            elems.append(_elem(start.to_bytes(width, "big")))
            elems.append(_elem(end.to_bytes(width, "big"), flags=INTERVAL_END))
    return elems


def ported_elements(items: Iterable[Ported]) -> list[bytes]:
    """Elements of an ``ipv4_addr|ipv6_addr . inet_proto . inet_service`` interval set."""
    out = []
    for p in items:
        net = ipaddress.ip_network(p.network)
        proto = PROTO[p.proto].to_bytes(1, "big") + b"\0\0\0"
        lo = p.port_lo.to_bytes(2, "big") + b"\0\0"
        hi = p.port_hi.to_bytes(2, "big") + b"\0\0"
        out.append(
            _elem(
                net.network_address.packed + proto + lo,
                key_end=net.broadcast_address.packed + proto + hi,
            )
        )
    return out


def jump_elements(jumps: Iterable[tuple[str, str]]) -> list[bytes]:
    """Elements of an ``ifname : verdict`` map: (interface, chain to jump to)."""
    out = []
    for ifname, chain in jumps:
        verdict = _attr(VERDICT_CODE, struct.pack(">i", NFT_JUMP))
        verdict += _attr(VERDICT_CHAIN, chain.encode() + b"\0")
        data = _nest(ELEM_DATA, [_nest(DATA_VERDICT, [verdict])])
        out.append(_nest(LIST_ELEM, [_key(ELEM_KEY, _ifname(ifname)), data]))
    return out


def key_elements(ifnames: Iterable[str]) -> list[bytes]:
    """Keys only (for :attr:`Op.delete`) of an ``ifname`` map's elements."""
    return [_nest(LIST_ELEM, [_key(ELEM_KEY, _ifname(n))]) for n in ifnames]


def _ifname(name: str) -> bytes:
    raw = name.encode()
    if len(raw) >= IFNAMSIZ:
        raise ValueError(f"interface name too long: {name}")
    return raw + b"\0" * (IFNAMSIZ - len(raw))


def timeout_elements(addrs: Iterable[tuple[str, int]]) -> list[bytes]:
    """Elements of a ``flags timeout`` set of addresses: (address, seconds)."""
    return [_elem(ipaddress.ip_address(a).packed, timeout_ms=s * 1000) for a, s in addrs if s > 0]


def _elem(
    key: bytes,
    *,
    flags: int = 0,
    key_end: bytes = b"",
    timeout_ms: int = 0,
    udata: bytes = b"",
) -> bytes:
    parts = [_key(ELEM_KEY, key)]
    if flags:
        parts.append(_attr(ELEM_FLAGS, struct.pack(">I", flags)))
    if timeout_ms:
        parts.append(_attr(ELEM_TIMEOUT, struct.pack(">Q", timeout_ms)))
    if udata:
        parts.append(_attr(ELEM_USERDATA, udata))
    if key_end:
        parts.append(_key(ELEM_KEY_END, key_end))
    return _nest(LIST_ELEM, parts)


@dataclass(frozen=True, slots=True)
class Op:
    """Flush set ``name`` (``flush``), or add ``elements`` to it (``delete``: remove them)."""

    name: str
    elements: Sequence[bytes] = ()
    flush: bool = False
    delete: bool = False


class SetWriter:
    """A netfilter netlink socket in the namespace of the thread that made it (the
    socket keeps it, so any thread may use the writer; one at a time)."""

    def __init__(self, table: str) -> None:
        self.table = table
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self._sock.bind((0, 0))
        self._seq = 0

    def close(self) -> None:
        self._sock.close()

    def _msg(self, kind: int, flags: int, family: int, res_id: int, payload: bytes) -> bytes:
        self._seq += 1
        body = struct.pack("=BBH", family, 0, socket.htons(res_id)) + payload
        return struct.pack("=IHHII", 16 + len(body), kind, flags, self._seq, 0) + body

    def apply(self, ops: Sequence[Op]) -> None:
        """Run ``ops`` as one atomic batch.

        Raises:
            OSError: the kernel refused a message (nothing of the batch applied).
        """
        ops = [op for op in ops if op.flush or op.elements]
        if not ops:
            return
        parts = [self._msg(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 0, NFNL_SUBSYS_NFTABLES, b"")]
        seqs = set()
        head = _attr(LIST_TABLE, self.table.encode() + b"\0")
        for op in ops:
            payload = head + _attr(LIST_SET, op.name.encode() + b"\0")
            if op.flush or op.delete:
                kind, flags = NFT_MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK
                if op.delete:
                    payload += _nest(LIST_ELEMENTS, op.elements)
            else:
                kind, flags = NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE
                payload += _nest(LIST_ELEMENTS, op.elements)
            parts.append(
                self._msg(NFNL_SUBSYS_NFTABLES << 8 | kind, flags, NFPROTO_INET, 0, payload)
            )
            seqs.add(self._seq)
        parts.append(self._msg(NFNL_MSG_BATCH_END, NLM_F_REQUEST, 0, NFNL_SUBSYS_NFTABLES, b""))
        self._sock.send(b"".join(parts))
        first_error = 0
        while seqs:
            data = self._sock.recv(65536)
            off = 0
            while off + 16 <= len(data):
                size, kind, _flags, seq, _pid = struct.unpack_from("=IHHII", data, off)
                if kind == NLMSG_ERROR and seq in seqs:
                    (code,) = struct.unpack_from("=i", data, off + 16)
                    seqs.discard(seq)
                    first_error = first_error or -code
                off += max(16, (size + 3) & ~3)
        if first_error:
            raise OSError(first_error, f"nftables set elements: {os.strerror(first_error)}")
