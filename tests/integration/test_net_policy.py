"""Sandbox networks against a fake internet made of namespaces on this machine (root only).

The "sandbox" here is the namespace the edge network makes, probed with nsenter; the
container backend's use of it is tested in test_net_container.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core.errors import InvalidArgument, SandboxFailed
from dsec.core.netpolicy import NetworkPolicy
from dsec.edge.net import ruleset
from dsec.edge.net.config import NetConfig
from dsec.edge.net.edgenet import EdgeNetwork
from tests.integration.fakenet import (
    DNS_IP,
    POOL6,
    UDP_PORT,
    WEB1,
    WEB2,
    WEB3,
    WEB6,
    FakeInternet,
    probe,
    wait_for,
)
from tests.waits import auntil

pytestmark = [pytest.mark.root]


LISTEN = "import socket,time;s=socket.socket();s.bind(('',7000));s.listen();time.sleep(30)"


def denied(outcome: str) -> bool:
    # PermissionError: EACCES, how Linux reports an ICMPv6 admin-prohibited reject
    return outcome.startswith(("refused", "OSError", "TimeoutError", "timeout", "PermissionError"))


@pytest.fixture(scope="module")
def internet() -> Iterator[FakeInternet]:
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root")
    inet = FakeInternet().start()
    try:
        yield inet
    finally:
        inet.close()


@pytest_asyncio.fixture
async def edgenet(internet: FakeInternet, tmp_path: Path) -> AsyncIterator[EdgeNetwork]:
    cfg = NetConfig(
        pool="10.213.0.0/16",
        upstream_dns=f"{DNS_IP}:53",
        state_dir=tmp_path / "netstate",
        netns_dir=tmp_path / "netns",
        gateway_netns=internet.gw_path,
    )
    net = EdgeNetwork(f"test-{tmp_path.name[-12:]}", cfg)
    await net.start()
    try:
        yield net
    finally:
        for sid in list(net._nets):
            await net.destroy(sid)
        await net.release()


async def aprobe(ns: Path, *args: object, **kw: object) -> str:
    return await asyncio.to_thread(probe, ns, *args, **kw)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_default_deny(edgenet: EdgeNetwork, internet: FakeInternet) -> None:
    net = await edgenet.create("sbx-deny", NetworkPolicy())
    ns = net.netns
    assert denied(await aprobe(ns, "tcp", WEB1, 80))
    assert denied(await aprobe(ns, "udp", WEB1, UDP_PORT))
    # ICMP: ping (the namespace is the edge's, so raw sockets work here as root)
    ping = await asyncio.to_thread(
        subprocess.run,
        ["nsenter", f"--net={ns}", "ping", "-c1", "-W1", WEB1],
        capture_output=True,
        timeout=10,
    )
    assert ping.returncode != 0
    # DNS to an outside resolver is answered by the edge's (port 53 is redirected), so
    # a name the policy does not allow never leaves the gateway
    before = len(internet.dns_queries())
    out = await aprobe(ns, "dns", "web1.test.example", server=DNS_IP, timeout=1)
    assert out.startswith("NXDOMAIN")
    assert len(internet.dns_queries()) == before
    assert (await aprobe(ns, "dns", "web1.test.example", server=net.gateway)).startswith("NXDOMAIN")
    # the gateway's own services (here: anything but the resolver) are closed
    assert denied(await aprobe(ns, "tcp", net.gateway, 22))
    # ingress: the internet cannot connect in, even to a listening port
    srv = subprocess.Popen(
        [
            "nsenter",
            f"--net={ns}",
            "python3",
            "-c",
            LISTEN,
        ],
    )
    try:
        time.sleep(0.3)
        assert denied(
            await aprobe(Path(f"/run/netns/{internet.inet}"), "tcp", net.address, 7000, 1.0)
        )
        assert denied(await aprobe(Path(internet.gw_path), "tcp", net.address, 7000, 1.0))
    finally:
        srv.kill()
        srv.wait()
    c = (await edgenet.counters())["sbx-deny"]
    assert c["denied_connections"] >= 3, c
    assert c["allowed_connections"] == 0
    # no IPv6 at all
    ip6 = subprocess.run(
        ["nsenter", f"--net={ns}", "ip", "-6", "addr"], capture_output=True, text=True
    )
    assert "inet6" not in ip6.stdout


@pytest.mark.asyncio
async def test_cidr_port_and_deny_wins(edgenet: EdgeNetwork) -> None:
    pol = NetworkPolicy.from_dict(
        {
            "allow": [f"{WEB1}/32", f"{WEB2}:8080", f"{WEB3}:{UDP_PORT}/udp", "198.18.1.0/24:443"],
            "deny": [f"{WEB3}:443"],
        }
    )
    net = await edgenet.create("sbx-cidr", pol)
    ns = net.netns
    assert (await aprobe(ns, "tcp", WEB1, 80)) == f"hello {WEB1}:80"
    assert (await aprobe(ns, "tcp", WEB1, 8080)) == f"hello {WEB1}:8080"
    assert (await aprobe(ns, "udp", WEB1, UDP_PORT)) == "ping"
    assert (await aprobe(ns, "tcp", WEB2, 8080)) == f"hello {WEB2}:8080"
    assert denied(await aprobe(ns, "tcp", WEB2, 80))
    assert denied(await aprobe(ns, "udp", WEB2, UDP_PORT))
    assert (await aprobe(ns, "udp", WEB3, UDP_PORT)) == "ping"
    assert denied(await aprobe(ns, "tcp", WEB3, 80))
    assert (await aprobe(ns, "tcp", WEB2, 443)) == f"hello {WEB2}:443"
    assert denied(await aprobe(ns, "tcp", WEB3, 443))  # deny wins over the /24 allow
    c = (await edgenet.counters())["sbx-cidr"]
    assert c["allowed_connections"] >= 5, c
    assert c["allowed_bytes"] > 0
    assert c["denied_connections"] >= 4


@pytest.mark.asyncio
async def test_domains_and_ttl(edgenet: EdgeNetwork, internet: FakeInternet) -> None:
    pol = NetworkPolicy.from_dict({"allow": ["web2.test.example", "*.svc.example"], "deny": []})
    net = await edgenet.create("sbx-dns", pol)
    ns, gw = net.netns, net.gateway
    assert denied(await aprobe(ns, "tcp", WEB2, 80))  # never resolved: CIDR rules apply
    out = await aprobe(ns, "dns", "web2.test.example", server=gw)
    assert out == f"NOERROR {WEB2}"
    assert (await aprobe(ns, "tcp", WEB2, 80)) == f"hello {WEB2}:80"
    assert (await aprobe(ns, "dns", "api.svc.example", server=gw)) == f"NOERROR {WEB3}"
    assert (await aprobe(ns, "tcp", WEB3, 443)) == f"hello {WEB3}:443"
    before = len(internet.dns_queries())
    for name in ("svc.example", "web1.test.example", "secret-data.evil.example"):
        assert (await aprobe(ns, "dns", name, server=gw)).startswith("NXDOMAIN")
    assert len(internet.dns_queries()) == before  # refused names never reach upstream
    assert denied(await aprobe(ns, "tcp", WEB1, 80))
    await asyncio.sleep(5.2)  # web2's TTL is 4 s
    assert denied(await aprobe(ns, "tcp", WEB2, 80))
    assert (await aprobe(ns, "tcp", WEB3, 80)) == f"hello {WEB3}:80"  # TTL 300 s


@pytest.mark.asyncio
async def test_live_policy_change_keeps_established(edgenet: EdgeNetwork) -> None:
    net = await edgenet.create("sbx-live", NetworkPolicy.from_dict({"allow": [f"{WEB1}:80"]}))
    ns = net.netns
    script = (
        "import socket,sys,time\n"
        f"s=socket.create_connection(('{WEB1}',80),timeout=3); s.recv(100)\n"
        "print('up',flush=True); sys.stdin.readline()\n"
        "s.sendall(b'still'); print(s.recv(100).decode(),flush=True)\n"
    )
    p = subprocess.Popen(
        ["nsenter", f"--net={ns}", "python3", "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        assert p.stdin is not None
        assert p.stdout.readline().strip() == "up"
        await edgenet.set_policy(
            "sbx-live", NetworkPolicy.from_dict({"allow": [f"{WEB1}:80", f"{WEB2}:80"]})
        )
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "still"
    finally:
        p.kill()
        p.wait()
    assert (await aprobe(ns, "tcp", WEB2, 80)) == f"hello {WEB2}:80"
    assert edgenet.get("sbx-live").policy.allow == (f"{WEB1}:80", f"{WEB2}:80")  # type: ignore[union-attr]
    await edgenet.set_policy(
        "sbx-live", NetworkPolicy.from_dict({"allow": [f"{WEB1}:80"], "deny": [f"{WEB1}/32"]})
    )
    assert denied(await aprobe(ns, "tcp", WEB1, 80))
    assert denied(await aprobe(ns, "tcp", WEB2, 80))


HELLO = (
    "import socket\ns=socket.socket(); s.bind(('',7000)); s.listen()\n"
    "while True:\n    c,_=s.accept(); c.sendall(b'hello'); c.close()\n"
)


@pytest.mark.asyncio
async def test_sandboxes_cannot_reach_each_other(edgenet: EdgeNetwork) -> None:
    # a broad rule (the whole 10/8, which holds the pool) does not cover other sandboxes
    a = await edgenet.create("sbx-a", NetworkPolicy.from_dict({"allow": ["10.0.0.0/8"]}))
    b = await edgenet.create("sbx-b", NetworkPolicy())
    srv = subprocess.Popen(["nsenter", f"--net={b.netns}", "python3", "-c", HELLO])
    try:
        assert wait_for(lambda: probe(b.netns, "tcp", "127.0.0.1", 7000) == "hello")
        assert denied(await aprobe(a.netns, "tcp", b.address, 7000, 1.0))
        assert denied(await aprobe(b.netns, "tcp", a.address, 7000, 1.0))  # b's egress
        assert denied(await aprobe(a.netns, "tcp", a.gateway, 22, 1.0))
        assert denied(await aprobe(a.netns, "tcp", "169.254.169.254", 80, 1.0))
        # a rule naming b opens exactly that
        await edgenet.set_policy(
            "sbx-a", NetworkPolicy.from_dict({"allow": ["0.0.0.0/0", f"{b.address}/32:7000"]})
        )
        assert (await aprobe(a.netns, "tcp", b.address, 7000, 1.0)) == "hello"
        assert denied(await aprobe(b.netns, "tcp", a.address, 7000, 1.0))
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.asyncio
async def test_ingress_rules_let_a_peer_or_a_network_in(
    edgenet: EdgeNetwork, internet: FakeInternet
) -> None:
    a = await edgenet.create("sbx-ia", NetworkPolicy())
    b = await edgenet.create("sbx-ib", NetworkPolicy())
    inet = Path(f"/run/netns/{internet.inet}")
    srv = subprocess.Popen(["nsenter", f"--net={b.netns}", "python3", "-c", HELLO])
    try:
        assert wait_for(lambda: probe(b.netns, "tcp", "127.0.0.1", 7000) == "hello")
        assert denied(await aprobe(a.netns, "tcp", b.address, 7000, 1.0))
        assert denied(await aprobe(inet, "tcp", b.address, 7000, 1.0))
        # b lets a in on :7000 (a's own policy names nothing) and the internet's uplink net
        pol = {"allow": [f"from:{a.address}/32:7000", "from:198.18.0.0/24:7000"]}
        await edgenet.set_policy("sbx-ib", NetworkPolicy.from_dict(pol))
        assert (await aprobe(a.netns, "tcp", b.address, 7000, 1.0)) == "hello"
        assert (await aprobe(inet, "tcp", b.address, 7000, 1.0)) == "hello"
        assert denied(await aprobe(a.netns, "tcp", b.address, 7001, 1.0))  # other port
        assert denied(await aprobe(b.netns, "tcp", a.address, 7000, 1.0))  # not the reverse
        # a deny on a's side still wins over b's ingress rule
        await edgenet.set_policy("sbx-ia", NetworkPolicy(deny=(f"{b.address}/32",)))
        assert denied(await aprobe(a.netns, "tcp", b.address, 7000, 1.0))
        assert (await edgenet.counters())["sbx-ib"]["allowed_connections"] >= 2
        await edgenet.set_policy("sbx-ib", NetworkPolicy())
        assert denied(await aprobe(inet, "tcp", b.address, 7000, 1.0))
    finally:
        srv.kill()
        srv.wait()
    for sid, key in (("sbx-ia", a.key), ("sbx-ib", b.key)):
        await edgenet.destroy(sid)
        assert await edgenet.leaked(sid, key) == []


@pytest.mark.asyncio
async def test_dns_over_tcp(edgenet: EdgeNetwork, internet: FakeInternet) -> None:
    pol = NetworkPolicy.from_dict({"allow": ["web2tcp.test.example"], "deny": []})
    net = await edgenet.create("sbx-dnstcp", pol)
    assert denied(await aprobe(net.netns, "tcp", WEB2, 80))
    before = len(internet.dns_queries())
    # two queries on one TCP connection, to the gateway and to an "outside" resolver
    # (redirected to the edge's as for UDP): allowed name answered, the other NXDOMAIN
    for server in (net.gateway, DNS_IP):
        out = await aprobe(net.netns, "dnstcp", "web2tcp.test.example,evil.example", server=server)
        assert out == f"NOERROR {WEB2} | NXDOMAIN"
        # the answer opened the address
        assert (await aprobe(net.netns, "tcp", WEB2, 80)) == f"hello {WEB2}:80"
    assert len(internet.dns_queries()) == before + 2  # only the allowed name went upstream


@pytest.mark.asyncio
async def test_restart_adopts_and_destroy_leaves_nothing(
    edgenet: EdgeNetwork, internet: FakeInternet
) -> None:
    net = await edgenet.create("sbx-adopt", NetworkPolicy.from_dict({"allow": [f"{WEB1}:80"]}))
    await edgenet.close()  # as after kill -9: nothing is removed
    again = EdgeNetwork(edgenet.edge_id, edgenet.config)
    await again.start()
    try:
        assert again.get("sbx-adopt") == net
        assert (await aprobe(net.netns, "tcp", WEB1, 80)) == f"hello {WEB1}:80"
        await again.destroy("sbx-adopt")
        assert await again.leaked("sbx-adopt", net.key) == []
        other = await again.create("sbx-after", NetworkPolicy())
        await again.destroy("sbx-after")
        assert await again.leaked("sbx-after", other.key) == []
    finally:
        await again.release()
    await edgenet.start()  # so the fixture can release it


@pytest.mark.asyncio
async def test_restart_upgrades_a_slot_an_older_edge_made(
    edgenet: EdgeNetwork, internet: FakeInternet
) -> None:
    """A slot without the ingress sets, ``inok_`` chain and ``peer_in`` key (as an edge
    before ingress rules made it) is brought up to date at start, keeping its policy and
    the addresses the resolver opened."""
    pol = NetworkPolicy.from_dict({"allow": [f"{WEB1}:80", "web2.test.example"]})
    net = await edgenet.create("sbx-old", pol)
    await edgenet._open_resolved("sbx-old", "web2.test.example", [(WEB2, 300)])
    ft, k, c = edgenet.t.family_table, net.key, "counter name"
    old = f"""flush chain {ft} out_{k}
