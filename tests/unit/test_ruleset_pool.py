"""Allow rules and the edge's sandbox pool: peers are reachable only by rules naming them."""

from __future__ import annotations

import ipaddress

from dsec.core.netpolicy import CidrRule
from dsec.edge.net.ruleset import in_pool, outside_pool

POOL = "10.213.0.0/16"


def _covers(rules: list[CidrRule], addr: str) -> bool:
    ip = ipaddress.IPv4Address(addr)
    return any(ip in ipaddress.IPv4Network(r.network) for r in rules)


def test_broad_rules_lose_the_pool_and_keep_the_rest() -> None:
    for broad in ("0.0.0.0/0", "10.0.0.0/8", "10.212.0.0/15"):
        rules = outside_pool([CidrRule(broad, "tcp", 80, 443)], POOL)
        assert not _covers(rules, "10.213.0.6")
        assert not _covers(rules, "10.213.255.255")
        assert _covers(rules, "10.212.0.1")
        assert all((r.proto, r.port_lo, r.port_hi) == ("tcp", 80, 443) for r in rules)
    everything = outside_pool([CidrRule("0.0.0.0/0")], POOL)
    total = sum(ipaddress.IPv4Network(r.network).num_addresses for r in everything)
    assert total == 2**32 - 2**16


def test_rules_inside_the_pool_or_elsewhere_are_kept() -> None:
    kept = [CidrRule("10.213.0.6/32", "tcp", 7000, 7000), CidrRule(POOL), CidrRule("8.8.8.8/32")]
    assert outside_pool(kept, POOL) == kept
    assert outside_pool([CidrRule("0.0.0.0/0")], "") == [CidrRule("0.0.0.0/0")]


def test_in_pool() -> None:
    assert in_pool("10.213.3.4", POOL)
    assert not in_pool("10.214.0.1", POOL)
    assert not in_pool("10.213.3.4", "")
