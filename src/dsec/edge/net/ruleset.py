"""The nftables text of an edge's table and of each sandbox's chains and sets.

One ``inet`` table per edge, in the gateway namespace (where the veth host ends live)::

    forward (hook, prio -10): iifname vmap @egress  -> out_<k>   (per sandbox)
                              oifname vmap @ingress -> in_<k>
                              any other sandbox interface: reject / drop
    input   (hook):           from a sandbox: only its DNS queries to the resolver
    output  (hook):           to a sandbox: only replies
    prerouting (nat):         sandbox UDP and TCP :53 -> the resolver's port
    postrouting (nat):        masquerade the pool towards everything but sandboxes

``out_<k>`` checks, in order: spoofed source (drop; without an IPv6 pool every IPv6 packet
is refused), deny CIDRs and deny CIDR.proto.ports (reject: deny wins, even on established
flows), established (accept), allow CIDRs, allow CIDR.proto.ports, addresses the resolver
returned for allowed names (a set with timeouts), and rejects the rest with ICMP
admin-prohibited so denied connections fail at once; before that, a connection to another
sandbox goes to that sandbox's ``inok_<k>`` (map ``peer_in``), which accepts what its
ingress rules (``from:CIDR...``) allow. ``in_<k>`` accepts replies and what ``inok_<k>``
accepts, drops the rest. Every set has an IPv6 twin (``a6_<k>``...; ``ip6`` rules next to
the ``ip`` ones), filled from the IPv6 rules and AAAA answers. Named counters per sandbox
count what passed and what not. NAT66 (masquerade) applies to the IPv6 pool as NAT does
to the IPv4 one; neighbour discovery between a sandbox and its gateway is allowed.
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
# per sandbox: <name>_<key>; the "6" twins exist only on an edge with an IPv6 pool (a
# smaller table for the others: libnftables reads every set before a command)
SETS = ("a", "d", "ap", "dp", "dns", "i", "ip")


def sets(v6: bool) -> tuple[str, ...]:
    return SETS + tuple(f"{n}6" for n in SETS) if v6 else SETS


def table_name(edge_id: str) -> str:
    return "dsec_" + re.sub(r"[^A-Za-z0-9_]", "_", edge_id)[:48]


@dataclass(frozen=True, slots=True)
class TableSpec:
    family_table: str  # "inet dsec_<edge>"
    if_prefix: str  # host ends are "<prefix><key>"
    pool: str  # "10.213.0.0/16"
    dns_port: int
    pool6: str = ""  # "fd..::/64"; "" = sandboxes have no IPv6


def base(t: TableSpec) -> str:
    """Commands creating the table (callers run it only when the table is missing)."""
    ft, pfx = t.family_table, t.if_prefix
    return f"""
add table {ft}
add map {ft} egress {{ type ifname : verdict; }}
add map {ft} ingress {{ type ifname : verdict; }}
add chain {ft} forward {{ type filter hook forward priority -10; policy accept; }}
add rule {ft} forward iifname vmap @egress
add rule {ft} forward oifname vmap @ingress
add rule {ft} forward iifname "{pfx}*" {REJECT}
add rule {ft} forward oifname "{pfx}*" drop
add chain {ft} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}
add rule {ft} prerouting iifname "{pfx}*" udp dport 53 redirect to :{t.dns_port}
add rule {ft} prerouting iifname "{pfx}*" tcp dport 53 redirect to :{t.dns_port}
{ensure(t)}"""


def ensure(t: TableSpec) -> str:
    """Commands bringing a table made by an older edge (or with another IPv6 pool) up to
    date: the ``peer_in`` map ("add" leaves an existing one alone) and the input, output
    and postrouting chains, rewritten in the same transaction."""
    ft, pfx = t.family_table, t.if_prefix
    nd = "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert }"
    nat6 = f'add rule {ft} postrouting ip6 saddr {t.pool6} oifname != "{pfx}*" masquerade\n'
    return f"""add map {ft} peer_in {{ type ifname : verdict; }}
