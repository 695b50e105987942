"""Sandbox networking through the whole platform, against a fake internet (root only).

The edge's gateway and upstream resolver point into namespaces the test made; nothing is
sent to a real external address and the host's own namespace is not touched.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from dsec.core import errors
from dsec.edge.net.ruleset import table_name
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform, requirements_missing, running_platform
from tests.integration.fakenet import DNS_IP, WEB1, WEB2, WEB3, FakeInternet

_MISSING = requirements_missing()
pytestmark = [
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
    pytest.mark.root,
]


@pytest.fixture(scope="module")
def internet() -> Iterator[FakeInternet]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    inet = FakeInternet().start()
    try:
        yield inet
    finally:
        inet.close()


@pytest.fixture(scope="module")
def netplatform(internet: FakeInternet) -> Iterator[RunningPlatform]:
    args = ["--net-upstream-dns", f"{DNS_IP}:53", "--net-gateway-netns", internet.gw_path]
    with running_platform(edge_args=args) as p:
        yield p


@pytest.fixture
def client(netplatform: RunningPlatform) -> Iterator[Client]:
    c = Client(api_url=netplatform.api_url, api_key=netplatform.admin_key)
    yield c
    c.close()


def tcp(sbx: Sandbox, ip: str, port: int) -> str:
    script = f"timeout 3 bash -c 'exec 3<>/dev/tcp/{ip}/{port}; head -c 5 <&3' 2>/dev/null"
    res = sbx.exec(script, timeout=20)
    return res.stdout if res.exit_code == 0 else "denied"


def table(internet: FakeInternet, edge_id: str) -> str:
    out = subprocess.run(
        [
            "nsenter",
            f"--net={internet.gw_path}",
            "nft",
            "list",
            "table",
            "inet",
            table_name(edge_id),
        ],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return out.stdout


@pytest.mark.timeout(300)
def test_policy_end_to_end_with_edge_kill_9(
    netplatform: RunningPlatform, internet: FakeInternet, client: Client
) -> None:
    sbx = Sandbox.create(
        memory_mb=256,
        network={"allow": ["web1.test.example", f"{WEB2}:80"], "deny": []},
        client=client,
    )
    try:
        info = sbx.info()
        assert info.spec is not None
        assert info.spec.network == {"allow": ["web1.test.example", f"{WEB2}:80"], "deny": []}
        assert tcp(sbx, WEB2, 80) == "hello"
        assert tcp(sbx, WEB2, 443) == "denied"
        assert sbx.exec("getent hosts web1.test.example").stdout.split()[0] == WEB1
        assert tcp(sbx, WEB1, 443) == "hello"
        assert sbx.exec("getent hosts api.svc.example").exit_code != 0
        stats = sbx.info().network_stats
        assert stats["allowed_connections"] >= 2
        assert stats["denied_connections"] >= 1
        # live change through the API
        info = sbx.set_network({"allow": [f"{WEB3}:80"]})
        assert info.spec is not None
        assert info.spec.network["allow"] == [f"{WEB3}:80"]
        assert tcp(sbx, WEB3, 80) == "hello"
        assert tcp(sbx, WEB2, 80) == "denied"
        with pytest.raises(errors.InvalidArgument):
            sbx.set_network({"allow": ["10.0.0.0/33"]})
        # kill -9 of the edge: the restarted edge keeps the network and the policy
        edge_id = netplatform.layout.edge_id
        edge_pid = netplatform.pid("edge")
        os.kill(edge_pid, signal.SIGKILL)
        netplatform.wait_component("edge", not_pid=edge_pid)
        assert tcp(sbx, WEB3, 80) == "hello"
        assert tcp(sbx, WEB2, 80) == "denied"
        assert "out_" in table(internet, edge_id)
    finally:
        sbx.kill()
        sbx.close()
    # nothing of the sandbox is left; what remains are the edge's warm (unattached) slots,
    # each already in the dispatch maps with an empty policy
    left = table(internet, edge_id)
    assert WEB3 not in left
    assert left.count("jump out_") == left.count("chain out_")
    assert not list((netplatform.paths.home / "edge" / "net").glob("*.json"))
    slots = list((netplatform.paths.home / "edge" / "sandboxes" / ".netns").iterdir())
    assert len(slots) == left.count("chain out_") <= 4


def test_http_network_field_is_validated(netplatform: RunningPlatform) -> None:
    headers = {"Authorization": f"Bearer {netplatform.admin_key}"}
    with httpx.Client(base_url=netplatform.api_url, headers=headers) as h:
        r = h.post("/v1/sandboxes", json={"network": {"allow": ["nope:80"]}})
        assert r.status_code == 400
        r = h.put("/v1/sandboxes/e0000000-doesnotexist/network", json={"allow": []})
        assert r.status_code in (400, 404)


PEER_SERVER = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', 7000)); s.listen()\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(b'hello'); c.close()\n"
)


def sandbox_address(sbx: Sandbox) -> str:
    """The sandbox's own IPv4 address, read from the kernel's table inside it."""
    lines = sbx.exec("cat /proc/net/fib_trie").stdout.splitlines()
    for prev, line in itertools.pairwise(lines):
        if "/32 host LOCAL" in line:
            addr = prev.split()[-1]
            if not addr.startswith("127."):
                return addr
    raise AssertionError("no address in /proc/net/fib_trie")


@pytest.mark.timeout(300)
def test_sandboxes_cannot_reach_each_other_unless_a_rule_says_so(
    netplatform: RunningPlatform, client: Client
) -> None:
    a = Sandbox.create(memory_mb=256, client=client)
    b = Sandbox.create(memory_mb=256, client=client)
    try:
        for s in (a, b):
            s.files.write("/root/peer.py", PEER_SERVER)
            s.processes.start(["python3", "/root/peer.py"])
        for s in (a, b):
            deadline = time.monotonic() + 20
            while tcp(s, "127.0.0.1", 7000) != "hello":  # the servers run
                assert time.monotonic() < deadline, "the peer server did not start"
                time.sleep(0.2)
        addr_a, addr_b = sandbox_address(a), sandbox_address(b)
        assert addr_a != addr_b
        assert tcp(a, addr_b, 7000) == "denied"
        assert tcp(b, addr_a, 7000) == "denied"
        a.set_network({"allow": ["0.0.0.0/0"]})  # "everything" does not include the peers
        assert tcp(a, addr_b, 7000) == "denied"
        # a rule on a's egress names b: a reaches b, and only on that port
        a.set_network({"allow": [f"{addr_b}/32:7000"]})
        assert tcp(a, addr_b, 7000) == "hello"
        assert tcp(a, addr_b, 7001) == "denied"
        assert tcp(b, addr_a, 7000) == "denied"  # nothing allows the other direction
        # a rule for the whole pool does not bypass a deny of the peer
        a.set_network({"allow": [f"{addr_b}/16"], "deny": [f"{addr_b}/32"]})
        assert tcp(a, addr_b, 7000) == "denied"
        a.set_network({"allow": []})
        assert tcp(a, addr_b, 7000) == "denied"
    finally:
        for s in (a, b):
            s.kill()
            s.close()
