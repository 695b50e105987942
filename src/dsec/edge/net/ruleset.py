"""The nftables text of an edge's table and of each sandbox's chains and sets.

One ``inet`` table per edge, in the gateway namespace (where the veth host ends live)::

    forward (hook, prio -10): iifname vmap @egress  -> out_<k>   (per sandbox)
                              oifname vmap @ingress -> in_<k>
                              any other sandbox interface: reject / drop
    input   (hook):           from a sandbox: only its DNS queries to the resolver
    output  (hook):           to a sandbox: only replies
    prerouting (nat):         sandbox UDP and TCP :53 -> the resolver's port
    postrouting (nat):        masquerade the pool towards everything but sandboxes

``out_<k>`` checks, in order: IPv6 (reject), spoofed source (drop), deny CIDRs and deny
CIDR.proto.ports (reject: deny wins, even on established flows), established (accept),
allow CIDRs, allow CIDR.proto.ports, addresses the resolver returned for allowed names (a
set with timeouts), and rejects the rest with ICMP admin-prohibited so denied connections
fail at once; before that, a connection to another sandbox goes to that sandbox's
``inok_<k>`` (map ``peer_in``), which accepts what its ingress rules (``from:CIDR...``)
allow. ``in_<k>`` drops IPv6, accepts replies and what ``inok_<k>`` accepts, drops the
rest. Named counters per sandbox count what passed and what not.
Allow rules never cover the pool itself unless they lie inside it (:func:`outside_pool`),
and resolved addresses inside it are not added, so a sandbox reaches another sandbox only
through a rule naming it.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

from dsec.core.netpolicy import CidrRule, NetworkPolicy
from dsec.edge.net import nlsets

REJECT = "reject with icmpx type admin-prohibited"
COUNTERS = ("ok", "deny", "new_ok", "new_deny")
SETS = ("a", "d", "ap", "dp", "dns", "i", "ip")  # per sandbox: <name>_<key>


def table_name(edge_id: str) -> str:
    return "dsec_" + re.sub(r"[^A-Za-z0-9_]", "_", edge_id)[:48]


@dataclass(frozen=True, slots=True)
class TableSpec:
    family_table: str  # "inet dsec_<edge>"
    if_prefix: str  # host ends are "<prefix><key>"
    pool: str  # "10.213.0.0/16"
    dns_port: int


def base(t: TableSpec) -> str:
    """Commands creating the table (callers run it only when the table is missing)."""
    ft, pfx = t.family_table, t.if_prefix
    return f"""
