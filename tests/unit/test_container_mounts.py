"""mountinfo parsing and overlay option building (no mounts are made here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.core.errors import InvalidArgument
from dsec.edge.backends.container import mounts, overlay

MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
42 27 254:0 /var/lib/dsec/edge/sandboxes /var/lib/dsec/edge/sandboxes rw shared:1 - ext4 /dev/vda rw
58 42 0:39 / /var/lib/dsec/edge/sandboxes/sbx-1/rootfs rw shared:2 - overlay overlay rw,lowerdir=/a
64 44 254:0 /x /srv/with\\040space rw master:1 - ext4 /dev/vda rw
65 27 0:4 mnt:[4026532177] /run/dsec/crun.mntns rw - nsfs nsfs rw
"""


def test_parse_mountinfo_fields_and_tags() -> None:
    entries = mounts.parse_mountinfo(MOUNTINFO)
    assert len(entries) == 6
    shared = entries[2]
    assert shared.mount_point == "/var/lib/dsec/edge/sandboxes"
    assert shared.shared_group == 1
    assert shared.master_group is None
    assert entries[3].fstype == "overlay"
    assert entries[3].shared_group == 2
    assert entries[4].mount_point == "/srv/with space"  # \040 unescaped
    assert entries[4].master_group == 1
    assert entries[5].fstype == "nsfs"
    assert entries[0].propagation == ()


def test_mounts_at_under_and_containing() -> None:
    entries = mounts.parse_mountinfo(MOUNTINFO)
    root = Path("/var/lib/dsec/edge/sandboxes")
    assert [e.mount_id for e in mounts.mounts_at(root, entries)] == [42]
    assert [e.mount_id for e in mounts.mounts_under(root, entries)] == [42, 58]
    holder = mounts.containing_mount(root / "sbx-2" / "upper", entries)
    assert holder is not None
    assert holder.mount_id == 42
    top = mounts.containing_mount(Path("/etc/passwd"), entries)
    assert top is not None
    assert top.mount_id == 27


def test_parse_mountinfo_skips_garbage() -> None:
    assert mounts.parse_mountinfo("not a mountinfo line\n\n") == []


def test_overlay_options_order_and_flags() -> None:
    data = overlay.overlay_options(
        [Path("/l/top"), Path("/l/mid"), Path("/l/bottom")], Path("/s/upper"), Path("/s/work")
    )
    assert data.startswith("lowerdir=/l/top:/l/mid:/l/bottom,upperdir=/s/upper,workdir=/s/work,")
    for opt in ("redirect_dir=off", "metacopy=off", "index=off", "xino=off"):
        assert opt in data.split(",")


@pytest.mark.parametrize("bad", ["/a,b", "/a:b", "relative", "/a\\b"])
def test_overlay_options_rejects_unsafe_paths(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        overlay.overlay_options([Path(bad)], Path("/u"), Path("/w"))


def test_overlay_options_rejects_no_layers_and_too_many() -> None:
    with pytest.raises(InvalidArgument):
        overlay.overlay_options([], Path("/u"), Path("/w"))
    many = [Path("/var/lib/dsec/images/layers/sha256/" + "a" * 64)] * 60
    with pytest.raises(InvalidArgument, match="too many layers"):
        overlay.overlay_options(many, Path("/u"), Path("/w"))


def test_rootfs_dirs_layout(tmp_path: Path) -> None:
    dirs = overlay.RootfsDirs.in_state_dir(tmp_path / "s")
    dirs.make()
    assert dirs.upper == tmp_path / "s" / "upper"
    assert (dirs.upper.stat().st_mode & 0o777) == 0o755
    assert (dirs.work.stat().st_mode & 0o777) == 0o700
    assert dirs.rootfs.is_dir()
    assert not overlay.is_mounted(dirs.rootfs)
    assert overlay.unmount_rootfs(dirs.rootfs) is False  # nothing mounted: no error
    assert overlay.unmount_rootfs(tmp_path / "missing") is False
