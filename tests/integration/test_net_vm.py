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
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.edge.backends.container import cgroups
from dsec.edge.backends.vm.backend import VmBackend
from dsec.edge.images.store import ImageStore
from dsec.edge.net.config import NetConfig
from dsec.edge.net.edgenet import EdgeNetwork
from dsec.paths import Paths
from tests.integration import vmkit
from tests.integration.fakenet import DNS_IP, POOL, FakeInternet
from tests.integration.test_vm_backend import _skip_reason

pytestmark = [pytest.mark.root]


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

    async def address_from_dsec_net_service(vm: vmkit.PolicedVm) -> None:
        assert await vm.run("systemctl is-active dsec-net.service") == (0, "active")
        _rc, out = await vm.run("ip -4 -o addr show dev eth0")
        assert f"{vm.net.address}/30" in out, out

    # a systemd guest under TCG on a busy host can take seconds to start bash: allowed
    # connections get time; denied ones are rejected at once (ICMP admin-prohibited)
    await vmkit.check_policed_like_a_container(
        be,
        edgenet,
        internet,
        memory_mb=512,
        tcp_timeout_s=30,
        guest_network=address_from_dsec_net_service,
    )