add chain {ft} input {{ type filter hook input priority -10; policy accept; }}
flush chain {ft} input
add rule {ft} input iifname "{pfx}*" ct state established,related accept
add rule {ft} input iifname "{pfx}*" meta l4proto {{ udp, tcp }} th dport {t.dns_port} accept
add rule {ft} input iifname "{pfx}*" {nd} accept
add rule {ft} input iifname "{pfx}*" {REJECT}
add chain {ft} output {{ type filter hook output priority -10; policy accept; }}
flush chain {ft} output
add rule {ft} output oifname "{pfx}*" ct state established,related accept
add rule {ft} output oifname "{pfx}*" {nd} accept
add rule {ft} output oifname "{pfx}*" drop
add chain {ft} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}
flush chain {ft} postrouting
add rule {ft} postrouting ip saddr {t.pool} oifname != "{pfx}*" masquerade
{nat6 if t.pool6 else ""}"""


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
    net_pool = ipaddress.ip_network(pool)
    out = []
    for r in rules:
        net = ipaddress.ip_network(r.network)
        if net.version != net_pool.version:
            out.append(r)
            continue
        if not net.overlaps(net_pool) or net.subnet_of(net_pool):  # type: ignore[arg-type]
            out.append(r)
            continue
        parts = sorted(net.address_exclude(net_pool))  # type: ignore[arg-type]
        out.extend(CidrRule(str(p), r.proto, r.port_lo, r.port_hi) for p in parts)
    return out


def in_pool(address: str, *pools: str) -> bool:
    ip = ipaddress.ip_address(address)
    return any(p and ip in ipaddress.ip_network(p) for p in pools)


def is_v6(rule: CidrRule) -> bool:
    return ":" in rule.network


def _policy_sets(
    policy: NetworkPolicy, pool: str, pool6: str = ""
) -> list[tuple[str, list[CidrRule]]]:
    """(set prefix, its rules) for the egress and ingress rule sets, IPv4 and IPv6
    (prefixes ending in "p" hold CIDR . proto . ports; "6" marks the IPv6 twin)."""
    groups: list[tuple[str, list[CidrRule]]] = []
    for which, prefix in (("allow", "a"), ("deny", "d")):
        rules = policy.cidrs(which)
        if which == "allow":
            rules = outside_pool(outside_pool(rules, pool), pool6)
        groups.append((prefix, rules))
    groups.append(("i", policy.ingress()))
    out = []
    for prefix, rules in groups:
        for v6 in (False, True):
            sel = [r for r in rules if is_v6(r) == v6]
            six = "6" if v6 else ""
            out.append((prefix + six, [r for r in sel if not r.proto]))
            out.append((prefix + "p" + six, _merged_ported([r for r in sel if r.proto])))
    return out


def _merged_ported(rules: list[CidrRule]) -> list[CidrRule]:
    """Port rules with the port ranges of one network and protocol merged, and without
    rules another one covers: the kernel refuses overlapping elements in these sets."""
    ranges: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for r in rules:
        ranges.setdefault((r.network, r.proto), []).append((r.port_lo, r.port_hi))
    merged = []
    for (network, proto), spans in ranges.items():
        spans.sort()
        lo, hi = spans[0]
        for a, b in spans[1:]:
            if a > hi + 1:
                merged.append(CidrRule(network, proto, lo, hi))
                lo = a
            hi = max(hi, b)
        merged.append(CidrRule(network, proto, lo, hi))

    def covers(o: CidrRule, r: CidrRule) -> bool:
        inner, outer = ipaddress.ip_network(r.network), ipaddress.ip_network(o.network)
        return (
            o.proto == r.proto
            and inner.subnet_of(outer)  # type: ignore[arg-type]
            and o.port_lo <= r.port_lo
            and r.port_hi <= o.port_hi
        )

    return [r for r in merged if not any(o != r and covers(o, r) for o in merged)]


def _ported(prefix: str) -> bool:
    return prefix.removesuffix("6").endswith("p")


def policy_elements(
    ft: str, key: str, policy: NetworkPolicy, pool: str = "", pool6: str = ""
) -> str:
    """Commands that fill the rule sets of sandbox ``key`` (after they were flushed)."""
    lines = []
    for prefix, rules in _policy_sets(policy, pool, pool6):
        elems = _cidr_elements(rules, ported=_ported(prefix))
        if elems:
            lines.append(f"add element {ft} {prefix}_{key} {{ {', '.join(elems)} }}")
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=256)  # sandboxes of one workload tend to share a policy
def _netlink_elements(
    policy: NetworkPolicy, pool: str, pool6: str
) -> tuple[tuple[str, list[bytes]], ...]:
    out = []
    for prefix, rules in _policy_sets(policy, pool, pool6):
        if _ported(prefix):
            ported = [nlsets.Ported(r.network, r.proto, r.port_lo, r.port_hi) for r in rules]
            out.append((prefix, nlsets.ported_elements(ported)))
        else:
            out.append((prefix, nlsets.interval_elements(r.network for r in rules)))
    return tuple(out)


def policy_ops(
    key: str, policy: NetworkPolicy, pool: str = "", pool6: str = "", *, flush: bool = False
) -> list[nlsets.Op]:
    """The elements of :func:`policy_elements` for :class:`nlsets.SetWriter`; with
    ``flush`` every set of ``key`` is flushed first (a policy swap; the caller re-adds
    the resolved addresses that stay allowed)."""
    ops = [nlsets.Op(f"{s}_{key}", flush=True) for s in sets(bool(pool6))] if flush else []
    ops += [nlsets.Op(f"{p}_{key}", e) for p, e in _netlink_elements(policy, pool, pool6) if e]
    return ops


def add_slot(
    t: TableSpec, key: str, address: str, address6: str = "", *, dispatch: bool = True
) -> str:
    """Commands making slot ``key``'s counters, sets and chains and adding its interface
    to the dispatch maps: with empty sets the chains deny everything, so a warm slot is
    already policed and a sandbox only has to fill the sets (:func:`policy_ops`).
    Without ``address6`` (no IPv6 pool) every IPv6 packet is refused first. Without
    ``dispatch`` the map elements are left to the caller (:func:`dispatch_ops`: map
    elements in nft text make libnftables dump every set's elements first)."""
    ft = t.family_table
    c = {n: f"counter name {n}_{key}" for n in COUNTERS}
    ok = f"{c['ok']} {c['new_ok']} accept"
    deny = f"{c['deny']} {c['new_deny']} {REJECT}"
    cmds = [f"add counter {ft} {n}_{key}" for n in COUNTERS]
    families = [("ip", "ipv4_addr", "")] + ([("ip6", "ipv6_addr", "6")] if address6 else [])
    for _ip, fam, six in families:
        cidr = f"type {fam}; flags interval; auto-merge;"
        ported = f"type {fam} . inet_proto . inet_service; flags interval;"
        cmds += [
            f"add set {ft} a{six}_{key} {{ {cidr} }}",
            f"add set {ft} d{six}_{key} {{ {cidr} }}",
            f"add set {ft} ap{six}_{key} {{ {ported} }}",
            f"add set {ft} dp{six}_{key} {{ {ported} }}",
            f"add set {ft} dns{six}_{key} {{ type {fam}; flags timeout; }}",
            f"add set {ft} i{six}_{key} {{ {cidr} }}",
            f"add set {ft} ip{six}_{key} {{ {ported} }}",
        ]
    ports = "meta l4proto . th dport"
    # ingress allow rules; also jumped to from a peer sandbox's out_ chain (peer_in)
    cmds += [f"add chain {ft} inok_{key}"]
    cmds += [
        f"add rule {ft} inok_{key} {ip} saddr @i{six}_{key} {ok}\n"
        f"add rule {ft} inok_{key} {ip} saddr . {ports} @ip{six}_{key} {ok}"
        for ip, _fam, six in families
    ]
    out = [
        f"ip6 saddr != {address6} {c['deny']} drop"
        if address6
        else f"meta nfproto ipv6 {deny}",  # sandboxes without an IPv6 address: none at all
        f"ip saddr != {address} {c['deny']} drop",
    ]
    for ip, _fam, six in families:
        out += [f"{ip} daddr @d{six}_{key} {deny}", f"{ip} daddr . {ports} @dp{six}_{key} {deny}"]
    out.append(f"ct state established,related {c['ok']} accept")
    for ip, _fam, six in families:
        out += [
            f"{ip} daddr @a{six}_{key} {ok}",
            f"{ip} daddr . {ports} @ap{six}_{key} {ok}",
            f"{ip} daddr @dns{six}_{key} {ok}",
        ]
    # to another sandbox: its ingress rules may let this one in
    out.append(f"ip daddr {t.pool} oifname vmap @peer_in")
    if t.pool6 and address6:
        out.append(f"ip6 daddr {t.pool6} oifname vmap @peer_in")
    out.append(deny)
    inward = [] if address6 else [f"meta nfproto ipv6 {c['deny']} {c['new_deny']} drop"]
    inward += [
        f"ct state established,related {c['ok']} accept",
        f"jump inok_{key}",
        f"{c['deny']} {c['new_deny']} drop",
    ]
    cmds.append(f"add chain {ft} out_{key}")
    cmds += [f"add rule {ft} out_{key} {r}" for r in out]
    cmds.append(f"add chain {ft} in_{key}")
    cmds += [f"add rule {ft} in_{key} {r}" for r in inward]
    if dispatch:
        cmds += _dispatch(t, key)
    return "\n".join(cmds) + "\n"


def _dispatch(t: TableSpec, key: str) -> list[str]:
    ft, ifname = t.family_table, t.if_prefix + key
    return [
        f'add element {ft} egress {{ "{ifname}" : jump out_{key} }}',
        f'add element {ft} ingress {{ "{ifname}" : jump in_{key} }}',
        f'add element {ft} peer_in {{ "{ifname}" : jump inok_{key} }}',
    ]


MAPS = ("egress", "ingress", "peer_in")


def dispatch_ops(t: TableSpec, key: str, *, delete: bool = False) -> list[nlsets.Op]:
    """Slot ``key``'s dispatch map elements (``delete``: their removal), one op per map."""
    ifname = t.if_prefix + key
    if delete:
        return [nlsets.Op(m, nlsets.key_elements([ifname]), delete=True) for m in MAPS]
    chains = (f"out_{key}", f"in_{key}", f"inok_{key}")
    pairs = zip(MAPS, chains, strict=True)
    return [nlsets.Op(m, nlsets.jump_elements([(ifname, c)])) for m, c in pairs]


def slot_objects(t: TableSpec, key: str) -> set[str]:
    """Names (as :meth:`EdgeNetwork._present` reports them) a current slot ``key`` has."""
    ifname = t.if_prefix + key
    names = {f"{c}_{key}" for c in ("out", "in", "inok")}
    names |= {f"{s}_{key}" for s in sets(bool(t.pool6))} | {f"{n}_{key}" for n in COUNTERS}
    return names | {f"{m}:{ifname}" for m in MAPS}


def upgrade_slot(
    t: TableSpec, key: str, address: str, policy: NetworkPolicy, address6: str = ""
) -> str:
    """One transaction bringing a slot made by an older edge up to :func:`add_slot`:
    missing objects are added, its chains are rewritten, existing set elements (and
    resolved addresses) stay, and the policy's elements are added again."""
    ft = t.family_table
    chains = ("out", "in", "inok")
    text = "".join(f"add chain {ft} {c}_{key}\n" for c in chains)
    text += "".join(f"flush chain {ft} {c}_{key}\n" for c in chains)
    text += add_slot(t, key, address, address6)
    return text + policy_elements(ft, key, policy, t.pool, t.pool6)


def remove_sandbox(
    t: TableSpec, key: str, present: set[str] | None = None, *, maps: bool = True
) -> str:
    """Commands deleting sandbox ``key``; with ``present`` (the table's object names and
    map keys) only what exists is deleted, so a half-made sandbox can be removed too.
    Without ``maps`` the caller removed the map elements already (:func:`dispatch_ops`)."""
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
    cmds += [(f"{s}_{key}", f"delete set {ft} {s}_{key}") for s in sets(bool(t.pool6))]
    cmds += [(f"{n}_{key}", f"delete counter {ft} {n}_{key}") for n in COUNTERS]
    names = (f"out_{key}", f"in_{key}", f"inok_{key}")
    chains = [(name, f"flush chain {ft} {name}") for name in names]
    ordered = (cmds[:3] if maps else []) + chains + cmds[3:]
    return "\n".join(c for name, c in ordered if present is None or name in present) + "\n"