add table {ft}
add map {ft} egress {{ type ifname : verdict; }}
add map {ft} ingress {{ type ifname : verdict; }}
{ensure(t)}add chain {ft} forward {{ type filter hook forward priority -10; policy accept; }}
add rule {ft} forward iifname vmap @egress
add rule {ft} forward oifname vmap @ingress
add rule {ft} forward iifname "{pfx}*" {REJECT}
add rule {ft} forward oifname "{pfx}*" drop
add chain {ft} input {{ type filter hook input priority -10; policy accept; }}
add rule {ft} input iifname "{pfx}*" ct state established,related accept
add rule {ft} input iifname "{pfx}*" meta l4proto {{ udp, tcp }} th dport {t.dns_port} accept
add rule {ft} input iifname "{pfx}*" {REJECT}
add chain {ft} output {{ type filter hook output priority -10; policy accept; }}
add rule {ft} output oifname "{pfx}*" ct state established,related accept
add rule {ft} output oifname "{pfx}*" drop
add chain {ft} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}
add rule {ft} prerouting iifname "{pfx}*" udp dport 53 redirect to :{t.dns_port}
add rule {ft} prerouting iifname "{pfx}*" tcp dport 53 redirect to :{t.dns_port}
add chain {ft} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}
add rule {ft} postrouting ip saddr {t.pool} oifname != "{pfx}*" masquerade
"""


def ensure(t: TableSpec) -> str:
    """Objects a table made by an older edge may lack ("add" leaves existing ones alone)."""
    return f"add map {t.family_table} peer_in {{ type ifname : verdict; }}\n"


def _cidr_elements(rules: list[CidrRule], ported: bool) -> list[str]:
    out = []
    for r in rules:
        if ported and r.proto:
            ports = str(r.port_lo) if r.port_lo == r.port_hi else f"{r.port_lo}-{r.port_hi}"
            out.append(f"{r.network} . {r.proto} . {ports}")
        elif not ported and not r.proto:
            out.append(r.network)
    return out


def outside_pool(rules: list[CidrRule], pool: str) -> list[CidrRule]:
    """Allow rules minus the edge's sandbox pool, unless a rule lies within the pool.

    Other sandboxes are reachable only through a rule that names them (a network inside
    the pool, e.g. a peer's ``/32``); a broad rule such as ``10.0.0.0/8`` or ``0.0.0.0/0``
    covers everything else but not them.
    """
    if not pool:
        return rules
    net_pool = ipaddress.IPv4Network(pool)
    out = []
    for r in rules:
        net = ipaddress.IPv4Network(r.network)
        if not net.overlaps(net_pool) or net.subnet_of(net_pool):
            out.append(r)
            continue
        parts = sorted(net.address_exclude(net_pool))
        out.extend(CidrRule(str(p), r.proto, r.port_lo, r.port_hi) for p in parts)
    return out


def in_pool(address: str, pool: str) -> bool:
    return bool(pool) and ipaddress.IPv4Address(address) in ipaddress.IPv4Network(pool)


def _policy_sets(policy: NetworkPolicy, pool: str) -> list[tuple[str, list[CidrRule]]]:
    """(set prefix, its rules) for the four egress and two ingress rule sets."""
    out = []
    for which, prefix in (("allow", "a"), ("deny", "d")):
        rules = policy.cidrs(which)
        if which == "allow":
            rules = outside_pool(rules, pool)
        out.append((prefix, [r for r in rules if not r.proto]))
        out.append((f"{prefix}p", [r for r in rules if r.proto]))
    ingress = policy.ingress()
    out.append(("i", [r for r in ingress if not r.proto]))
    out.append(("ip", [r for r in ingress if r.proto]))
    return out


def policy_elements(ft: str, key: str, policy: NetworkPolicy, pool: str = "") -> str:
    """Commands that fill the rule sets of sandbox ``key`` (after they were flushed)."""
    lines = []
    for prefix, rules in _policy_sets(policy, pool):
        elems = _cidr_elements(rules, ported=prefix.endswith("p"))
        if elems:
            lines.append(f"add element {ft} {prefix}_{key} {{ {', '.join(elems)} }}")
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=256)  # sandboxes of one workload tend to share a policy
def _netlink_elements(policy: NetworkPolicy, pool: str) -> tuple[tuple[str, list[bytes]], ...]:
    out = []
    for prefix, rules in _policy_sets(policy, pool):
        if prefix.endswith("p"):
            ported = [nlsets.Ported(r.network, r.proto, r.port_lo, r.port_hi) for r in rules]
            out.append((prefix, nlsets.ported_elements(ported)))
        else:
            out.append((prefix, nlsets.interval_elements(r.network for r in rules)))
    return tuple(out)


def policy_ops(
    key: str, policy: NetworkPolicy, pool: str = "", *, flush: bool = False
) -> list[nlsets.Op]:
    """The elements of :func:`policy_elements` for :class:`nlsets.SetWriter`; with
    ``flush`` every set of ``key`` is flushed first (a policy swap; the caller re-adds
    the resolved addresses that stay allowed)."""
    ops = [nlsets.Op(f"{s}_{key}", flush=True) for s in SETS] if flush else []
    ops += [nlsets.Op(f"{p}_{key}", e) for p, e in _netlink_elements(policy, pool) if e]
    return ops


def add_slot(t: TableSpec, key: str, address: str) -> str:
    """Commands making slot ``key``'s counters, sets and chains and adding its interface
    to the dispatch maps: with empty sets the chains deny everything, so a warm slot is
    already policed and a sandbox only has to fill the sets (:func:`policy_ops`)."""
    ft = t.family_table
    c = {n: f"counter name {n}_{key}" for n in COUNTERS}
    cmds = [f"add counter {ft} {n}_{key}" for n in COUNTERS]
    cidr = "type ipv4_addr; flags interval; auto-merge;"
    ported = "type ipv4_addr . inet_proto . inet_service; flags interval;"
    cmds += [
        f"add set {ft} a_{key} {{ {cidr} }}",
        f"add set {ft} d_{key} {{ {cidr} }}",
        f"add set {ft} ap_{key} {{ {ported} }}",
        f"add set {ft} dp_{key} {{ {ported} }}",
        f"add set {ft} dns_{key} {{ type ipv4_addr; flags timeout; }}",
        f"add set {ft} i_{key} {{ {cidr} }}",
        f"add set {ft} ip_{key} {{ {ported} }}",
        # ingress allow rules; also jumped to from a peer sandbox's out_ chain (peer_in)
        f"add chain {ft} inok_{key}",
        f"add rule {ft} inok_{key} ip saddr @i_{key} {c['ok']} {c['new_ok']} accept",
        f"add rule {ft} inok_{key} ip saddr . meta l4proto . th dport @ip_{key} "
        f"{c['ok']} {c['new_ok']} accept",
        f"add chain {ft} out_{key}",
        # no IPv6 at all, whatever the policy (rules are IPv4; sandboxes get no IPv6 address)
        f"add rule {ft} out_{key} meta nfproto ipv6 {c['deny']} {c['new_deny']} {REJECT}",
        f"add rule {ft} out_{key} ip saddr != {address} {c['deny']} drop",
        f"add rule {ft} out_{key} ip daddr @d_{key} {c['deny']} {c['new_deny']} {REJECT}",
        f"add rule {ft} out_{key} ip daddr . meta l4proto . th dport @dp_{key} "
        f"{c['deny']} {c['new_deny']} {REJECT}",
        f"add rule {ft} out_{key} ct state established,related {c['ok']} accept",
        f"add rule {ft} out_{key} ip daddr @a_{key} {c['ok']} {c['new_ok']} accept",
        f"add rule {ft} out_{key} ip daddr . meta l4proto . th dport @ap_{key} "
        f"{c['ok']} {c['new_ok']} accept",
        f"add rule {ft} out_{key} ip daddr @dns_{key} {c['ok']} {c['new_ok']} accept",
        # to another sandbox: its ingress rules may let this one in
        f"add rule {ft} out_{key} ip daddr {t.pool} oifname vmap @peer_in",
        f"add rule {ft} out_{key} {c['deny']} {c['new_deny']} {REJECT}",
        f"add chain {ft} in_{key}",
        f"add rule {ft} in_{key} meta nfproto ipv6 {c['deny']} {c['new_deny']} drop",
        f"add rule {ft} in_{key} ct state established,related {c['ok']} accept",
        f"add rule {ft} in_{key} jump inok_{key}",
        f"add rule {ft} in_{key} {c['deny']} {c['new_deny']} drop",
        *_dispatch(t, key),
    ]
    return "\n".join(cmds) + "\n"


def _dispatch(t: TableSpec, key: str) -> list[str]:
    ft, ifname = t.family_table, t.if_prefix + key
    return [
        f'add element {ft} egress {{ "{ifname}" : jump out_{key} }}',
        f'add element {ft} ingress {{ "{ifname}" : jump in_{key} }}',
        f'add element {ft} peer_in {{ "{ifname}" : jump inok_{key} }}',
    ]


def slot_objects(t: TableSpec, key: str) -> set[str]:
    """Names (as :meth:`EdgeNetwork._present` reports them) a current slot ``key`` has."""
    ifname = t.if_prefix + key
    names = {f"{c}_{key}" for c in ("out", "in", "inok")}
    names |= {f"{s}_{key}" for s in SETS} | {f"{n}_{key}" for n in COUNTERS}
    return names | {f"{m}:{ifname}" for m in ("egress", "ingress", "peer_in")}


def upgrade_slot(t: TableSpec, key: str, address: str, policy: NetworkPolicy) -> str:
    """One transaction bringing a slot made by an older edge up to :func:`add_slot`:
    missing objects are added, its chains are rewritten, existing set elements (and
    resolved addresses) stay, and the policy's elements are added again."""
    ft = t.family_table
    chains = ("out", "in", "inok")
    text = "".join(f"add chain {ft} {c}_{key}\n" for c in chains)
    text += "".join(f"flush chain {ft} {c}_{key}\n" for c in chains)
    return text + add_slot(t, key, address) + policy_elements(ft, key, policy, t.pool)


def remove_sandbox(t: TableSpec, key: str, present: set[str] | None = None) -> str:
    """Commands deleting sandbox ``key``; with ``present`` (the table's object names and
    map keys) only what exists is deleted, so a half-made sandbox can be removed too."""
    ft = t.family_table
    ifname = t.if_prefix + key
    cmds: list[tuple[str, str]] = [
        (f"egress:{ifname}", f'delete element {ft} egress {{ "{ifname}" }}'),
        (f"ingress:{ifname}", f'delete element {ft} ingress {{ "{ifname}" }}'),
        (f"peer_in:{ifname}", f'delete element {ft} peer_in {{ "{ifname}" }}'),
        (f"out_{key}", f"delete chain {ft} out_{key}"),
        (f"in_{key}", f"delete chain {ft} in_{key}"),
        (f"inok_{key}", f"delete chain {ft} inok_{key}"),
    ]
    cmds += [(f"{s}_{key}", f"delete set {ft} {s}_{key}") for s in SETS]
    cmds += [(f"{n}_{key}", f"delete counter {ft} {n}_{key}") for n in COUNTERS]
    names = (f"out_{key}", f"in_{key}", f"inok_{key}")
    chains = [(name, f"flush chain {ft} {name}") for name in names]
    ordered = cmds[:3] + chains + cmds[3:]
    return "\n".join(c for name, c in ordered if present is None or name in present) + "\n"
