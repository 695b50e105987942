"""Full VMs (``backend="vm"``) on the same pooled network as containers (root only).

One TCG boot of the Debian image: QEMU runs in the sandbox's namespace with its TAP, the
image's ``dsec-net.service`` applies ``ip=`` (Debian's kernel has no IP_PNP), and the VM
is policed by the same nft chains as a container: allowed CIDR and domain work, the rest
is denied, the edge host and other sandboxes are closed until a rule says so, a live
policy change applies, and destroy leaves no namespace, TAP or nft object.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core.ids import new_sandbox_id
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.vm.backend import VmBackend
from dsec.edge.images.store import ImageStore
from dsec.edge.net.config import NetConfig
from dsec.edge.net.edgenet import EdgeNetwork
from dsec.paths import Paths
from tests.integration.fakenet import DNS_IP, POOL, WEB1, WEB2, WEB3, FakeInternet
from tests.integration.test_net_microvm import LISTEN, sh
from tests.integration.test_vm_backend import _skip_reason

pytestmark = [pytest.mark.root]


def tcp(ip: str, port: int) -> str:
    # a systemd guest under TCG on a busy host can take seconds to start bash: allowed
    # connections get time; denied ones are rejected at once (ICMP admin-prohibited)
    return f"timeout 30 bash -c 'exec 3<>/dev/tcp/{ip}/{port}; head -c 5 <&3'"


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
async def vmnet(internet: FakeInternet) -> AsyncIterator[tuple[VmBackend, EdgeNetwork]]:
    root = Path(tempfile.mkdtemp(prefix="dsec-fullvmnet-"))
    run = Path(tempfile.mkdtemp(prefix="dsfn", dir="/tmp"))
    mem = Path(tempfile.mkdtemp(prefix="dsec-fullvmnet-", dir="/dev/shm"))
    paths = Paths(home=root / "home", data=Paths.from_env().data, run=run)
    (run / "sbx").mkdir()
    sandboxes = root / "sandboxes"
    cfg = NetConfig(
        pool=POOL,
        upstream_dns=f"{DNS_IP}:53",
        state_dir=paths.home / "edge" / "net",
        netns_dir=sandboxes / ".netns",
        gateway_netns=internet.gw_path,
        warm=1,
    )
    net = EdgeNetwork(f"fvmnet{os.urandom(3).hex()}", cfg)
    await net.start()
    parent = f"dsectest-{os.urandom(4).hex()}"
    be = VmBackend(
        paths,
        "e0f2",
        image_store=ImageStore(root / "images"),
        cgroup_parent=parent,
        sandboxes_dir=sandboxes,
        mem_dir=mem,
        network=net,
    )
    be.boot_timeout_s = 1000.0  # this test's whole budget: hosts shared with builds crawl
    try:
        yield be, net
    finally:
        for sid in list(net._nets):
            await net.destroy(sid)
        await net.release()
        cgroups.remove(cgroups.detect(), "/" + parent)
        for d in (root, run, mem):
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.asyncio
@pytest.mark.timeout(1200)  # a systemd boot under TCG: minutes on a loaded 2-core host
async def test_vm_policed_like_a_container(
    vmnet: tuple[VmBackend, EdgeNetwork], internet: FakeInternet
) -> None:
    be, edgenet = vmnet
    assert be.capabilities().network_policy
    peer = await edgenet.create("peer-ns", NetworkPolicy())
    srv = subprocess.Popen(
        ["nsenter", f"--net={peer.netns}", "python3", "-c", LISTEN.format(port=7000)]
    )
    host_srv = subprocess.Popen(
        ["nsenter", f"--net={internet.gw_path}", "python3", "-c", LISTEN.format(port=7100)]
    )
    sid = new_sandbox_id("e0f2", os.urandom(13))
    paths = SandboxPaths(
        state_dir=be.sandboxes_dir / sid, agent_socket=be.paths.run / "sbx" / f"{sid}.sock"
    )
    policy = NetworkPolicy(allow=("web1.test.example", f"{WEB2}:80"))
    t0 = time.monotonic()
    await be.create(sid, SandboxSpec(backend="vm", memory_mb=512, network=policy), paths)
    boot_s = time.monotonic() - t0
    net = edgenet.get(sid)
    assert net is not None
    sock = paths.agent_socket
    try:
        assert net.tap
        assert await sh(sock, "systemctl is-active dsec-net.service") == (0, "active")
        _rc, out = await sh(sock, "cat /etc/resolv.conf")
        assert f"nameserver {net.gateway}" in out, out
        _rc, out = await sh(sock, "ip -4 -o addr show dev eth0")
        assert f"{net.address}/30" in out, out
        assert await sh(sock, tcp(WEB2, 80)) == (0, "hello")
        assert (await sh(sock, tcp(WEB2, 443)))[0] != 0
        assert (await sh(sock, tcp(WEB1, 80)))[0] != 0  # not resolved yet
        _rc, out = await sh(sock, "getent hosts web1.test.example")
        assert out.split()[:1] == [WEB1], out
        assert await sh(sock, tcp(WEB1, 443)) == (0, "hello")
        assert (await sh(sock, "getent hosts api.svc.example"))[0] != 0
        assert (await sh(sock, tcp(WEB3, 80)))[0] != 0  # default deny
        for host_ip in (net.gateway, "198.18.0.1", "127.0.0.1"):
            assert (await sh(sock, tcp(host_ip, 7100)))[0] != 0, host_ip
        assert (await sh(sock, tcp(peer.address, 7000)))[0] != 0
        await be.set_network(sid, NetworkPolicy(allow=(f"{peer.address}/32:7000", f"{WEB3}:80")))
        assert await sh(sock, tcp(peer.address, 7000)) == (0, "peer!")
        assert await sh(sock, tcp(WEB3, 80)) == (0, "hello")
        assert (await sh(sock, tcp(WEB2, 80)))[0] != 0
        stats = await be.network_stats(sid)
        assert stats["allowed_connections"] >= 4
        assert stats["denied_connections"] >= 5
    finally:
        srv.kill()
        host_srv.kill()
        srv.wait()
        host_srv.wait()
        await be.destroy(sid, paths)
    print(f"VM with network booted in {boot_s:.1f} s")
    assert edgenet.get(sid) is None
    assert await edgenet.leaked(sid, net.key) == []
    assert not net.netns.exists()
    assert not paths.state_dir.exists()
