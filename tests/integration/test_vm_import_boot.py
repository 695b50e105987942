"""An imported VM image boots under QEMU (q35, TCG here) and serves the runtime API.

The image is made from the one ``dsec setup --vm-image`` built, turned into what a user
would bring: our units and network script removed, the ext4 root moved into partition 1
of a GPT disk laid out like a cloud image's, as qcow2 (plus the bare filesystem as raw,
imported only). The import puts the agent back; the VM boots the image's own kernel and
systemd from ``/dev/vda1``.
One boot on purpose: a systemd boot under TCG costs minutes on a busy host.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.core.errors import ImageNotFound, InvalidState
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import RuntimeState
from dsec.edge.backends.microvm import qemu
from dsec.edge.backends.vm import image as vm_image
from dsec.edge.backends.vm import imports
from dsec.edge.backends.vm.backend import VmBackend
from dsec.edge.images.store import ImageStore
from dsec.paths import Paths
from tests.integration import vmkit
from tests.integration.fakedisk import GPT_ROOT_OFFSET, gpt

Env = vmkit.Env[VmBackend]
REMOVED = (
    "/etc/systemd/system/sysinit.target.wants/dsec-aether.service",
    "/etc/systemd/system/sysinit.target.wants/dsec-vmport.service",
    "/etc/systemd/system/sysinit.target.wants/dsec-net.service",
    "/etc/systemd/system/sockets.target.wants/dsec-aether.socket",
    "/etc/systemd/system/dsec-aether.service",
    "/etc/systemd/system/dsec-aether.socket",
    "/etc/systemd/system/dsec-vmport.service",
    "/etc/systemd/system/dsec-net.service",
    "/usr/local/sbin/dsec-net",
    "/usr/local/sbin/dsec-vmport",
)


def _skip_reason() -> str | None:
    why = imports.missing() or qemu.available()
    if why:
        return why
    if shutil.which("debugfs") is None:
        return "needs debugfs (e2fsprogs)"
    if vm_image.current_image(Paths.from_env().data) is None:
        return "no VM system image to make a user image of: run `dsec setup --vm-image`"
    return None


def _user_disks(d: Path) -> tuple[Path, Path]:
    """The built image without our units: (bare ext4 as raw, GPT-partitioned qcow2)."""
    built = vm_image.current_image(Paths.from_env().data)
    assert built is not None
    fs = d / "root.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(built.disk), str(fs)], check=True)
    for path in REMOVED:
        subprocess.run(["debugfs", "-w", "-R", f"rm {path}", str(fs)], check=True,
                       capture_output=True)  # fmt: skip
    ls = subprocess.run(["debugfs", "-R", "ls /etc/systemd/system", str(fs)],
                        capture_output=True, text=True).stdout  # fmt: skip
    assert "dsec-aether" not in ls, ls
    disk = gpt(fs, d / "disk.raw", fill=False)
    subprocess.run(
        ["qemu-img", "convert", "-n", "-f", "raw", str(fs), "--target-image-opts",
         f"driver=raw,offset={GPT_ROOT_OFFSET},size={fs.stat().st_size},file.filename={disk}"],
        check=True,
    )  # fmt: skip
    qcow = d / "disk.qcow2"
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", str(disk), str(qcow)], check=True)
    disk.unlink()
    return fs, qcow


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    # A private data dir (imports are written there) with the installed agent bundle.
    data = tmp_path_factory.mktemp("vmimport-data")
    (data / "agent").symlink_to(Paths.from_env().agent_bundle)
    with vmkit.node("dsec-vmimport-", "dsi", data=data) as n:
        be = VmBackend(
            n.paths,
            "e0f2",
            image_store=ImageStore(n.root / "images"),
            cgroup_parent=n.cgroup_parent,
            sandboxes_dir=n.root / "sandboxes",
            mem_dir=n.mem,
        )
        yield Env(n.paths, be, n.cgroup_parent, "e0f2")


@pytest.mark.asyncio
@pytest.mark.timeout(1800)  # two imports of a 750 MB disk and a systemd boot under TCG
async def test_imported_image_boots_and_serves_the_runtime_api(env: Env, tmp_path: Path) -> None:
    be = env.backend
    data = env.paths.data
    fs, qcow = _user_disks(tmp_path)
    t0 = time.monotonic()
    flat = imports.import_disk(data, "flat", fs, env.paths.agent_bundle)
    assert flat.root == "/dev/vda"
    t1 = time.monotonic()
    img = imports.import_disk(data, "user-debian", qcow, env.paths.agent_bundle)
    print(f"import: raw {t1 - t0:.1f} s, partitioned qcow2 {time.monotonic() - t1:.1f} s")
    assert (img.root, img.fstype) == ("/dev/vda1", "ext4")
    assert be.availability().available
    with pytest.raises(ImageNotFound, match="import-vm"):
        be._image(SandboxSpec(backend="vm", image="nosuch"))

    sid, paths = env.sandbox()
    spec = SandboxSpec(backend="vm", image="user-debian", memory_mb=512, env={"WHO": "user"})
    t2 = time.monotonic()
    started = await be.create(sid, spec, paths)
    print(f"create (boot until systemd is up): {time.monotonic() - t2:.1f} s")
    try:
        sock = paths.agent_socket
        assert (await vmkit.sh(sock, "cat /proc/1/comm")).strip() == "systemd"
        assert (await vmkit.sh(sock, "uname -r")).strip() == img.kernel_version
        assert (await vmkit.sh(sock, "findmnt -n -o SOURCE /")).strip() == "/dev/vda1"
        assert (await vmkit.sh(sock, "systemctl is-active dsec-aether.service")).strip() == (
            "active"
        )
        assert (await vmkit.sh(sock, 'echo "$WHO in $(hostname)"')).strip() == f"user in {sid}"
        info = subprocess.run(
            ["qemu-img", "info", "-U", str(paths.state_dir / "scratch.qcow2")],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert str(img.disk(data)) in info, info  # an overlay on the import, not a copy
        assert (await be.state(sid)) == (RuntimeState.RUNNING, started.pid)
        with pytest.raises(InvalidState, match=sid):
            imports.remove(data, "user-debian", edge_dir=be.sandboxes_dir.parent)
    finally:
        await be.destroy(sid, paths)
    assert (await be.state(sid))[0] is RuntimeState.MISSING
    assert imports.remove(data, "user-debian", edge_dir=be.sandboxes_dir.parent)
    assert imports.remove(data, "flat")
    assert not vmkit.qemu_pids_under(paths.state_dir)
    assert [p.name for p in imports.imports_root(data).iterdir()] == [".lock"]
