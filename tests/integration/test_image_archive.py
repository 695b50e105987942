"""``image save|load``: OCI layout tarballs round-trip between stores; bad ones leave nothing."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path

import pytest

from dsec.core.errors import ImageNotFound, InvalidArgument
from dsec.edge.images.archive import REF_NAME, load_image, save_image
from dsec.edge.images.pull import LayerProgress, Puller, PullOptions
from dsec.edge.images.store import ImageConfig, ImageStore
from dsec.testing import registry as testreg
from dsec.testing.registry import LocalRegistry, TarBuilder, local_registry, push_image

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (confined chroot unpack)"),
]
NAME = "local/app:v1"


@pytest.fixture
def src(tmp_path: Path) -> ImageStore:
    """A store with NAME: two locally built layers (no registry blobs, like ``base``)."""
    store = ImageStore(tmp_path / "src")
    diff_ids = []
    for layer in (
        TarBuilder().dir("etc").file("etc/hello", b"hello\n").file("bin/x", b"#!", mode=0o755),
        TarBuilder().dir("etc").file("etc/hello", b"changed\n").file("opt/new", b"new"),
    ):
        tar = tmp_path / "layer.tar"
        tar.write_bytes(layer.build())
        diff_ids.append(store.import_trusted_tar(tar))
    store.write_ref(NAME, diff_ids, ImageConfig(env=("A=1",), cmd=("sh",), workdir="/opt"))
    return store


def _save(store: ImageStore, name: str, out: Path) -> str:
    with out.open("wb") as f:
        return save_image(store, name, f)


def _load(store: ImageStore, tar: Path, name: str = "") -> list[str]:
    with tar.open("rb") as f:
        return [i.name for i in load_image(store, f, name=name)]


def _members(tar: Path) -> dict[str, bytes]:
    with tarfile.open(tar) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf if m.isfile()}  # type: ignore[union-attr]


def _assert_empty(store: ImageStore) -> None:
    assert store.list() == []
    for d in (store.layers_dir, store.blobs_dir, store.tmp_dir):
        assert not d.is_dir() or not any(d.iterdir()), f"{d} is not empty"


def test_save_then_load_into_a_fresh_store(src: ImageStore, tmp_path: Path) -> None:
    out = tmp_path / "app.tar"
    digest = _save(src, NAME, out)
    files = _members(out)
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    (desc,) = index["manifests"]
    assert desc["digest"] == digest
    assert desc["annotations"][REF_NAME] == NAME
    manifest = json.loads(files[f"blobs/sha256/{digest[7:]}"])
    layer_digests = [x["digest"] for x in manifest["layers"]]
    assert set(files) == {
        "oci-layout",
        "index.json",
        f"blobs/sha256/{digest[7:]}",
        f"blobs/sha256/{manifest['config']['digest'][7:]}",
        *(f"blobs/sha256/{d[7:]}" for d in layer_digests),
    }
    # A second save reuses the exported blobs: the same manifest, byte for byte.
    assert _save(src, NAME, tmp_path / "again.tar") == digest

    dst = ImageStore(tmp_path / "dst")
    events: list[LayerProgress] = []
    with out.open("rb") as f:
        (image,) = load_image(dst, f, progress=events.append)
    assert image.name == NAME
    assert image.config == src.resolve(NAME).config
    assert [b.digest for b in image.layer_blobs] == layer_digests
    assert (image.layer_dirs[0] / "etc/hello").read_bytes() == b"changed\n"
    assert (image.layer_dirs[1] / "etc/hello").read_bytes() == b"hello\n"
    assert {e.status for e in events} >= {"loading", "verified", "unpacking", "done"}
    assert not any(dst.tmp_dir.iterdir())
    # Saved from the new store, it is the same image.
    assert _save(dst, NAME, tmp_path / "back.tar") == digest

    # Into the same store under another name: the layers are shared, not unpacked twice.
    events.clear()
    with out.open("rb") as f:
        (copy,) = load_image(dst, f, name="copy/app:v2", progress=events.append)
    assert copy.layer_dirs == image.layer_dirs
    assert "unpacking" not in {e.status for e in events}


def test_multi_image_tarball(src: ImageStore, tmp_path: Path) -> None:
    """A layout whose index names several images loads them all; a name fits only one."""
    src.write_ref("local/other:v1", src.resolve(NAME).diff_ids[:1], ImageConfig())
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    _save(src, NAME, a)
    _save(src, "local/other:v1", b)
    fa, fb = _members(a), _members(b)
    index = json.loads(fa["index.json"])
    index["manifests"] += json.loads(fb["index.json"])["manifests"]
    both = tmp_path / "both.tar"
    with tarfile.open(both, "w") as tf:
        for name, data in {**fa, **fb, "index.json": json.dumps(index).encode()}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    dst = ImageStore(tmp_path / "dst")
    with pytest.raises(InvalidArgument, match="holds 2 images"):
        _load(dst, both, name="x:v1")
    _assert_empty(dst)
    assert sorted(_load(dst, both)) == ["local/app:v1", "local/other:v1"]


def _rewrite(tar: Path, out: Path, change: dict[str, bytes]) -> None:
    files = {**_members(tar), **change}
    with tarfile.open(out, "w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_bad_tarballs_are_refused_and_leave_nothing(src: ImageStore, tmp_path: Path) -> None:
    good = tmp_path / "app.tar"
    digest = _save(src, NAME, good)
    files = _members(good)
    manifest = json.loads(files[f"blobs/sha256/{digest[7:]}"])
    layer = f"blobs/sha256/{manifest['layers'][1]['digest'][7:]}"
    tampered = bytearray(files[layer])
    tampered[len(tampered) // 2] ^= 0xFF
    bad = tmp_path / "bad.tar"
    dst = ImageStore(tmp_path / "dst")

    _rewrite(good, bad, {layer: bytes(tampered)})
    with pytest.raises(InvalidArgument, match="does not match its digest"):
        _load(dst, bad)
    _assert_empty(dst)

    data = good.read_bytes()
    with tarfile.open(good) as tf:
        last = tf.getmembers()[-1]
    # Inside the last blob, right after its header, inside a header, and mid-archive.
    for cut in (last.offset_data + last.size // 2, last.offset_data, 700, len(data) // 2):
        bad.write_bytes(data[:cut])
        with pytest.raises(InvalidArgument):
            _load(dst, bad)
        _assert_empty(dst)

    files_without_layer = {k: v for k, v in files.items() if k != layer}
    with tarfile.open(bad, "w") as tf:
        for name, blob in files_without_layer.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tf.addfile(info, io.BytesIO(blob))
    with pytest.raises(InvalidArgument, match="not in the tarball"):
        _load(dst, bad)
    _assert_empty(dst)

    bad.write_bytes(TarBuilder().file("etc/passwd", b"x").build())
    with pytest.raises(InvalidArgument, match="unexpected member"):
        _load(dst, bad)
    bad.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(InvalidArgument):
        _load(dst, bad)
    _rewrite(good, bad, {"index.json": b'{"manifests": [{"digest": "sha256:00"}]}'})
    with pytest.raises(InvalidArgument, match="malformed digest"):
        _load(dst, bad)
    _assert_empty(dst)

    with pytest.raises(ImageNotFound):
        _save(src, "nope:v1", tmp_path / "nope.tar")


@pytest.fixture(scope="module")
def reg() -> Iterator[LocalRegistry]:
    if reason := testreg.skip_reason():
        pytest.skip(reason)
    with local_registry() as r:
        yield r


def test_pulled_image_keeps_its_registry_blobs(reg: LocalRegistry, tmp_path: Path) -> None:
    pushed = push_image(
        reg, "t/saved:v1", [TarBuilder().file("a", b"a" * 1000).build()], config={"Env": ["B=2"]}
    )
    store = ImageStore(tmp_path / "pulled")
    image = Puller(store).pull(f"{reg.host}/t/saved:v1", PullOptions(insecure=True))
    out = tmp_path / "saved.tar"
    _save(store, image.name, out)
    dst = ImageStore(tmp_path / "dst")
    (loaded,) = [dst.resolve(n) for n in _load(dst, out)]
    assert loaded.name == image.name
    assert [b.digest for b in loaded.layer_blobs] == list(pushed.layer_digests)
    assert loaded.diff_ids == image.diff_ids
    assert loaded.config.env == ("B=2",)


def test_skopeo_reads_and_copies_a_saved_tarball(
    src: ImageStore, reg: LocalRegistry, tmp_path: Path
) -> None:
    """A real OCI tool accepts our layout: inspect it, copy it to a registry, pull it back."""
    if shutil.which("skopeo") is None:
        pytest.skip("needs skopeo (apt-get install skopeo)")
    out = tmp_path / "app.tar"
    digest = _save(src, NAME, out)
    manifest = json.loads(_members(out)[f"blobs/sha256/{digest[7:]}"])
    env = {**os.environ, "TMPDIR": tempfile.mkdtemp(dir=tmp_path)}
    proc = subprocess.run(
        ["skopeo", "inspect", "--raw", f"oci-archive:{out}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == manifest
    proc = subprocess.run(
        [
            "skopeo",
            "copy",
            "--dest-tls-verify=false",
            "--preserve-digests",
            f"oci-archive:{out}",
            f"docker://{reg.host}/t/skopeo:v1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    dst = ImageStore(tmp_path / "dst")
    image = Puller(dst).pull(f"{reg.host}/t/skopeo:v1", PullOptions(insecure=True))
    assert [b.digest for b in image.layer_blobs] == [x["digest"] for x in manifest["layers"]]
    assert (image.layer_dirs[0] / "opt/new").read_bytes() == b"new"


def test_load_a_multi_arch_tarball_written_by_skopeo(reg: LocalRegistry, tmp_path: Path) -> None:
    """skopeo's oci-archive of an index: index.json points at the index; we pick amd64."""
    if shutil.which("skopeo") is None:
        pytest.skip("needs skopeo (apt-get install skopeo)")
    pushed = push_image(
        reg,
        "t/multi:v1",
        [TarBuilder().file("common", b"c").build()],
        platforms=("linux/amd64", "linux/arm64"),
    )
    out = tmp_path / "multi.tar"
    env = {**os.environ, "TMPDIR": tempfile.mkdtemp(dir=tmp_path)}
    proc = subprocess.run(
        [
            "skopeo",
            "copy",
            "--all",
            "--src-tls-verify=false",
            f"docker://{reg.host}/t/multi:v1",
            f"oci-archive:{out}:multi/app:v1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    dst = ImageStore(tmp_path / "dst")
    assert _load(dst, out) == ["multi/app:v1"]
    image = dst.resolve("multi/app:v1")
    amd64 = json.loads(_members(out)[f"blobs/sha256/{pushed.manifests['linux/amd64'][7:]}"])
    assert [b.digest for b in image.layer_blobs] == [x["digest"] for x in amd64["layers"]]
    assert (image.layer_dirs[-1] / "common").read_bytes() == b"c"


@pytest.mark.asyncio
async def test_edge_streams_save_and_load_and_survives_a_dropped_client(tmp_path: Path) -> None:
    """EdgeImages.save/load move the tar in chunks; a client gone mid-save ends the worker."""
    from dsec.edge.images.service import EdgeImages
    from dsec.rpc._gen import dsec_pb2 as pb

    store = ImageStore(tmp_path / "src")
    tar = tmp_path / "big.tar"
    tar.write_bytes(TarBuilder().file("big", os.urandom(3 << 20)).build())
    store.write_ref("local/big:v1", [store.import_trusted_tar(tar)], ImageConfig())
    svc = EdgeImages(store, "e0", None)
    chunks = [c.data async for c in svc.save("local/big:v1")]
    assert len(chunks) > 2
    assert svc._users == 0

    gen = svc.save("local/big:v1")
    assert isinstance(gen, AsyncGenerator)
    await anext(gen)
    await gen.aclose()  # the client went away: the saving thread must not hang
    assert svc._users == 0

    dst = EdgeImages(ImageStore(tmp_path / "dst"), "e1", None)

    async def requests() -> AsyncIterator[pb.LoadImageRequest]:
        yield pb.LoadImageRequest(name="local/copy:v1")
        for c in chunks:
            yield pb.LoadImageRequest(data=c)

    events = [ev async for ev in dst.load(requests())]
    assert events[-1].image.name == "local/copy:v1"
    assert any(ev.progress.status == "verified" for ev in events[:-1])

    async def cut() -> AsyncIterator[pb.LoadImageRequest]:
        yield pb.LoadImageRequest(name="local/cut:v1")
        yield pb.LoadImageRequest(data=chunks[0])

    with pytest.raises(InvalidArgument):
        _ = [ev async for ev in dst.load(cut())]
    assert [i.name for i in dst.store.list()] == ["local/copy:v1"]
    assert dst._users == 0
