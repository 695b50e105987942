"""Pull from a real registry (Debian's docker-registry on loopback) into the layer store."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.core.errors import (
    ImageNotFound,
    Internal,
    InvalidArgument,
    Unauthenticated,
    Unavailable,
)
from dsec.edge.backends.container import overlay
from dsec.edge.images.credentials import RegistryCredentials, RegistrySettings
from dsec.edge.images.pull import LayerProgress, Puller, PullOptions
from dsec.edge.images.store import ImageStore
from dsec.testing import registry as testreg
from dsec.testing.registry import LocalRegistry, TarBuilder, local_registry, push_image

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chroot, mknod, trusted xattrs)"),
    pytest.mark.skipif(testreg.skip_reason() is not None, reason=str(testreg.skip_reason())),
]
INSECURE = PullOptions(insecure=True)


@pytest.fixture(scope="module")
def reg() -> Iterator[LocalRegistry]:
    with local_registry() as r:
        yield r


@pytest.fixture(scope="module")
def authreg() -> Iterator[LocalRegistry]:
    with local_registry(username="alice", password="s3cret") as r:
        yield r


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "images")


def base_layer() -> bytes:
    return (
        TarBuilder()
        .dir("etc")
        .file("etc/keep", b"keep\n")
        .file("etc/gone", b"gone\n")
        .dir("opt")
        .dir("opt/app")
        .file("opt/app/old", b"old\n")
        .file("usr/bin/tool", b"#!/bin/sh\n", mode=0o4755, uid=0, gid=0)
        .file("home/u/data", b"d", uid=1234, gid=4321, pax_headers={"SCHILY.xattr.user.k": "v"})
        .build()
    )


def top_layer() -> bytes:
    return (
        TarBuilder()
        .file("etc/.wh.gone")
        .file("opt/app/.wh..wh..opq")
        .file("opt/app/new", b"new\n")
        .file("etc/keep", b"changed\n")
        .build()
    )


def _mounted_view(tmp_path: Path, store: ImageStore, name: str) -> Iterator[Path]:
    image = store.resolve(name)
    dirs = overlay.RootfsDirs.in_state_dir(tmp_path / "sbx")
    dirs.make()
    overlay.mount_rootfs(dirs, image.layer_dirs)
    try:
        yield dirs.rootfs
    finally:
        overlay.unmount_rootfs(dirs.rootfs)


def test_pull_by_tag_then_digest_shares_layers(
    reg: LocalRegistry, store: ImageStore, tmp_path: Path
) -> None:
    pushed = push_image(reg, "t/app:v1", [base_layer(), top_layer()], config={"Env": ["A=1"]})
    events: list[LayerProgress] = []
    image = Puller(store).pull(f"{reg.host}/t/app:v1", INSECURE, events.append)
    assert image.name == f"{reg.host}/t/app:v1"
    assert image.config.env == ("A=1",)
    assert {e.status for e in events} >= {"downloading", "unpacking", "done"}
    assert len(image.layer_dirs) == 2

    events.clear()
    by_digest = Puller(store).pull(f"{reg.host}/t/app@{pushed.digest}", INSECURE, events.append)
    assert by_digest.diff_ids == image.diff_ids
    assert {e.status for e in events} == {"exists"}  # nothing downloaded or unpacked again
    assert store.resolve(f"{reg.host}/t/app@{pushed.digest}").layer_dirs == image.layer_dirs

    low = image.layer_dirs[1]
    tool = (low / "usr/bin/tool").stat()
    assert stat.S_IMODE(tool.st_mode) == 0o4755
    data = (low / "home/u/data").stat()
    assert (data.st_uid, data.st_gid) == (1234, 4321)
    assert os.getxattr(low / "home/u/data", "user.k") == b"v"
    assert not list(store.blobs_dir.glob("*.part"))


def test_whiteouts_and_opaque_dirs_give_the_overlay_view(
    reg: LocalRegistry, store: ImageStore, tmp_path: Path
) -> None:
    push_image(reg, "t/wh:v1", [base_layer(), top_layer()])
    image = Puller(store).pull(f"{reg.host}/t/wh:v1", INSECURE)
    top = image.layer_dirs[0]
    gone = (top / "etc/gone").lstat()
    assert stat.S_ISCHR(gone.st_mode)
    assert gone.st_rdev == 0
    assert os.getxattr(top / "opt/app", "trusted.overlay.opaque") == b"y"
    for root in _mounted_view(tmp_path, store, image.name):
        assert sorted(os.listdir(root / "etc")) == ["keep"]
        assert (root / "etc/keep").read_text() == "changed\n"
        assert sorted(os.listdir(root / "opt/app")) == ["new"]


@pytest.mark.parametrize("docker", [True, False], ids=["docker-list", "oci-index"])
def test_index_platform_selection(reg: LocalRegistry, store: ImageStore, docker: bool) -> None:
    name = f"t/multi-{'docker' if docker else 'oci'}:v1"
    push_image(reg, name, [base_layer()], docker=docker, platforms=("linux/amd64", "linux/arm64"))
    amd = Puller(store).pull(f"{reg.host}/{name}", INSECURE)
    assert (amd.layer_dirs[0] / "platform").read_text() == "linux/amd64"
    arm = Puller(store).pull(
        f"{reg.host}/{name}", PullOptions(insecure=True, platform="linux/arm64")
    )
    assert (arm.layer_dirs[0] / "platform").read_text() == "linux/arm64"
    assert arm.layer_dirs[1] == amd.layer_dirs[1]  # the shared base layer is stored once
    with pytest.raises(ImageNotFound, match=r"linux/s390x.*available: linux/amd64, linux/arm64"):
        Puller(store).pull(f"{reg.host}/{name}", PullOptions(insecure=True, platform="linux/s390x"))


def test_oci_uncompressed_layers_and_missing_tag(reg: LocalRegistry, store: ImageStore) -> None:
    push_image(reg, "t/plain:v1", [base_layer()], compress=False)
    image = Puller(store).pull(f"{reg.host}/t/plain:v1", INSECURE)
    assert (image.layer_dirs[0] / "etc/keep").read_text() == "keep\n"
    with pytest.raises(ImageNotFound, match="not found"):
        Puller(store).pull(f"{reg.host}/t/plain:nope", INSECURE)
    with pytest.raises(InvalidArgument):
        Puller(store).pull("Bad Ref!", INSECURE)


def test_corrupt_blob_is_rejected_and_nothing_stored(reg: LocalRegistry, store: ImageStore) -> None:
    layer = TarBuilder().file("x", b"payload" * 100).build()
    pushed = push_image(reg, "t/corrupt:v1", [layer])
    blob = reg.blob_file(pushed.layer_digests[0])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(InvalidArgument, match=r"does not match|arrived with digest"):
        Puller(store).pull(f"{reg.host}/t/corrupt:v1", INSECURE)
    assert store.list() == []
    assert not store.layers_dir.exists() or not any(store.layers_dir.iterdir())
    assert not store.blob_path(pushed.layer_digests[0]).exists()
    assert not list(store.blobs_dir.glob("*.part"))


def test_interrupted_download_resumes(reg: LocalRegistry, store: ImageStore) -> None:
    layer = TarBuilder().file("big", os.urandom(300_000)).build()
    pushed = push_image(reg, "t/resume:v1", [layer])
    digest = pushed.layer_digests[0]
    full = reg.blob_file(digest).read_bytes()
    part = store.blob_path(digest).with_name(store.blob_path(digest).name + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(full[: len(full) // 2])
    events: list[LayerProgress] = []
    image = Puller(store).pull(f"{reg.host}/t/resume:v1", INSECURE, events.append)
    assert store.blob_path(digest).read_bytes() == full
    assert not part.exists()
    first = next(e for e in events if e.status == "downloading" and e.done)
    assert first.done == len(full) // 2  # the kept half counted first, then the rest
    assert (image.layer_dirs[0] / "big").stat().st_size == 300_000


def test_auth_required_and_credentials(
    authreg: LocalRegistry, store: ImageStore, tmp_path: Path
) -> None:
    push_image(authreg, "t/private:v1", [base_layer()])
    ref = f"{authreg.host}/t/private:v1"
    with pytest.raises(Unauthenticated, match=r"authentication required.*dsec registry login"):
        Puller(store).pull(ref, INSECURE)
    with pytest.raises(Unauthenticated):
        Puller(store).pull(ref, PullOptions(insecure=True, username="alice", password="wrong"))

    own = RegistryCredentials(tmp_path / "registries.json")
    own.save(authreg.host, RegistrySettings("alice", "s3cret", insecure=True))
    assert stat.S_IMODE((tmp_path / "registries.json").stat().st_mode) == 0o600
    image = Puller(store, own).pull(ref)  # insecure comes from the per-registry setting
    assert image.name == ref

    docker_dir = tmp_path / "docker"
    docker_dir.mkdir()
    auth = base64.b64encode(b"alice:s3cret").decode()
    (docker_dir / "config.json").write_text(json.dumps({"auths": {authreg.host: {"auth": auth}}}))
    other = ImageStore(tmp_path / "other")
    creds = RegistryCredentials(None, [docker_dir / "config.json"])
    assert Puller(other, creds).pull(ref, INSECURE).diff_ids == image.diff_ids


def test_gc_keeps_shared_and_mounted_layers(
    reg: LocalRegistry, store: ImageStore, tmp_path: Path
) -> None:
    shared = base_layer()
    push_image(reg, "t/gc1:v1", [shared, TarBuilder().file("one", b"1").build()])
    push_image(reg, "t/gc2:v1", [shared, TarBuilder().file("two", b"2").build()])
    one = Puller(store).pull(f"{reg.host}/t/gc1:v1", INSECURE)
    two = Puller(store).pull(f"{reg.host}/t/gc2:v1", INSECURE)
    assert one.layer_dirs[1] == two.layer_dirs[1]
    view = _mounted_view(tmp_path, store, one.name)  # a "running sandbox" of image one
    next(view)
    store.remove(one.name)
    assert store.gc().layers == 0  # its layers are under a mounted overlay: kept
    next(view, None)  # unmounted
    result = store.gc()
    assert result.layers == 1
    assert not one.layer_dirs[0].exists()
    assert store.resolve(two.name).layer_dirs[1].is_dir()
    store.remove(two.name)
    store.gc()
    assert list(store.layers_dir.iterdir()) == []
    assert list(store.blobs_dir.iterdir()) == []
    with pytest.raises(ImageNotFound):
        store.remove(two.name)


def test_htpasswd_over_tls_with_a_private_ca(store: ImageStore, tmp_path: Path) -> None:
    with local_registry(username="carol", password="tls-pw", tls=True) as tlsreg:
        push_image(tlsreg, "t/tls:v1", [base_layer()])
        ref = f"{tlsreg.host}/t/tls:v1"
        creds = RegistryCredentials(tmp_path / "registries.json")
        creds.save(tlsreg.host, RegistrySettings("carol", "tls-pw", ca_file=tlsreg.ca_file))
        image = Puller(store, creds).pull(ref)
        assert (image.layer_dirs[0] / "etc/keep").read_text() == "keep\n"
        with pytest.raises(Unavailable, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
            Puller(ImageStore(tmp_path / "x")).pull(
                ref, PullOptions(username="carol", password="tls-pw")
            )


def test_disk_full_mid_pull_is_a_clear_error(reg: LocalRegistry, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        store = ImageStore(small / "images")
        pushed = push_image(
            reg, "t/big:v1", [TarBuilder().file("big", os.urandom(3 << 20)).build()]
        )
        with pytest.raises(Internal, match="No space left"):
            Puller(store).pull(f"{reg.host}/t/big:v1", INSECURE)
        assert store.list() == []
        assert not store.layers_dir.exists() or not any(store.layers_dir.iterdir())
        assert not store.blob_path(pushed.layer_digests[0]).exists()
        assert not list(store.blobs_dir.glob("*.part"))
    finally:
        subprocess.run(["umount", str(small)], check=True)
