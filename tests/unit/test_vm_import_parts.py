"""Pieces of the VM image import that need no root: names, symlinks resolved inside the
image, kernel choice order, module names and built-in modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.core.errors import AlreadyExists, Internal, InvalidArgument
from dsec.edge.backends.vm import image, imports
from dsec.edge.backends.vm.backend import guest_cmdline


def test_names() -> None:
    imports.check_name("debian-12.cloud_1")
    for bad in ("", "Deb", "a/b", "-x", "x" * 64, "../etc"):
        with pytest.raises(InvalidArgument):
            imports.check_name(bad)
    with pytest.raises(AlreadyExists):
        imports.check_name("base")
    assert imports.find(Path("/nonexistent"), "../../etc") is None


def test_guest_paths_never_leave_the_image(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr" / "lib" / "systemd").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    (root / "sbin").mkdir()
    (root / "sbin" / "init").symlink_to("/lib/systemd/systemd")
    (root / "etc").symlink_to("/../../../../real-etc")  # absolute: from the image's root
    (root / "up").symlink_to("../../../../../../tmp")
    (root / "loop").symlink_to("loop")
    g = imports._guest_path
    assert g(root, "/sbin/init") == root / "usr/lib/systemd/systemd"
    assert g(root, "/sbin/init", follow_last=False) == root / "sbin/init"
    assert g(root, "/etc/passwd") == root / "real-etc/passwd"
    assert g(root, "/up/x") == root / "tmp/x"
    with pytest.raises(InvalidArgument, match="too many symlinks"):
        g(root, "/loop/x")


def test_newest_kernel_version_sorts_numerically() -> None:
    versions = ["5.10.0-9-amd64", "6.1.0-10-amd64", "6.1.0-9-amd64"]
    assert max(versions, key=imports._version_key) == "6.1.0-10-amd64"


def test_module_names_and_builtins() -> None:
    assert image.module_name("kernel/fs/ext4/ext4.ko.zst") == "ext4"
    assert image.module_name("kernel/crypto/crc32c-generic.ko.xz") == "crc32c_generic"
    dep = "kernel/a/virtio_blk.ko.xz: kernel/a/virtio.ko.xz\nkernel/a/virtio.ko.xz:\n"
    order = image.module_order(dep, ["virtio_blk", "ext4"], builtin=("ext4",))
    assert order == ["kernel/a/virtio.ko.xz", "kernel/a/virtio_blk.ko.xz"]
    with pytest.raises(Internal):
        image.module_order(dep, ["ext4"])


def test_cmdline_names_the_root_partition() -> None:
    line = guest_cmdline("sbx-1", {}, root="/dev/vda2", fstype="xfs")
    assert line.startswith("root=/dev/vda2 rootfstype=xfs rw ")
    assert guest_cmdline("sbx-1", {}).startswith("root=/dev/vda rw ")
