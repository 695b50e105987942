"""What the microVM and full-VM integration tests share.

A throw-away node for one VM backend (temporary home, run and memory directories, a cgroup
parent of its own, removed after with a check that no sandbox cgroup was left), why the
QEMU microVM tests cannot run here, small helpers that talk to a guest or look for its
QEMU processes, and the network policy check both VM backends must pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from dsec.agent.bundle import build_bundle
from dsec.core.ids import new_sandbox_id
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.api import SandboxPaths
from dsec.edge.backends.container import cgroups, testkit
from dsec.edge.backends.microvm import kernel, qemu
from dsec.edge.backends.microvm.backend import MicrovmBackend
from dsec.edge.images.base import BASE_IMAGE
from dsec.edge.net.edgenet import EdgeNetwork, SandboxNet
from dsec.paths import Paths
from tests.integration.fakenet import WEB1, WEB2, WEB3, FakeInternet

B = TypeVar("B", bound=MicrovmBackend)


def node_skip_reason() -> str | None:
    """Why a microVM backend's node cannot be made here (cgroups, erofs image layers)."""
    if os.geteuid() != 0:
        return "needs root (cgroups)"
    if shutil.which("mkfs.erofs") is None:
        return "needs mkfs.erofs (apt-get install erofs-utils)"
    if not testkit.installed_store().has(BASE_IMAGE) and testkit.base_tar() is None:
        return "the base image is not built (run `dsec setup`)"
    return None


def microvm_skip_reason() -> str | None:
    """Why QEMU microVMs with the guest kernel `dsec setup` built cannot run here."""
    why = node_skip_reason() or qemu.available()
    if why:
        return why
    if kernel.current_kernel(Paths.from_env().data) is None:
        return "no guest kernel: run `dsec setup` (builds it from linux-source-6.1)"
    return None


@dataclass
class Node:
    """Temporary directories and a private cgroup parent for one VM backend."""

    root: Path
    paths: Paths
    mem: Path
    cgroup_parent: str

    def microvm(self, edge_id: str, **kwargs: Any) -> MicrovmBackend:
        """A microVM backend on this node, its images from the shared ``base`` store."""
        return MicrovmBackend(
            self.paths,
            edge_id,
            image_store=testkit.shared_base_store(),
            cgroup_parent=self.cgroup_parent,
            mem_dir=self.mem,
            **kwargs,
        )


@contextmanager
def node(
    prefix: str, run_prefix: str, *, data: Path | None = None, check_cgroups: bool = True
) -> Iterator[Node]:
    """A :class:`Node` (with its own agent bundle unless ``data`` is given), removed after;
    with ``check_cgroups`` a sandbox cgroup left under its parent fails the caller."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    run = Path(tempfile.mkdtemp(prefix=run_prefix, dir="/tmp"))  # unix socket paths: short
    mem = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    paths = Paths(home=root / "home", data=data or root / "data", run=run)
    (run / "sbx").mkdir()
    if data is None:
        build_bundle(paths.agent_bundle)
    parent = f"dsectest-{os.urandom(4).hex()}"
    try:
        yield Node(root, paths, mem, parent)
    finally:
        left = cgroups.list_children(cgroups.detect(), parent)
        cgroups.remove(cgroups.detect(), "/" + parent)
        for d in (root, run, mem):
            shutil.rmtree(d, ignore_errors=True)
    assert not (check_cgroups and left), f"cgroups left: {left}"


@dataclass
class Env(Generic[B]):
    """A VM backend on a :class:`Node`, and fresh sandbox ids and paths for it."""

    paths: Paths
    backend: B
    cgroup_parent: str
    edge_id: str

    def sandbox(self) -> tuple[str, SandboxPaths]:
        sid = new_sandbox_id(self.edge_id, os.urandom(13))
        return sid, SandboxPaths(
            state_dir=self.backend.sandboxes_dir / sid,
            agent_socket=self.paths.run / "sbx" / f"{sid}.sock",
        )


async def sh(sock: Path, cmd: str, timeout: float = 30) -> str:
    """Run ``cmd`` in the guest; its stdout (it must exit 0)."""
    res = await agent_client.call(sock, {"op": "exec", "cmd": cmd}, timeout=timeout)
    out = res.result
    assert out.get("exit_code") == 0, (cmd, out, res.stdout, res.stderr)
    return res.stdout.decode()


def qemu_pids_under(path: Path) -> list[int]:
    """QEMU processes whose command line names ``path`` (only ours)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if qemu.QEMU in cmd and str(path) in cmd:
                out.append(int(p.name))
    return out