flush chain {ft} in_{k}
flush chain {ft} inok_{k}
delete element {ft} peer_in {{ "{edgenet.ifname(net)}" }}
delete chain {ft} inok_{k}
delete set {ft} i_{k}
delete set {ft} ip_{k}
add rule {ft} out_{k} ct state established,related {c} ok_{k} accept
add rule {ft} out_{k} ip daddr . meta l4proto . th dport @ap_{k} {c} ok_{k} accept
add rule {ft} out_{k} ip daddr @dns_{k} {c} ok_{k} accept
add rule {ft} out_{k} {c} deny_{k} {ruleset.REJECT}
add rule {ft} in_{k} ct state established,related accept
add rule {ft} in_{k} drop
"""
    await edgenet._run(lambda: edgenet._nft_run(old))
    assert f"i_{k}" not in await edgenet._run(lambda: edgenet._present(k))
    await edgenet.close()
    again = EdgeNetwork(edgenet.edge_id, edgenet.config)
    await again.start()
    try:
        present = await again._run(lambda: again._present(k))
        assert ruleset.slot_objects(again.t, k) <= present
        assert (await aprobe(net.netns, "tcp", WEB1, 80)) == f"hello {WEB1}:80"
        assert (await aprobe(net.netns, "tcp", WEB2, 80)) == f"hello {WEB2}:80"
        assert denied(await aprobe(net.netns, "tcp", WEB1, 443))
        # the upgraded slot takes ingress rules
        await again.set_policy(
            "sbx-old", NetworkPolicy.from_dict({"allow": ["from:198.18.0.0/16:7000"]})
        )
        await again.close()
    finally:
        if again._pool is not None:
            await again.close()
    await edgenet.start()  # adopts it again (nothing left to upgrade); the fixture cleans up


@pytest.mark.asyncio
async def test_failed_create_leaves_nothing(
    edgenet: EdgeNetwork, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nft fails after the namespace and the veth exist: create must remove both
    monkeypatch.setattr(ruleset, "add_slot", lambda *a, **k: "add rule inet nosuch x drop\n")
    with pytest.raises(SandboxFailed):
        await edgenet.create("sbx-fail", NetworkPolicy())
    assert edgenet.get("sbx-fail") is None
    assert await edgenet.leaked("sbx-fail", "1") == []


@pytest.mark.asyncio
async def test_warm_pool(internet: FakeInternet, tmp_path: Path) -> None:
    cfg = NetConfig(
        pool="10.213.0.0/16",
        upstream_dns=f"{DNS_IP}:53",
        state_dir=tmp_path / "netstate",
        netns_dir=tmp_path / "netns",
        gateway_netns=internet.gw_path,
        warm=2,
    )
    net = EdgeNetwork(f"warm-{tmp_path.name[-8:]}", cfg)
    await net.start()
    try:
        await auntil(lambda: len(net._warm) == 2, "two warm slots", 30)
        assert len(net._warm) == 2
        first = net._warm[0]
        a = await net.create("sbx-warm", NetworkPolicy.from_dict({"allow": [f"{WEB1}:80"]}))
        assert a.index == first  # a warm slot taken, none made (its speed: bench/)
        assert (await aprobe(a.netns, "tcp", WEB1, 80)) == f"hello {WEB1}:80"
        assert denied(await aprobe(a.netns, "tcp", WEB2, 80))
        await net.destroy("sbx-warm")
        assert await net.leaked("sbx-warm", a.key) == []
        # a restart drops the warm slots of the old run and makes new ones
        await net.close()
        net = EdgeNetwork(net.edge_id, cfg)
        await net.start()
    finally:
        await net.release()
    assert not any((tmp_path / "netns").glob("*"))


V6_SERVER = (
    "import socket\ns=socket.socket(socket.AF_INET6); s.bind(('::',7000)); s.listen()\n"
    "while True:\n    c,_=s.accept(); c.sendall(b'hello'); c.close()\n"
)


def _sh(ns: str | Path, script: str) -> str:
    out = subprocess.run(
        ["nsenter", f"--net={ns}", "sh", "-c", script], capture_output=True, text=True, timeout=10
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _mac(ip_link: str) -> str:
    return ip_link.split("link/ether ", 1)[1].split()[0]


@pytest.mark.asyncio
async def test_ipv6_is_denied_whatever_the_policy(
    edgenet: EdgeNetwork, internet: FakeInternet
) -> None:
    """Even if IPv6 were switched on in two sandboxes (here by the test, as root outside
    them) and routed between them, the edge's table refuses it, under an allow-all policy."""
    everything = NetworkPolicy.from_dict({"allow": ["0.0.0.0/0"]})
    a = await edgenet.create("sbx-v6a", everything)
    b = await edgenet.create("sbx-v6b", everything)
    gw = internet.gw_path
    on = "echo 0 > /proc/sys/net/ipv6/conf/{}/disable_ipv6"
    for net, sub in ((a, "fd00:a"), (b, "fd00:b")):
        host = edgenet.ifname(net)
        host_mac = _mac(_sh(gw, f"ip -o link show dev {host}"))
        eth_mac = _mac(_sh(net.netns, "ip -o link show dev eth0"))
        # static neighbours: the sandbox's NDP to the gateway is refused by the table too
        _sh(
            net.netns,
            f"{on.format('all')}; {on.format('eth0')}; ip -6 addr add {sub}::2/64 dev eth0 nodad;"
            f" ip -6 route add default via {sub}::1;"
            f" ip -6 neigh replace {sub}::1 lladdr {host_mac} dev eth0",
        )
        _sh(
            gw,
            f"{on.format(host)}; echo 1 > /proc/sys/net/ipv6/conf/all/forwarding;"
            f" ip -6 addr add {sub}::1/64 dev {host} nodad;"
            f" ip -6 neigh replace {sub}::2 lladdr {eth_mac} dev {host}",
        )
    srv = subprocess.Popen(["nsenter", f"--net={b.netns}", "python3", "-c", V6_SERVER])
    try:
        assert wait_for(lambda: probe(b.netns, "tcp", "::1", 7000) == "hello")
        before = (await edgenet.counters())["sbx-v6a"]["denied_connections"]
        assert denied(await aprobe(a.netns, "tcp", "fd00:b::2", 7000, 1.0))
        after = (await edgenet.counters())["sbx-v6a"]["denied_connections"]
        assert after > before  # refused by the sandbox's chain, not lost on the way
        assert denied(await aprobe(b.netns, "tcp", "fd00:a::2", 7000, 1.0))
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.asyncio
async def test_ipv6_rules_aaaa_and_peers(internet: FakeInternet, tmp_path: Path) -> None:
    """With an IPv6 pool: sandboxes get an address, IPv6 is denied unless a rule (CIDR or
    an AAAA answer) opens it, deny wins, and peers are closed until a rule names them."""
    cfg = NetConfig(
        pool="10.213.0.0/16",
        upstream_dns=f"{DNS_IP}:53",
        state_dir=tmp_path / "netstate",
        netns_dir=tmp_path / "netns",
        gateway_netns=internet.gw_path,
        pool6=POOL6,
    )
    net = EdgeNetwork(f"v6-{tmp_path.name[-8:]}", cfg)
    await net.start()
    srv = None
    try:
        a = await net.create("sbx-6a", NetworkPolicy(allow=("0.0.0.0/0", f"[{WEB6}]:80")))
        assert a.address6.startswith(POOL6.split("::")[0])
        assert (await aprobe(a.netns, "tcp", WEB6, 80)) == f"hello {WEB6}:80"
        assert denied(await aprobe(a.netns, "tcp", WEB6, 443))  # allow-all IPv4 opens no IPv6
        assert (await aprobe(a.netns, "tcp", WEB1, 80)) == f"hello {WEB1}:80"
        b = await net.create("sbx-6b", NetworkPolicy(allow=("web6.test.example", "::/0")))
        srv = subprocess.Popen(["nsenter", f"--net={a.netns}", "python3", "-c", V6_SERVER])
        assert wait_for(lambda: probe(a.netns, "tcp", "::1", 7000) == "hello")
        # "::/0" covers the internet, not the neighbours
        assert (await aprobe(b.netns, "tcp", WEB6, 443)) == f"hello {WEB6}:443"
        assert denied(await aprobe(b.netns, "tcp", a.address6, 7000, 1.0))
        # an AAAA answer opens its address for a sandbox without a CIDR rule
        await net.set_policy("sbx-6b", NetworkPolicy(allow=("web6.test.example",)))
        assert denied(await aprobe(b.netns, "tcp", WEB6, 8080))
        out = await aprobe(b.netns, "dns", "web6.test.example/AAAA", server=b.gateway)
        assert out == f"NOERROR {WEB6}"
        assert (await aprobe(b.netns, "tcp", WEB6, 8080)) == f"hello {WEB6}:8080"
        # a policy swap that keeps the name allowed keeps its resolved IPv6 address open
        await net.set_policy("sbx-6b", NetworkPolicy(allow=("web6.test.example", "1.2.3.4")))
        assert (await aprobe(b.netns, "tcp", WEB6, 8080)) == f"hello {WEB6}:8080"
        # a rule naming the peer opens it (that port only); deny wins over allow
        await net.set_policy(
            "sbx-6b", NetworkPolicy(allow=(f"[{a.address6}]:7000", "::/0"), deny=(f"{WEB6}",))
        )
        assert (await aprobe(b.netns, "tcp", a.address6, 7000)) == "hello"
        assert denied(await aprobe(b.netns, "tcp", WEB6, 80))
        stats = (await net.counters())["sbx-6b"]
        assert stats["denied_connections"] >= 3
        for sid, n in (("sbx-6a", a), ("sbx-6b", b)):
            await net.destroy(sid)
            assert await net.leaked(sid, n.key) == []
    finally:
        if srv is not None:
            srv.kill()
            srv.wait()
        for sid in list(net._nets):
            await net.destroy(sid)
        await net.release()


@pytest.mark.asyncio
async def test_ipv6_rules_refused_without_an_ipv6_pool(edgenet: EdgeNetwork) -> None:
    with pytest.raises(InvalidArgument, match="no IPv6"):
        await edgenet.create("sbx-no6", NetworkPolicy(allow=("[2001:db8::/32]:443",)))
    assert edgenet.get("sbx-no6") is None
