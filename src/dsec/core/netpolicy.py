"""Network policy rules as users write them, parsed and validated.

Rules are strings: ``CIDR`` (any port and protocol), ``CIDR:PORT[-PORT][/udp|/tcp]`` (TCP
unless ``/udp``), ``DOMAIN`` and ``*.DOMAIN`` (every subdomain, not the domain itself).
A bare address counts as a /32. ``allow`` opens, ``deny`` closes, and deny wins.
``from:CIDR[:PORT[-PORT][/udp]]`` (allow only) is an *ingress* rule: hosts in CIDR (another
sandbox, or a network routed to the edge) may open connections to this sandbox's ports.
IPv6 networks are written bare (``2001:db8::/32``) or in brackets before a port
(``[2001:db8::/32]:443``); they open something only on an edge that gives sandboxes IPv6
addresses (``--net-pool6``), elsewhere IPv6 stays denied.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, replace
from typing import Any

from dsec.core.errors import InvalidArgument

MAX_RULES = 256
INGRESS_PREFIX = "from:"
_DOMAIN_RE = re.compile(
    r"^(\*\.)?([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9])?$"
)
_PORTS_RE = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?(?:/(tcp|udp))?$")


@dataclass(frozen=True, slots=True)
class CidrRule:
    """An IPv4 or IPv6 network, optionally narrowed to a protocol and port range."""

    network: str  # "10.1.2.0/24", "2001:db8::/32"
    proto: str = ""  # "", "tcp" or "udp"; "" means every protocol and port
    port_lo: int = 0
    port_hi: int = 0
    ingress: bool = False  # "from:...": connections from ``network`` to this sandbox


@dataclass(frozen=True, slots=True)
class DomainRule:
    name: str  # lower case, no trailing dot
    wildcard: bool  # "*.name": subdomains of name


Rule = CidrRule | DomainRule


def parse_rule(text: str) -> Rule:
    """Parse one rule string.

    Raises:
        InvalidArgument: the rule is malformed (the message quotes it).
    """
    if not isinstance(text, str) or not text or len(text) > 255:
        raise InvalidArgument(f"invalid network rule {text!r}")
    s = text.strip().lower().rstrip(".")
    if s.startswith(INGRESS_PREFIX):
        rule = parse_rule(s.removeprefix(INGRESS_PREFIX))
        if not isinstance(rule, CidrRule):
            raise InvalidArgument(f"ingress rule {text!r}: expected from:CIDR[:PORT[-PORT][/udp]]")
        return replace(rule, ingress=True)
    if s.startswith("["):  # [IPv6 CIDR]:PORT...
        head, bracket, rest = s[1:].partition("]")
        sep, ports = rest[:1], rest[1:]
        if not bracket or rest[:1] not in ("", ":") or (sep and not ports):
            raise InvalidArgument(f"invalid network rule {text!r}: expected [IPv6 CIDR]:PORT")
    elif s.count(":") > 1:  # a bare IPv6 address or network: no ports without brackets
        head, sep, ports = s, "", ""
    else:
        head, sep, ports = s.partition(":")
    try:
        net = ipaddress.ip_network(head, strict=False)
    except ValueError:
        net = None
    if net is None:
        if sep or not _DOMAIN_RE.match(s) or "." not in s.removeprefix("*."):
            raise InvalidArgument(
                f"invalid network rule {text!r}: expected CIDR, CIDR:PORT[-PORT][/udp], "
                "DOMAIN or *.DOMAIN"
            )
        return DomainRule(s.removeprefix("*."), s.startswith("*."))
    if s.startswith("[") and net.version != 6:
        raise InvalidArgument(f"network rule {text!r}: brackets are for IPv6 networks")
    if not sep:
        return CidrRule(str(net))
    m = _PORTS_RE.match(ports)
    if m is None:
        raise InvalidArgument(f"invalid port in network rule {text!r}")
    lo = int(m.group(1))
    hi = int(m.group(2) or lo)
    if not (1 <= lo <= hi <= 65535):
        raise InvalidArgument(f"invalid port range in network rule {text!r}")
    return CidrRule(str(net), m.group(3) or "tcp", lo, hi)


@dataclass(frozen=True, slots=True)
class NetworkPolicy:
    """Allow and deny rules of one sandbox (kept as the user wrote them)."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.allow == () and self.deny == ():  # the usual case: no rules to check
            return
        for name in ("allow", "deny"):
            rules = getattr(self, name)
            if not isinstance(rules, tuple) or not all(isinstance(r, str) for r in rules):
                raise InvalidArgument(f"network.{name} must be a list of strings")
            if len(rules) > MAX_RULES:
                raise InvalidArgument(f"network.{name} has more than {MAX_RULES} rules")
            for r in rules:
                rule = parse_rule(r)
                if name == "deny" and isinstance(rule, CidrRule) and rule.ingress:
                    raise InvalidArgument(
                        f"network rule {r!r}: ingress rules are allow rules "
                        "(connections in are denied unless one allows them)"
                    )

    @classmethod
    def from_dict(cls, data: Any) -> NetworkPolicy:
        """From ``{"allow": [...], "deny": [...]}`` (both optional).

        Raises:
            InvalidArgument: unknown keys, wrong types or a malformed rule.
        """
        if data is None:
            return cls()
        if isinstance(data, NetworkPolicy):
            return data
        if not isinstance(data, dict):
            raise InvalidArgument("network must be an object with allow/deny lists")
        unknown = set(data) - {"allow", "deny"}
        if unknown:
            raise InvalidArgument(f"unknown network fields: {', '.join(sorted(unknown))}")
        out: dict[str, tuple[str, ...]] = {}
        for key in ("allow", "deny"):
            value = data.get(key) or []
            if not isinstance(value, list | tuple):
                raise InvalidArgument(f"network.{key} must be a list of strings")
            out[key] = tuple(value)
        return cls(allow=out["allow"], deny=out["deny"])

    def to_dict(self) -> dict[str, list[str]]:
        return {"allow": list(self.allow), "deny": list(self.deny)}

    def rules(self, which: str) -> list[Rule]:
        return [parse_rule(r) for r in (self.allow if which == "allow" else self.deny)]

    def cidrs(self, which: str) -> list[CidrRule]:
        """Egress CIDR rules."""
        return [r for r in self.rules(which) if isinstance(r, CidrRule) and not r.ingress]

    def ingress(self) -> list[CidrRule]:
        """Ingress allow rules (``from:...``)."""
        return [r for r in self.rules("allow") if isinstance(r, CidrRule) and r.ingress]

    def domains(self, which: str) -> list[DomainRule]:
        return [r for r in self.rules(which) if isinstance(r, DomainRule)]

    def name_allowed(self, qname: str) -> bool:
        """May the sandbox resolve ``qname``? Allowed by a domain rule and denied by none."""
        name = qname.lower().rstrip(".")
        return any(_matches(r, name) for r in self.domains("allow")) and not any(
            _matches(r, name) for r in self.domains("deny")
        )


def _matches(rule: DomainRule, name: str) -> bool:
    if rule.wildcard:
        return name.endswith("." + rule.name)
    return name == rule.name
