"""Importing user VM images (``dsec image import-vm``): detection and every refusal, on
small disks made here (an ext4 root as a whole disk or in an MBR partition, with fake
kernel modules), with real ``losetup --partscan`` and ``mount``; each refusal must leave
no loop device, mount or work file behind. The boot of an imported image is in
``test_vm_import_boot.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.core.errors import AlreadyExists, InvalidArgument, InvalidState
from dsec.edge.backends.vm import imports
from dsec.edge.backends.vm.image import UNITS
from tests.integration.fakedisk import VERSION, bundle, ext4, gpt, mbr, rootfs


def _skip_reason() -> str | None:
    why = imports.missing()
    if why:
        return why
    if shutil.which("mkfs.ext4") is None:
        return "needs mkfs.ext4 (e2fsprogs)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


def _loops_of(d: Path) -> list[str]:
    out = subprocess.run(["losetup", "-n", "-O", "NAME,BACK-FILE"], capture_output=True,
                         text=True).stdout  # fmt: skip
    return [line for line in out.splitlines() if str(d) in line]


def _mounts_of(d: Path) -> list[str]:
    return [m for m in Path("/proc/self/mountinfo").read_text().splitlines() if str(d) in m]


def _assert_clean(tmp: Path, data: Path) -> None:
    assert not _loops_of(tmp), _loops_of(tmp)
    assert not _mounts_of(tmp), _mounts_of(tmp)
    root = imports.imports_root(data)
    left = [p.name for p in root.iterdir() if p.name != ".lock"] if root.exists() else []
    assert not [n for n in left if n.startswith(".")], left


def _import(tmp: Path, disk: Path, name: str = "img") -> imports.VmImport:
    return imports.import_disk(tmp / "data", name, disk, _bundle_once(tmp))


def _bundle_once(tmp: Path) -> Path:
    b = tmp / "bundle"
    return b if b.exists() else bundle(b)


def test_imports_a_partitioned_qcow2(tmp_path: Path) -> None:
    fs = ext4(rootfs(tmp_path / "tree"), tmp_path / "root.ext4")
    raw = mbr(fs, tmp_path / "disk.raw")
    qcow = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(qcow)], check=True)
    seen: list[str] = []
    img = imports.import_disk(
        tmp_path / "data", "testian", qcow, _bundle_once(tmp_path),
        progress=lambda s, _d, _t: seen.append(s),
    )  # fmt: skip
    data = tmp_path / "data"
    assert (img.root, img.fstype, img.kernel_version) == ("/dev/vda2", "ext4", VERSION)
    assert img.os_name == "Testian 1"
    assert img.source == "disk.qcow2"
    assert "installing the agent" in seen
    assert seen[-1] == "done"
    assert qcow.exists(), "a file the caller did not hand over stays"
    assert imports.find(data, "testian") == img
    assert [i.name for i in imports.list_imports(data)] == ["testian"]
    assert img.kernel(data).read_bytes() == b"kernel"
    assert oct(img.disk(data).stat().st_mode & 0o777) == "0o444"
    # The initramfs: our vmboot and the image's modules, deps first, decompressed, the
    # built-in ext4 left out.
    listing = subprocess.run(["cpio", "-it"], input=img.initrd(data).read_bytes(),
                             capture_output=True).stdout.decode()  # fmt: skip
    assert "init" in listing.split()
    mods = [n for n in listing.split() if n.startswith("m/")]
    assert [n.split("-", 1)[1] for n in mods] == [
        "virtio_pci_modern_dev.ko", "virtio_pci.ko", "virtio_blk.ko", "virtio_console.ko",
    ]  # fmt: skip
    # What went into the disk: read it back through qemu-img and debugfs, no mount.
    back = tmp_path / "back.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(img.disk(data)), str(back)],
                   check=True)  # fmt: skip
    part = tmp_path / "part.ext4"
    subprocess.run(["dd", f"if={back}", f"of={part}", "bs=512", "skip=4096", "status=none"],
                   check=True)  # fmt: skip

    def cat(p: str) -> str:
        r = subprocess.run(["debugfs", "-R", f"cat {p}", str(part)], capture_output=True)
        return r.stdout.decode()

    # The hostile /etc/systemd/system link was followed inside the image, not on the host.
    assert not Path("/etc/systemd-in-guest").exists()
    assert cat("/etc/systemd-in-guest/dsec-aether.service") == UNITS["dsec-aether.service"]
    assert cat("/.dsec/init") == "agent\n"
    links = subprocess.run(["debugfs", "-R", "ls -l /etc/systemd-in-guest/sysinit.target.wants",
                            str(part)], capture_output=True).stdout.decode()  # fmt: skip
    assert "dsec-vmport.service" in links
    assert "dsec-aether.service" in links
    sbin = subprocess.run(["debugfs", "-R", "ls /usr/local/sbin", str(part)],
                          capture_output=True).stdout.decode()  # fmt: skip
    assert "dsec-net" in sbin
    assert "dsec-vmport" in sbin  # the channel multiplexer (guest/vmport.c), static
    meta = json.loads((img.dir(data) / "meta.json").read_text())
    assert meta["root"] == "/dev/vda2"
    _assert_clean(tmp_path, data)

    with pytest.raises(AlreadyExists, match="exists"):
        _import(tmp_path, qcow, "testian")
    # A sandbox (or named snapshot) whose disk stands on the image keeps it.
    edge = tmp_path / "edge"
    (edge / "sandboxes" / "sbx-1").mkdir(parents=True)
    user = edge / "sandboxes" / "sbx-1" / "vm.json"
    user.write_text(json.dumps({"shared": {"disk": str(img.disk(data))}}))
    assert imports.users(data, "testian", edge) == ["sbx-1"]
    with pytest.raises(InvalidState, match="used by sbx-1"):
        imports.remove(data, "testian", edge_dir=edge)
    user.unlink()
    assert imports.remove(data, "testian", edge_dir=edge)
    assert not imports.remove(data, "testian")
    assert imports.list_imports(data) == []
    _assert_clean(tmp_path, data)


def test_whole_disk_filesystem_is_root_dev_vda(tmp_path: Path) -> None:
    fs = ext4(rootfs(tmp_path / "tree"), tmp_path / "root.ext4")
    img = _import(tmp_path, fs)
    assert img.root == "/dev/vda"
    assert fs.exists()


def test_gpt_like_a_cloud_image(tmp_path: Path) -> None:
    """Root on partition 1 of a GPT disk, an empty ESP as partition 15 (listed first on
    the disk)."""
    fs = ext4(rootfs(tmp_path / "tree"), tmp_path / "root.ext4")
    img = _import(tmp_path, gpt(fs, tmp_path / "disk.raw"))
    assert img.root == "/dev/vda1"
    _assert_clean(tmp_path, tmp_path / "data")


def _refused(tmp_path: Path, disk: Path, match: str, name: str = "img") -> None:
    data = tmp_path / "data"
    with pytest.raises(InvalidArgument, match=match):
        _import(tmp_path, disk, name)
    assert imports.find(data, name) is None
    _assert_clean(tmp_path, data)


def test_refuses_what_is_not_a_disk_image(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n" * 100)
    _refused(tmp_path, text, "not a disk image")
    zeros = tmp_path / "zeros.img"
    zeros.write_bytes(b"\0" * (2 << 20))
    _refused(tmp_path, zeros, "not a disk image: no partition table and no filesystem")
    vdi = tmp_path / "disk.vdi"
    subprocess.run(["qemu-img", "create", "-q", "-f", "vdi", str(vdi), "16M"], check=True)
    _refused(tmp_path, vdi, "disk format 'vdi'")


def test_refuses_a_disk_without_a_linux_root(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "docs").mkdir(parents=True)
    (tree / "docs" / "a.txt").write_text("data\n")
    fs = ext4(tree, tmp_path / "data.ext4")
    _refused(tmp_path, mbr(fs, tmp_path / "disk.raw"), r"no Linux root filesystem found \(")


def test_refuses_a_root_without_systemd_or_kernel(tmp_path: Path) -> None:
    fs = ext4(rootfs(tmp_path / "a", init="/usr/bin/other-init"), tmp_path / "a.ext4")
    _refused(tmp_path, fs, "no systemd: /sbin/init is usr/bin/other-init")
    fs = ext4(rootfs(tmp_path / "b", init="/nowhere"), tmp_path / "b.ext4")
    _refused(tmp_path, fs, "no systemd: /sbin/init is missing")
    fs = ext4(rootfs(tmp_path / "c", kernel=False), tmp_path / "c.ext4")
    _refused(tmp_path, fs, "no kernel")


def test_refuses_a_truncated_qcow2_and_a_backing_file(tmp_path: Path) -> None:
    fs = ext4(rootfs(tmp_path / "tree"), tmp_path / "root.ext4")
    qcow = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", str(fs), str(qcow)], check=True)
    with qcow.open("r+b") as f:
        f.truncate(qcow.stat().st_size // 2)
    _refused(tmp_path, qcow, "truncated")
    over = tmp_path / "over.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(fs),
                    str(over)], check=True)  # fmt: skip
    _refused(tmp_path, over, "backing file")


def test_names_and_consumed_uploads(tmp_path: Path) -> None:
    fs = ext4(rootfs(tmp_path / "tree"), tmp_path / "root.ext4")
    with pytest.raises(InvalidArgument, match="VM image name"):
        _import(tmp_path, fs, "Bad/Name")
    with pytest.raises(AlreadyExists, match="built-in"):
        _import(tmp_path, fs, "base")
    # An upload handed over (consume=True) is gone afterwards, imported or refused.
    up = imports.upload_path(tmp_path / "data")
    up.write_text("not a disk\n")
    with pytest.raises(InvalidArgument):
        imports.import_disk(tmp_path / "data", "up", up, _bundle_once(tmp_path), consume=True)
    assert not up.exists()
    up = imports.upload_path(tmp_path / "data")
    shutil.copyfile(fs, up)
    imports.import_disk(tmp_path / "data", "up", up, _bundle_once(tmp_path), consume=True)
    assert not up.exists()
    assert imports.find(tmp_path / "data", "up") is not None
    _assert_clean(tmp_path, tmp_path / "data")
    assert os.geteuid() == 0


@pytest.mark.asyncio
async def test_edge_load_with_kind_vm_imports_lists_and_removes(tmp_path: Path) -> None:
    """The edge's LoadImage with kind "vm": upload to a file, import, list, remove; a
    refused upload leaves no file."""
    from dsec.edge.images.service import EdgeImages
    from dsec.edge.images.store import ImageStore
    from dsec.paths import Paths
    from dsec.rpc._gen import dsec_pb2 as pb

    paths = Paths(home=tmp_path / "home", data=tmp_path / "data", run=tmp_path / "run")
    shutil.copytree(_bundle_once(tmp_path), paths.agent_bundle)
    edge = EdgeImages(ImageStore(tmp_path / "images"), "e0a1", None, vm_paths=paths)
    fs = ext4(rootfs(tmp_path / "tree"), tmp_path / "root.ext4")

    async def requests(name: str, blob: bytes) -> AsyncIterator[pb.LoadImageRequest]:
        yield pb.LoadImageRequest(name=name, kind="vm")
        for i in range(0, len(blob), 1 << 20):
            yield pb.LoadImageRequest(data=blob[i : i + (1 << 20)])

    reqs = requests("deb", fs.read_bytes())
    events = [ev async for ev in edge.load(reqs)]
    steps = [ev.progress.status for ev in events if ev.HasField("progress")]
    assert steps[0] == "received"
    assert "installing the agent" in steps
    image = events[-1].image
    assert (image.name, image.backend, image.edge_id) == ("deb", "vm", "e0a1")
    assert "Testian 1" in image.source
    assert [i.name for i in edge.list().images if i.backend == "vm"] == ["deb"]
    with pytest.raises(AlreadyExists):
        _ = [ev async for ev in edge.load(requests("deb", b"x"))]
    with pytest.raises(InvalidArgument, match="not a disk image"):
        _ = [ev async for ev in edge.load(requests("junk", b"junk" * 1000))]
    edge.remove("deb")
    assert not [i for i in edge.list().images if i.backend == "vm"]
    _assert_clean(tmp_path, paths.data)
