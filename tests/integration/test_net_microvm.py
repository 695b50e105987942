"""microVM sandboxes on the same pooled network as containers, through a TAP (root only).

One TCG boot: the guest gets its address from ``ip=``, the edge's resolver from its
config disk, and is policed by the same nft chains as a container: allowed CIDR and
domain work, the rest is denied, the gateway and other sandboxes are closed until a rule
says so, a live policy change applies, and destroy leaves no namespace, TAP or nft object.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core.errors import InvalidArgument
from dsec.core.ids import new_sandbox_id
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container import testkit
from dsec.edge.backends.microvm import kernel
from dsec.edge.backends.microvm.backend import MicrovmBackend
from dsec.edge.net.config import NetConfig
from dsec.edge.net.edgenet import EdgeNetwork
from dsec.paths import Paths
from tests.integration import vmkit
from tests.integration.fakenet import DNS_IP, POOL, WEB3, FakeInternet, probe
from tests.integration.vmkit import microvm_skip_reason as _skip_reason

pytestmark = [pytest.mark.root, pytest.mark.guest_kernel]


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


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_microvm_policed_like_a_container(
    vmnet: tuple[MicrovmBackend, EdgeNetwork], internet: FakeInternet
) -> None:
    be, edgenet = vmnet

    async def address_from_ip_param(vm: vmkit.PolicedVm) -> None:
        _rc, addrs = await vm.run("cat /proc/net/fib_trie")
        assert vm.net.address in addrs

    async def ingress_pause_resume_fork(vm: vmkit.PolicedVm) -> None:
        # ingress: a server in the guest, reachable from the internet only once a rule says so
        await vm.run(f"cat > /root/srv.py <<'EOF'\n{vmkit.LISTEN.format(port=7200)}EOF")
        await vm.run("nohup python3 /root/srv.py >/dev/null 2>&1 &")
        inet = Path(f"/run/netns/{internet.inet}")
        deadline = time.monotonic() + 30
        while (await vm.tcp("127.0.0.1", 7200))[1] != "peer!":
            assert time.monotonic() < deadline, "the guest's server did not start"
        assert not probe(inet, "tcp", vm.net.address, 7200, 1.0).startswith("peer!")
        allow = (f"{vm.peer.address}/32:7000", f"{WEB3}:80", "from:198.18.0.0/24:7200")
        await be.set_network(vm.sid, NetworkPolicy(allow=allow))
        assert probe(inet, "tcp", vm.net.address, 7200, 1.0) == "peer!"
        # pause (QEMU quits) and resume (a new QEMU in the same namespace, same TAP)
        await be.pause(vm.sid)
        await be.resume(vm.sid)
        assert await vm.tcp(WEB3, 80) == (0, "hello")
        stats = await be.network_stats(vm.sid)
        assert stats["allowed_connections"] >= 6  # the counters outlive the QEMU
        with pytest.raises(InvalidArgument):  # children would share the parent's address
            await be.fork(vm.sid, [(new_sandbox_id("e0a1", os.urandom(13)), vm.paths)])

    await vmkit.check_policed_like_a_container(
        be,
        edgenet,
        internet,
        memory_mb=256,
        tcp_timeout_s=3,
        guest_network=address_from_ip_param,
        after=ingress_pause_resume_fork,
    )


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