# a server that answers "peer!" to every connection
LISTEN = (
    "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    "s.bind(('',{port}));s.listen()\n"
    "while True:\n c,_=s.accept();c.sendall(b'peer!');c.close()\n"
)


async def run(sock: Path, cmd: str) -> tuple[int, str]:
    """Run ``cmd`` in the guest: its exit code and its output (stdout and stderr)."""
    res = await agent_client.call(sock, {"op": "exec", "cmd": cmd}, timeout=60)
    out = (res.stdout + res.stderr).decode().strip()
    return int(res.result.get("exit_code", -1)), out


@dataclass
class PolicedVm:
    """The VM under :func:`check_policed_like_a_container`, for a backend's own checks."""

    sid: str
    paths: SandboxPaths
    net: SandboxNet
    peer: SandboxNet  # another sandbox's network, with a "peer!" server on :7000
    tcp_timeout_s: int

    async def run(self, cmd: str) -> tuple[int, str]:
        return await run(self.paths.agent_socket, cmd)

    async def tcp(self, ip: str, port: int) -> tuple[int, str]:
        """Connect from the guest; the exit code and the first 5 bytes the server sent."""
        t = self.tcp_timeout_s
        return await self.run(f"timeout {t} bash -c 'exec 3<>/dev/tcp/{ip}/{port}; head -c 5 <&3'")


Extra = Callable[[PolicedVm], Awaitable[None]]


async def check_policed_like_a_container(
    be: MicrovmBackend,
    edgenet: EdgeNetwork,
    internet: FakeInternet,
    *,
    memory_mb: int,
    tcp_timeout_s: int,
    guest_network: Extra,
    after: Extra | None = None,
) -> None:
    """Boot one VM of ``be`` with a policy and check it is policed like a container.

    ``guest_network`` checks how the guest took its address; then allowed CIDR and domain
    work and the rest is denied, the edge host and another sandbox are closed until a rule
    says so, a live policy change applies; ``after`` runs then, before destroy, which must
    leave no namespace, TAP or nft object.
    """
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
    sid = new_sandbox_id(be.edge_id, os.urandom(13))
    paths = SandboxPaths(
        state_dir=be.sandboxes_dir / sid, agent_socket=be.paths.run / "sbx" / f"{sid}.sock"
    )
    policy = NetworkPolicy(allow=("web1.test.example", f"{WEB2}:80"))
    t0 = time.monotonic()
    await be.create(sid, SandboxSpec(backend=be.name, memory_mb=memory_mb, network=policy), paths)
    boot_s = time.monotonic() - t0
    net = edgenet.get(sid)
    assert net is not None
    vm = PolicedVm(sid, paths, net, peer, tcp_timeout_s)
    tcp = vm.tcp
    try:
        assert net.tap
        _rc, out = await vm.run("cat /etc/resolv.conf")
        assert f"nameserver {net.gateway}" in out, out
        await guest_network(vm)
        assert await tcp(WEB2, 80) == (0, "hello")
        assert (await tcp(WEB2, 443))[0] != 0
        assert (await tcp(WEB1, 80))[0] != 0  # not resolved yet
        _rc, out = await vm.run("getent hosts web1.test.example")
        assert out.split()[:1] == [WEB1], out
        assert await tcp(WEB1, 443) == (0, "hello")
        assert (await vm.run("getent hosts api.svc.example"))[0] != 0
        assert (await tcp(WEB3, 80))[0] != 0  # default deny
        # the edge host: neither its address on our link nor its uplink address
        for host_ip in (net.gateway, "198.18.0.1", "127.0.0.1"):
            assert (await tcp(host_ip, 7100))[0] != 0, host_ip
        # the other sandbox: closed until a rule names it, then only that port
        assert (await tcp(peer.address, 7000))[0] != 0
        await be.set_network(sid, NetworkPolicy(allow=(f"{peer.address}/32:7000", f"{WEB3}:80")))
        assert await tcp(peer.address, 7000) == (0, "peer!")
        assert await tcp(WEB3, 80) == (0, "hello")
        assert (await tcp(WEB2, 80))[0] != 0
        stats = await be.network_stats(sid)
        assert stats["allowed_connections"] >= 4
        assert stats["denied_connections"] >= 5
        if after is not None:
            await after(vm)
    finally:
        srv.kill()
        host_srv.kill()
        srv.wait()
        host_srv.wait()
        await be.destroy(sid, paths)
    print(f"{be.name} with network booted in {boot_s:.1f} s")
    assert edgenet.get(sid) is None
    assert await edgenet.leaked(sid, net.key) == []
    assert not net.netns.exists()
    assert not paths.state_dir.exists()
