"""Network policy parsing, its place in SandboxSpec and the nft text it becomes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.core.errors import InvalidArgument
from dsec.core.netpolicy import CidrRule, DomainRule, NetworkPolicy, parse_rule
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.container import ocispec
from dsec.edge.net import nlsets, ruleset
from dsec.edge.net.config import NetConfig
from dsec.paths import Paths


def test_rules() -> None:
    assert parse_rule("10.1.2.3") == CidrRule("10.1.2.3/32")
    assert parse_rule("10.1.2.0/24:443") == CidrRule("10.1.2.0/24", "tcp", 443, 443)
    assert parse_rule("10.1.2.0/24:1000-2000/udp") == CidrRule("10.1.2.0/24", "udp", 1000, 2000)
    assert parse_rule("*.Example.COM.") == DomainRule("example.com", True)
    assert parse_rule("api.example.com") == DomainRule("api.example.com", False)
    assert parse_rule("[2001:db8::/32]:443") == CidrRule("2001:db8::/32", "tcp", 443, 443)
    assert parse_rule("2001:DB8::1") == CidrRule("2001:db8::1/128")
    assert parse_rule("from:[fd00::/8]:22/udp") == CidrRule("fd00::/8", "udp", 22, 22, True)
    bad_rules = ["10.0.0.0/33", "1.2.3.4:0", "1.2.3.4:9-8", "no dots", "a:b", "x.y:80"]
    bad_rules += ["[10.0.0.0/8]:22", "[2001:db8::]:", "[2001:db8::", "2001:db8::/32:443"]
    for bad in bad_rules:
        with pytest.raises(InvalidArgument):
            parse_rule(bad)


def test_policy() -> None:
    p = NetworkPolicy.from_dict({"allow": ["*.ex.com", "ex.org"], "deny": ["bad.ex.com"]})
    assert p.name_allowed("a.ex.com")
    assert not p.name_allowed("ex.com")
    assert p.name_allowed("EX.org.")
    assert not p.name_allowed("bad.ex.com")
    with pytest.raises(InvalidArgument):
        NetworkPolicy.from_dict({"allow": "1.2.3.4"})
    with pytest.raises(InvalidArgument):
        NetworkPolicy.from_dict({"permit": []})


def test_spec_round_trip() -> None:
    spec = SandboxSpec.from_dict({"network": {"allow": ["10.0.0.0/8:22"]}})
    assert spec.network == NetworkPolicy(allow=("10.0.0.0/8:22",))
    assert SandboxSpec.from_dict(spec.to_dict()) == spec
    assert SandboxSpec().network == NetworkPolicy()
    with pytest.raises(InvalidArgument):
        SandboxSpec.from_dict({"network": {"allow": ["nope:1"]}})


def test_nft_text() -> None:
    t = ruleset.TableSpec("inet dsec_e1", "dxab", "10.213.0.0/16", 53)
    pol = NetworkPolicy(allow=("10.1.0.0/16", "10.2.0.0/16:80-90/udp"), deny=("10.1.2.3:22",))
    text = ruleset.add_slot(t, "5", "10.213.0.22") + ruleset.policy_elements(
        t.family_table, "5", pol, t.pool
    )
    assert "add element inet dsec_e1 a_5 { 10.1.0.0/16 }" in text
    assert "add element inet dsec_e1 ap_5 { 10.2.0.0/16 . udp . 80-90 }" in text
    assert "add element inet dsec_e1 dp_5 { 10.1.2.3/32 . tcp . 22 }" in text
    assert 'add element inet dsec_e1 egress { "dxab5" : jump out_5 }' in text
    assert "ip saddr != 10.213.0.22" in text
    gone = ruleset.remove_sandbox(t, "5", present={"out_5", "a_5"})
    assert gone.splitlines() == [
        "flush chain inet dsec_e1 out_5",
        "delete chain inet dsec_e1 out_5",
        "delete set inet dsec_e1 a_5",
    ]


def test_config_and_oci(tmp_path: Path) -> None:
    cfg = NetConfig("10.213.0.0/16", "198.18.1.53:53", tmp_path, tmp_path)
    assert cfg.addresses(1) == ("10.213.0.5", "10.213.0.6")
    assert cfg.capacity() == 16383
    with pytest.raises(InvalidArgument):
        NetConfig("8.8.0.0/16", "198.18.1.53:53", tmp_path, tmp_path)
    with pytest.raises(InvalidArgument):
        NetConfig("10.0.0.0/16", "resolver", tmp_path, tmp_path)
    files = ocispec.etc_files("s1", "nameserver 10.213.0.5\n")
    assert files["resolv.conf"] == "nameserver 10.213.0.5\n"
    assert "resolv.conf" not in ocispec.etc_files("s1")


def test_ingress_rules() -> None:

    assert parse_rule("from:10.213.0.6:7000") == CidrRule("10.213.0.6/32", "tcp", 7000, 7000, True)
    assert parse_rule("FROM:198.18.0.0/16") == CidrRule("198.18.0.0/16", ingress=True)
    for bad in ("from:web.example", "from:*.example.com", "from:10.0.0.0/8:0", "from:"):
        with pytest.raises(InvalidArgument):
            parse_rule(bad)
    with pytest.raises(InvalidArgument, match="ingress rules are allow rules"):
        NetworkPolicy(deny=("from:10.0.0.0/8",))
    pol = NetworkPolicy(allow=("10.1.0.0/16", "from:10.213.0.6/32:7000/udp", "from:1.2.3.0/24"))
    assert [r.network for r in pol.cidrs("allow")] == ["10.1.0.0/16"]
    assert [r.network for r in pol.ingress()] == ["10.213.0.6/32", "1.2.3.0/24"]
    t = ruleset.TableSpec("inet dsec_e1", "dxab", "10.213.0.0/16", 53)
    text = ruleset.add_slot(t, "5", "10.213.0.22") + ruleset.policy_elements(
        t.family_table, "5", pol, t.pool
    )
    assert "add element inet dsec_e1 i_5 { 1.2.3.0/24 }" in text
    assert "add element inet dsec_e1 ip_5 { 10.213.0.6/32 . udp . 7000 }" in text
    assert 'add element inet dsec_e1 peer_in { "dxab5" : jump inok_5 }' in text
    assert "a_5 { 10.1.0.0/16 }" in text  # egress untouched by ingress rules
    assert "ip daddr 10.213.0.0/16 oifname vmap @peer_in" in text
    swap = ruleset.policy_ops("5", pol, t.pool, flush=True)
    assert nlsets.Op("ip_5", flush=True) in swap
    assert [len(op.elements) for op in swap if op.name in ("i_5", "ip_5") and not op.flush] == [
        3,
        1,
    ]
    gone = ruleset.remove_sandbox(t, "5")
    flush, delete = "flush chain inet dsec_e1 inok_5", "delete chain inet dsec_e1 in_5"
    assert gone.index(flush) < gone.index(delete)


def test_edge_hands_its_network_to_container_microvm_and_vm(tmp_path: Path) -> None:
    from dsec.edge.app import candidate_backends
    from dsec.edge.net.edgenet import EdgeNetwork

    cfg = NetConfig("10.213.0.0/16", "198.18.1.53:53", tmp_path / "s", tmp_path / "n")
    net = EdgeNetwork("e1", cfg)  # not started: only handed over
    by_name = {b.name: b for b in candidate_backends(Paths.from_env(tmp_path), "e1", net)}
    assert getattr(by_name["container"], "network", None) is net
    assert getattr(by_name["microvm"], "network", None) is net
    assert getattr(by_name["vm"], "network", None) is net  # dsec-net.service applies ip=


def test_netlink_set_elements() -> None:
    """The encoding nft itself sends (checked against ``nft --debug=netlink``)."""
    # 0.0.0.0 end marker, then start / one-past-end pairs; overlaps merged; /1 at the top
    # has no end element
    elems = nlsets.interval_elements(["10.0.0.0/8", "10.1.0.0/16", "198.18.1.10"])
    keys = [e[12:16] for e in elems]
    assert keys == [bytes(4), bytes([10, 0, 0, 0]), bytes([11, 0, 0, 0]),
                    bytes([198, 18, 1, 10]), bytes([198, 18, 1, 11])]  # fmt: skip
    assert [b"\x00\x00\x00\x01" in e for e in elems] == [True, False, True, False, True]
    top = nlsets.interval_elements(["128.0.0.0/1"])
    assert len(top) == 2
    assert top[1].endswith(nlsets.OPEN_INTERVAL_UDATA + b"\0\0")
    (elem,) = nlsets.ported_elements([nlsets.Ported("198.18.2.0/24", "udp", 1000, 2000)])
    assert bytes([198, 18, 2, 0, 17, 0, 0, 0, 0x03, 0xE8, 0, 0]) in elem
    assert bytes([198, 18, 2, 255, 17, 0, 0, 0, 0x07, 0xD0, 0, 0]) in elem
    assert nlsets.timeout_elements([("1.2.3.4", 0)]) == []


def test_overlapping_port_rules_are_merged() -> None:
    """The kernel refuses overlapping elements in the CIDR . proto . ports sets."""
    pol = NetworkPolicy(allow=("10.0.0.0/8:80-90", "10.0.0.0/8:85-95", "10.1.0.0/16:82"))
    text = ruleset.policy_elements("inet t", "5", pol)
    assert "add element inet t ap_5 { 10.0.0.0/8 . tcp . 80-95 }" in text
    six = NetworkPolicy(allow=("[2001:db8::/32]:443", "[2001:db8::1]:443", "1.2.3.4:443"))
    text = ruleset.policy_elements("inet t", "5", six)
    assert "add element inet t ap6_5 { 2001:db8::/32 . tcp . 443 }" in text
    assert "add element inet t ap_5 { 1.2.3.4/32 . tcp . 443 }" in text
