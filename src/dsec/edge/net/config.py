"""How an edge's sandbox networking is set up (all of it configurable, for tests too)."""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from dsec.core.errors import InvalidArgument

DEFAULT_POOL = "10.213.0.0/16"  # checked unused on the dev host; override per edge
BLOCK = 4  # each sandbox gets a /30: network, gateway (.1), sandbox (.2), broadcast
PREFIXLEN6 = 126  # and the same four addresses of pool6


@dataclass(frozen=True, slots=True)
class NetConfig:
    """Args:
    pool: private IPv4 network split into one /30 per sandbox.
    upstream_dns: "ip:port" of the resolver the edge forwards allowed names to.
    gateway_netns: path of a network namespace file to put host ends, firewall and
        resolver in (tests use one they made); None means the edge's own namespace,
        which then needs net.ipv4.ip_forward=1 (the edge does not change it).
    dns_port: the resolver's UDP port in the gateway (sandboxes' port 53 is redirected).
    state_dir: where per-sandbox records live (survive an edge restart).
    warm: how many ready networks (namespace, veth, addresses, chains) to keep in
        reserve so a create only attaches its policy; 0 makes each one on demand.
    netns_dir: where sandbox namespaces are bind-mounted; must be visible to crun.
    pool6: a unique local IPv6 network (fc00::/7, /64 or larger) split into one /126 per
        sandbox next to its /30 (same index); "" gives sandboxes no IPv6 (denied).
        :func:`edge_pool6` derives one per edge.
    """

    pool: str
    upstream_dns: str
    state_dir: Path
    netns_dir: Path
    gateway_netns: str | None = None
    dns_port: int = 53
    warm: int = 0
    pool6: str = ""

    def __post_init__(self) -> None:
        net = ipaddress.ip_network(self.pool, strict=True)
        if net.version != 4 or not net.is_private or net.prefixlen > 24:
            raise InvalidArgument(f"network pool {self.pool} must be a private IPv4 /24 or larger")
        if self.pool6:
            try:
                net6 = ipaddress.ip_network(self.pool6, strict=True)
            except ValueError:
                net6 = None
            ula = ipaddress.IPv6Network("fc00::/7")
            if not isinstance(net6, ipaddress.IPv6Network) or not net6.subnet_of(ula):
                raise InvalidArgument(f"IPv6 pool {self.pool6} must be a unique local network")
            if net6.prefixlen > 64:
                raise InvalidArgument(f"IPv6 pool {self.pool6} must be a /64 or larger")
        self.upstream()

    def upstream(self) -> tuple[str, int]:
        host, _, port = self.upstream_dns.rpartition(":")
        try:
            ipaddress.IPv4Address(host)
            return host, int(port)
        except ValueError:
            raise InvalidArgument(
                f"upstream dns must be IPv4:PORT, got {self.upstream_dns!r}"
            ) from None

    def capacity(self) -> int:
        return ipaddress.ip_network(self.pool).num_addresses // BLOCK - 1

    def addresses(self, index: int) -> tuple[str, str]:
        """(gateway, sandbox) addresses of block ``index`` (1-based)."""
        if not 1 <= index <= self.capacity():
            raise InvalidArgument(f"address block {index} outside the pool")
        base = ipaddress.ip_network(self.pool).network_address + BLOCK * index
        return str(base + 1), str(base + 2)

    def addresses6(self, index: int) -> tuple[str, str]:
        """(gateway, sandbox) IPv6 addresses of block ``index``, or ("", "") without pool6."""
        if not self.pool6:
            return "", ""
        self.addresses(index)  # the same range check
        base = ipaddress.ip_network(self.pool6).network_address + BLOCK * index
        return str(base + 1), str(base + 2)


def edge_pool6(edge_id: str) -> str:
    """A unique local /64 for an edge: fd + 40 bits of a hash of its id (RFC 4193 style)."""
    h = hashlib.sha256(edge_id.encode()).digest()[:5]
    return str(ipaddress.IPv6Network((b"\xfd" + h + b"\0" * 10, 64)))
