"""Untrusted layers unpack confined to their layer dir, whatever their members say."""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from pathlib import Path

import pytest

from dsec.core.errors import InvalidArgument
from dsec.edge.images.store import ImageStore
from dsec.edge.images.unpack import unpack_layer
from dsec.testing.registry import TarBuilder

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chroot, mknod, trusted xattrs)"),
]
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"


def _import(store: ImageStore, tmp_path: Path, data: bytes) -> Path:
    blob = tmp_path / "blob.tar"
    blob.write_bytes(data)
    diff_id = store.import_layer_blob(blob, LAYER_TYPE, hashlib.sha256(data).hexdigest())
    return store.layer_dir(diff_id)


def _host_snapshot(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_nlink, st.st_size, st.st_mtime_ns


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "images")


def test_dotdot_paths_reject_the_layer(store: ImageStore, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    data = TarBuilder().file("ok", b"1").file("../../../../victim", b"pwned").build()
    with pytest.raises(InvalidArgument, match=r"'\.\.' segment"):
        _import(store, tmp_path, data)
    assert not victim.exists()
    assert not store.layers_dir.exists() or not any(store.layers_dir.iterdir())
    assert list(store.tmp_dir.iterdir()) == []


def test_absolute_symlink_then_write_through_it_stays_inside(
    store: ImageStore, tmp_path: Path
) -> None:
    host_dir = tmp_path / "hostdir"
    host_dir.mkdir()
    data = (
        TarBuilder()
        .link("evil", str(host_dir))
        .file("evil/pwned", b"x")
        .link("up", "../../../../../..")
        .file("up/tmp/pwned2", b"y")
        .file("/abs/file", b"z")
        .build()
    )
    layer = _import(store, tmp_path, data)
    assert list(host_dir.iterdir()) == []
    assert os.readlink(layer / "evil") == str(host_dir)  # kept as is: resolved only in a sandbox
    assert (layer / str(host_dir).lstrip("/") / "pwned").read_bytes() == b"x"
    assert (layer / "tmp/pwned2").read_bytes() == b"y"
    assert (layer / "abs/file").read_bytes() == b"z"
    assert not Path("/tmp/pwned2").exists()
    assert not Path("/abs").exists()


def test_hard_link_to_host_file_is_rejected(store: ImageStore, tmp_path: Path) -> None:
    before = _host_snapshot(Path("/etc/passwd"))
    data = TarBuilder().link("h", "/etc/passwd", hard=True).build()
    with pytest.raises(InvalidArgument, match="hard link"):
        _import(store, tmp_path, data)
    assert _host_snapshot(Path("/etc/passwd")) == before


def test_hard_links_inside_the_layer_and_devices_skipped(store: ImageStore, tmp_path: Path) -> None:
    data = (
        TarBuilder()
        .file("a", b"same")
        .link("b", "a", hard=True)
        .link("c", "/a", hard=True)
        .special("dev/null2", tarfile.CHRTYPE)
        .special("dev/sda9", tarfile.BLKTYPE)
        .special("fifo", tarfile.FIFOTYPE)
        .build()
    )
    layer = _import(store, tmp_path, data)
    assert (layer / "a").stat().st_ino == (layer / "b").stat().st_ino == (layer / "c").stat().st_ino
    assert not (layer / "dev/null2").exists()
    assert not (layer / "dev/sda9").exists()
    assert not (layer / "fifo").exists()


def test_whiteout_through_symlink_stays_inside(store: ImageStore, tmp_path: Path) -> None:
    host_dir = tmp_path / "keepme"
    host_dir.mkdir()
    (host_dir / "f").write_text("host")
    data = TarBuilder().link("d", str(host_dir)).file("d/.wh.f").build()
    layer = _import(store, tmp_path, data)
    assert (host_dir / "f").read_text() == "host"
    wh = (layer / str(host_dir).lstrip("/") / "f").lstat()
    assert stat.S_ISCHR(wh.st_mode)


def test_tar_bomb_and_diff_id_mismatch(store: ImageStore, tmp_path: Path) -> None:
    data = TarBuilder().file("big", b"\0" * 200_000).build()
    target = tmp_path / "t"
    target.mkdir()
    blob = tmp_path / "bomb.tar"
    blob.write_bytes(data)
    with pytest.raises(InvalidArgument, match="larger than"):
        unpack_layer(blob, "tar", target, max_bytes=100_000)
    with pytest.raises(InvalidArgument, match="image config says"):
        store.import_layer_blob(blob, LAYER_TYPE, "0" * 64)
    assert not store.has_layer("0" * 64)
    with pytest.raises(InvalidArgument, match="cannot decompress"):
        store.import_layer_blob(blob, LAYER_TYPE + "+gzip", hashlib.sha256(data).hexdigest())
