"""Container sandboxes joining the network dsec.edge.net prepares (root only)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from dsec.core.errors import InvalidArgument
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.container.backend import ContainerBackend
from dsec.edge.backends.container.testkit import ContainerTestEnv
from dsec.edge.net.config import NetConfig
from dsec.edge.net.edgenet import EdgeNetwork
from tests.integration.fakenet import DNS_IP, WEB1, WEB2, WEB3, FakeInternet

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def internet() -> Iterator[FakeInternet]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    inet = FakeInternet().start()
    try:
        yield inet
    finally:
        inet.close()


@pytest_asyncio.fixture
async def backend(
    cenv: ContainerTestEnv, internet: FakeInternet
) -> AsyncIterator[ContainerBackend]:
    sandboxes = cenv.paths.home / "edge" / "sandboxes"
    cfg = NetConfig(
        pool="10.213.0.0/16",
        upstream_dns=f"{DNS_IP}:53",
        state_dir=cenv.paths.home / "edge" / "net",
        netns_dir=sandboxes / ".netns",
        gateway_netns=internet.gw_path,
    )
    net = EdgeNetwork("ctest", cfg)
    await net.start()
    try:
        yield ContainerBackend(
            cenv.paths,
            "e0a1",
            image_store=cenv.store,
            cgroup_parent=cenv.cgroup_parent,
            network=net,
        )
    finally:
        await net.release()


async def sh(backend: ContainerBackend, sid: str, script: str) -> tuple[int, str]:
    res = await backend.crun.exec(sid, ["/bin/bash", "-c", script], time_limit=20)
    return res.returncode, (res.stdout + res.stderr).decode().strip()


def tcp(ip: str, port: int) -> str:
    return f"timeout 3 bash -c 'exec 3<>/dev/tcp/{ip}/{port}; head -c 5 <&3'"


@pytest.mark.asyncio
async def test_container_joins_policed_network(
    cenv: ContainerTestEnv, backend: ContainerBackend
) -> None:
    assert backend.network is not None
    sid, paths = cenv.sandbox()
    spec = SandboxSpec(network=NetworkPolicy(allow=("web1.test.example", f"{WEB2}:80")))
    await backend.create(sid, spec, paths)
    try:
        net = backend.network.get(sid)
        assert net is not None
        assert (await sh(backend, sid, "ls /sys/class/net"))[1].split() == ["eth0", "lo"]
        assert (await sh(backend, sid, "cat /etc/resolv.conf"))[1].startswith(
            f"nameserver {net.gateway}"
        )
        assert await sh(backend, sid, tcp(WEB2, 80)) == (0, "hello")
        assert (await sh(backend, sid, tcp(WEB1, 80)))[0] != 0  # not resolved yet
        _rc, out = await sh(backend, sid, "getent hosts web1.test.example")
        assert out.split()[0] == WEB1
        assert await sh(backend, sid, tcp(WEB1, 80)) == (0, "hello")
        assert (await sh(backend, sid, "getent hosts api.svc.example"))[0] != 0
        assert (await sh(backend, sid, tcp(WEB3, 80)))[0] != 0
        # root inside cannot touch its network setup
        assert (await sh(backend, sid, "echo 1 > /proc/sys/net/ipv4/ip_forward"))[0] != 0
        # live change
        await backend.set_network(sid, NetworkPolicy(allow=(f"{WEB3}:80",)))
        assert await sh(backend, sid, tcp(WEB3, 80)) == (0, "hello")
        assert (await sh(backend, sid, tcp(WEB2, 80)))[0] != 0
        stats = await backend.network_stats(sid)
        assert stats["allowed_connections"] >= 3
        assert stats["denied_connections"] >= 2
    finally:
        await backend.destroy(sid, paths)
    assert await asyncio.to_thread(backend.leaked, sid, paths) == []
    assert await backend.network.leaked(sid, net.key) == []


@pytest.mark.asyncio
async def test_rules_refused_without_networking(cenv: ContainerTestEnv) -> None:
    backend = cenv.backend()
    sid, paths = cenv.sandbox()
    with pytest.raises(InvalidArgument):
        await backend.create(sid, SandboxSpec(network=NetworkPolicy(allow=("1.2.3.4",))), paths)
