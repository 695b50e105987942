"""Pack an overlay upper dir into a layer: the packed image shows exactly the packed view."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dsec.edge.backends.container import overlay
from dsec.edge.images.credentials import RegistryCredentials, RegistrySettings
from dsec.edge.images.pack import pack_image
from dsec.edge.images.pull import Puller
from dsec.edge.images.push import push_image
from dsec.edge.images.store import Image, ImageConfig, ImageStore
from dsec.testing import registry as testreg
from dsec.testing.registry import TarBuilder, local_registry

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (overlay mounts, trusted xattrs)"),
]
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"


@contextmanager
def mounted(image: Image, state: Path) -> Iterator[tuple[Path, Path]]:
    dirs = overlay.RootfsDirs.in_state_dir(state)
    dirs.make()
    overlay.mount_rootfs(dirs, image.layer_dirs)
    try:
        yield dirs.rootfs, dirs.upper
    finally:
        overlay.unmount_rootfs(dirs.rootfs)


def view(root: Path) -> dict[str, tuple[object, ...]]:
    """Type, mode, owner, content hash / link target and user xattrs of every entry."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                extra: object = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            else:
                extra = None
            xattrs = (
                {}
                if stat.S_ISLNK(st.st_mode)
                else {k: os.getxattr(p, k) for k in os.listxattr(p) if k.startswith("user.")}
            )
            out[os.path.relpath(p, root)] = (
                stat.S_IFMT(st.st_mode),
                stat.S_IMODE(st.st_mode),
                st.st_uid,
                st.st_gid,
                extra,
                tuple(sorted(xattrs.items())),
            )
    return out


def test_pack_round_trip(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    lower = (
        TarBuilder()
        .dir("etc")
        .file("etc/keep", b"keep")
        .file("etc/remove-me", b"x")
        .dir("opt")
        .dir("opt/app")
        .file("opt/app/old1", b"1")
        .file("opt/app/old2", b"2")
        .file("usr/bin/tool", b"#!/bin/sh\n", mode=0o755)
        .build()
    )
    blob = tmp_path / "lower.tar"
    blob.write_bytes(lower)
    diff_id = store.import_layer_blob(blob, LAYER_TYPE, hashlib.sha256(lower).hexdigest())
    base = store.write_ref("test/base:1", [diff_id], ImageConfig(env=("A=1",), workdir="/opt"))

    with mounted(base, tmp_path / "s1") as (root, upper):
        (root / "etc/remove-me").unlink()
        (root / "etc/keep").write_text("changed")
        for p in (root / "opt/app").iterdir():
            p.unlink()
        (root / "opt/app").rmdir()
        (root / "opt/app").mkdir()
        (root / "opt/app/new").write_text("new")
        (root / "usr/bin/tool").chmod(0o4750)
        os.chown(root / "etc/keep", 1000, 1001)
        (root / "data").mkdir()
        (root / "data/big").write_bytes(os.urandom(100_000))
        os.link(root / "data/big", root / "data/big-link")
        (root / "data/sym").symlink_to("/etc/keep")
        os.setxattr(root / "data/big", "user.note", b"hi")
        expected = view(root)
        packed = pack_image(store, upper, base, "test/packed:1")

    assert packed.diff_ids[:-1] == base.diff_ids
    assert packed.config == base.config
    top = packed.layer_dirs[0]
    assert stat.S_ISCHR((top / "etc/remove-me").lstat().st_mode)
    assert os.getxattr(top / "opt/app", "trusted.overlay.opaque") == b"y"
    assert not any(
        k.startswith("trusted.overlay.") and k != "trusted.overlay.opaque"
        for d in (top, top / "etc", top / "opt/app")
        for k in os.listxattr(d)
    )
    assert (top / "data/big").stat().st_ino == (top / "data/big-link").stat().st_ino
    with mounted(store.resolve("test/packed:1"), tmp_path / "s2") as (root, _):
        assert view(root) == expected


@pytest.mark.skipif(testreg.skip_reason() is not None, reason=str(testreg.skip_reason()))
def test_push_packed_image_and_pull_it_elsewhere(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    lower = TarBuilder().dir("etc").file("etc/a", b"a").file("etc/b", b"b").build()
    blob = tmp_path / "lower.tar"
    blob.write_bytes(lower)
    diff_id = store.import_layer_blob(blob, LAYER_TYPE, hashlib.sha256(lower).hexdigest())
    base = store.write_ref("test/base:1", [diff_id], ImageConfig(env=("A=1",), workdir="/etc"))
    with mounted(base, tmp_path / "s1") as (root, upper):
        (root / "etc/a").unlink()
        (root / "etc/c").write_text("c")
        expected = view(root)
        pack_image(store, upper, base, "test/packed:1")

    with local_registry(username="u", password="p") as reg:
        creds = RegistryCredentials(tmp_path / "regs.json")
        creds.save(reg.host, RegistrySettings("u", "p", insecure=True))
        target = f"{reg.host}/team/packed:1"
        push_image(store, "test/packed:1", target, creds)
        assert store.resolve("test/packed:1").layer_blobs  # the exported base blob is kept

        other = ImageStore(tmp_path / "other")
        pulled = Puller(other, creds).pull(target)
        assert pulled.config.env == ("A=1",)
        assert pulled.config.workdir == "/etc"
        with mounted(pulled, tmp_path / "s2") as (root, _):
            assert view(root) == expected
        if shutil.which("skopeo"):  # another client accepts what we pushed (and verifies it)
            subprocess.run(
                [
                    "skopeo",
                    "copy",
                    "--quiet",
                    "--src-tls-verify=false",
                    "--src-creds",
                    "u:p",
                    f"docker://{target}",
                    f"oci:{tmp_path / 'oci'}:x",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
        # the same registry, another repository: the blobs are mounted across, not sent
        digest = push_image(other, target, f"{reg.host}/copies/packed:1", creds)
        again = Puller(ImageStore(tmp_path / "third"), creds).pull(
            f"{reg.host}/copies/packed@{digest}"
        )
        assert again.diff_ids == pulled.diff_ids
