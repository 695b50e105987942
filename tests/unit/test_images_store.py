"""The local image store: refs, layer lookup, trusted tar import."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from dsec.core.errors import ImageNotFound, InvalidArgument
from dsec.edge.images.store import ImageConfig, ImageStore, validate_name


def _make_tar(path: Path, files: dict[str, bytes], mode: int = 0o644) -> str:
    with tarfile.open(path, "w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            tf.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_import_tar_and_resolve(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    bottom_tar, top_tar = tmp_path / "bottom.tar", tmp_path / "top.tar"
    bottom_digest = _make_tar(bottom_tar, {"etc/os": b"debian\n"})
    top_digest = _make_tar(top_tar, {"usr/bin/tool": b"#!/bin/sh\n"}, mode=0o4755)

    bottom = store.import_trusted_tar(bottom_tar)
    top = store.import_trusted_tar(top_tar, diff_id=top_digest)
    assert bottom == bottom_digest
    assert top == top_digest
    assert (store.layer_dir(bottom) / "etc" / "os").read_text() == "debian\n"
    assert (store.layer_dir(top) / "usr/bin/tool").stat().st_mode & 0o7777 == 0o4755
    assert store.import_trusted_tar(bottom_tar) == bottom  # already there: a no-op
    assert list((tmp_path / "images" / "tmp").iterdir()) == []  # scratch cleaned

    cfg = ImageConfig(env=("A=1",), cmd=("/bin/sh",), workdir="/w", user="1000")
    image = store.write_ref("py/app:1", [bottom, f"sha256:{top}"], cfg)
    assert image.diff_ids == (bottom, top)
    assert image.layer_dirs == (store.layer_dir(top), store.layer_dir(bottom))  # top first
    assert image.env == ("A=1",)
    assert image.workdir == "/w"
    assert image.user == "1000"
    assert store.has("py/app:1")
    assert not store.has("py/app:2")
    assert store.resolve("py/app:1") == image

    ref = json.loads((tmp_path / "images" / "refs" / "py" / "app:1.json").read_text())
    assert ref["layers"] == [bottom, top]
    assert ref["config"]["cmd"] == ["/bin/sh"]
    assert ref["created"].endswith("Z")
    assert [i.name for i in store.list()] == ["py/app:1"]


def test_unknown_image_message_lists_what_exists(tmp_path: Path) -> None:
    store = ImageStore(tmp_path)
    with pytest.raises(ImageNotFound, match=r"available: none"):
        store.resolve("nope")
    _make_tar(tmp_path / "t.tar", {"a": b"x"})
    digest = store.import_trusted_tar(tmp_path / "t.tar")
    store.write_ref("base", [digest], ImageConfig())
    with pytest.raises(ImageNotFound, match=r"'nope' is not on this edge \(available: base\)"):
        store.resolve("nope")


def test_missing_base_hints_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(ImageNotFound, match=r"dsec\.edge\.images\.base"):
        ImageStore(tmp_path).resolve("base")


def test_ref_with_missing_layer_is_not_found(tmp_path: Path) -> None:
    store = ImageStore(tmp_path)
    (tmp_path / "refs").mkdir()
    (tmp_path / "refs" / "broken.json").write_text(
        json.dumps({"name": "broken", "layers": ["b" * 64], "config": {}})
    )
    with pytest.raises(ImageNotFound, match="incomplete"):
        store.resolve("broken")
    (tmp_path / "refs" / "garbage.json").write_text("{")
    with pytest.raises(ImageNotFound, match="unreadable"):
        store.resolve("garbage")
    with pytest.raises(ImageNotFound):
        store.write_ref("x", ["c" * 64], ImageConfig())


@pytest.mark.parametrize("name", ["../etc/passwd", "a/../b", "/abs", "UPPER", "", "a//b"])
def test_bad_names_are_rejected(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidArgument):
        validate_name(name)
    assert not ImageStore(tmp_path).has(name)


def test_bad_diff_id_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        ImageStore(tmp_path).layer_dir("../../etc")
