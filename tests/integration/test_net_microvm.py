"""microVM sandboxes on the same pooled network as containers, through a TAP (root only).

One TCG boot: the guest gets its address from ``ip=``, the edge's resolver from its
config disk, and is policed by the same nft chains as a container: allowed CIDR and
domain work, the rest is denied, the gateway and other sandboxes are closed until a rule
says so, a live policy change applies, and destroy leaves no namespace, TAP or nft object.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core.errors import InvalidArgument
from dsec.core.ids import new_sandbox_id
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container import testkit
from dsec.edge.backends.microvm import kernel
from dsec.edge.backends.microvm.backend import MicrovmBackend
from dsec.edge.net.config import NetConfig
from dsec.edge.net.edgenet import EdgeNetwork
from dsec.paths import Paths
from tests.integration import vmkit
from tests.integration.fakenet import DNS_IP, POOL, WEB1, WEB2, WEB3, FakeInternet, probe
from tests.integration.vmkit import microvm_skip_reason as _skip_reason

pytestmark = [pytest.mark.root, pytest.mark.guest_kernel]
LISTEN = (
    "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    "s.bind(('',{port}));s.listen()\n"
    "while True:\n c,_=s.accept();c.sendall(b'peer!');c.close()\n"
)


@pytest.fixture(scope="module")
def internet() -> Iterator[FakeInternet]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    inet = FakeInternet().start()
    try:
        yield inet
    finally:
        inet.close()


@pytest_asyncio.fixture
async def vmnet(internet: FakeInternet) -> AsyncIterator[tuple[MicrovmBackend, EdgeNetwork]]:
    with vmkit.node("dsec-vmnet-", "dsn", check_cgroups=False) as n:
        sandboxes = n.paths.home / "edge" / "sandboxes"
        cfg = NetConfig(
            pool=POOL,
            upstream_dns=f"{DNS_IP}:53",
            state_dir=n.paths.home / "edge" / "net",
            netns_dir=sandboxes / ".netns",
            gateway_netns=internet.gw_path,
            warm=1,
        )
        net = EdgeNetwork(f"vmnet{os.urandom(3).hex()}", cfg)
        await net.start()
        be = n.microvm(
            "e0a1",
            sandboxes_dir=sandboxes,
            kernel_image=kernel.current_kernel(Paths.from_env().data),
            network=net,
        )
        try:
            yield be, net
        finally:
            for sid in list(net._nets):
                await net.destroy(sid)
            await net.release()


async def sh(sock: Path, cmd: str) -> tuple[int, str]:
    res = await agent_client.call(sock, {"op": "exec", "cmd": cmd}, timeout=60)
    out = (res.stdout + res.stderr).decode().strip()
    return int(res.result.get("exit_code", -1)), out


def tcp(ip: str, port: int) -> str:
    return f"timeout 3 bash -c 'exec 3<>/dev/tcp/{ip}/{port}; head -c 5 <&3'"


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_microvm_policed_like_a_container(
    vmnet: tuple[MicrovmBackend, EdgeNetwork], internet: FakeInternet
) -> None:
    be, edgenet = vmnet
    assert be.capabilities().network_policy
    # another sandbox's network (a container's: plain namespace) with a server on :7000
    peer = await edgenet.create("peer-ns", NetworkPolicy())
    srv = subprocess.Popen(
        ["nsenter", f"--net={peer.netns}", "python3", "-c", LISTEN.format(port=7000)]
    )
    # a server in the gateway (the edge host): its loopback and addresses stay closed
    host_srv = subprocess.Popen(
        ["nsenter", f"--net={internet.gw_path}", "python3", "-c", LISTEN.format(port=7100)]
    )
    sid = new_sandbox_id("e0a1", os.urandom(13))
    paths = SandboxPaths(
        state_dir=be.sandboxes_dir / sid, agent_socket=be.paths.run / "sbx" / f"{sid}.sock"
    )
    policy = NetworkPolicy(allow=("web1.test.example", f"{WEB2}:80"))
    t0 = time.monotonic()
    await be.create(sid, SandboxSpec(backend="microvm", memory_mb=256, network=policy), paths)
    boot_s = time.monotonic() - t0
    net = edgenet.get(sid)
    assert net is not None
    sock = paths.agent_socket
    try:
        assert net.tap
        _rc, out = await sh(sock, "cat /etc/resolv.conf")
        assert f"nameserver {net.gateway}" in out, out
        _rc, addrs = await sh(sock, "cat /proc/net/fib_trie")
        assert net.address in addrs
        assert await sh(sock, tcp(WEB2, 80)) == (0, "hello")
        assert (await sh(sock, tcp(WEB2, 443)))[0] != 0
        assert (await sh(sock, tcp(WEB1, 80)))[0] != 0  # not resolved yet
        _rc, out = await sh(sock, "getent hosts web1.test.example")
        assert out.split()[:1] == [WEB1], out
        assert await sh(sock, tcp(WEB1, 443)) == (0, "hello")
        assert (await sh(sock, "getent hosts api.svc.example"))[0] != 0
        assert (await sh(sock, tcp(WEB3, 80)))[0] != 0  # default deny
        # the edge host: neither its address on our link nor its uplink address
        for host_ip in (net.gateway, "198.18.0.1", "127.0.0.1"):
            assert (await sh(sock, tcp(host_ip, 7100)))[0] != 0, host_ip
        # the other sandbox: closed until a rule names it, then only that port
        assert (await sh(sock, tcp(peer.address, 7000)))[0] != 0
        await be.set_network(sid, NetworkPolicy(allow=(f"{peer.address}/32:7000", f"{WEB3}:80")))
        assert await sh(sock, tcp(peer.address, 7000)) == (0, "peer!")
        assert await sh(sock, tcp(WEB3, 80)) == (0, "hello")
        assert (await sh(sock, tcp(WEB2, 80)))[0] != 0
        # ingress: a server in the guest, reachable from the internet only once a rule says so
        await sh(sock, f"cat > /root/srv.py <<'EOF'\n{LISTEN.format(port=7200)}EOF")
        await sh(sock, "nohup python3 /root/srv.py >/dev/null 2>&1 &")
        inet = Path(f"/run/netns/{internet.inet}")
        deadline = time.monotonic() + 30
        while (await sh(sock, tcp("127.0.0.1", 7200)))[1] != "peer!":
            assert time.monotonic() < deadline, "the guest's server did not start"
        assert not probe(inet, "tcp", net.address, 7200, 1.0).startswith("peer!")
        await be.set_network(
            sid,
            NetworkPolicy(
                allow=(f"{peer.address}/32:7000", f"{WEB3}:80", "from:198.18.0.0/24:7200")
            ),
        )
        assert probe(inet, "tcp", net.address, 7200, 1.0) == "peer!"
        # pause (QEMU quits) and resume (a new QEMU in the same namespace, same TAP)
        await be.pause(sid)
        await be.resume(sid)
        assert await sh(sock, tcp(WEB3, 80)) == (0, "hello")
        stats = await be.network_stats(sid)
        assert stats["allowed_connections"] >= 6
        assert stats["denied_connections"] >= 5
        with pytest.raises(InvalidArgument):  # children would share the parent's address
            await be.fork(sid, [(new_sandbox_id("e0a1", os.urandom(13)), paths)])
    finally:
        srv.kill()
        host_srv.kill()
        srv.wait()
        host_srv.wait()
        await be.destroy(sid, paths)
    print(f"microVM with network booted in {boot_s:.1f} s")
    assert edgenet.get(sid) is None
    assert await edgenet.leaked(sid, net.key) == []
    assert not net.netns.exists()
    assert not paths.state_dir.exists()


@pytest.mark.asyncio
async def test_vm_backend_without_edge_networking_refuses_rules() -> None:
    from dsec.edge.backends.vm.backend import VmBackend

    paths = Paths(home=Path("/nonexistent"), data=Path("/nonexistent"), run=Path("/nonexistent"))
    be = VmBackend(paths, "e0a1", image_store=testkit.shared_base_store(), network=None)
    assert not be.capabilities().network_policy
    with pytest.raises(InvalidArgument):
        await be.create(
            "e0a1-" + "a" * 26,
            SandboxSpec(backend="vm", network=NetworkPolicy(allow=("1.2.3.4",))),
            SandboxPaths(state_dir=Path("/nonexistent/x"), agent_socket=Path("/nonexistent/s")),
        )
    await asyncio.sleep(0)
