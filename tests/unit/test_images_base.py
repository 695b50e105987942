"""The base image builder, with a stand-in mmdebstrap (the real build is an integration test)."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import pytest

from dsec.core.errors import Internal, Unavailable
from dsec.edge.images import base
from dsec.edge.images.store import ImageStore


def test_find_apt_sources_picks_active_bookworm_files(tmp_path: Path) -> None:
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/debian\nSuites: bookworm bookworm-updates\n"
    )
    (d / "security.list").write_text("deb http://mirror.invalid/sec bookworm-security main\n")
    (d / "old.list").write_text("# deb http://mirror.invalid/debian bookworm main\n")
    (d / "other.sources").write_text("Types: deb\nSuites: nodistro\n")
    (d / "off.list.disabled").write_text("deb http://mirror.invalid/debian bookworm main\n")
    (d / "trixie.list").write_text("deb http://mirror.invalid/debian trixie main\n")
    main_list = tmp_path / "sources.list"
    main_list.write_text("deb http://mirror.invalid/debian bookworm main\n")
    found = base.find_apt_sources(places=(main_list, d, tmp_path / "missing"))
    assert found == [main_list, d / "debian.sources", d / "security.list"]


def test_mmdebstrap_command_names_no_mirror_host(tmp_path: Path) -> None:
    src = Path("/etc/apt/sources.list.d/debian.sources")
    cmd = base.mmdebstrap_command(tmp_path / "out.tar", [src])
    assert cmd[:3] == ["mmdebstrap", "--variant=minbase", "--mode=root"]
    assert "--include=python3,ca-certificates,procps" in cmd
    assert cmd[-3:] == ["bookworm", str(tmp_path / "out.tar"), str(src)]
    assert not any("://" in part for part in cmd)


FAKE_MMDEBSTRAP = """#!/bin/sh
# stand-in: build a tiny tree and tar it to the target (second positional argument)
echo "I: pretending to bootstrap" >&2
target=""; n=0
for a in "$@"; do case "$a" in --*) ;; *) n=$((n+1)); [ $n -eq 2 ] && target="$a";; esac; done
tmp=$(mktemp -d)
mkdir -p "$tmp/bin" "$tmp/etc"
echo fake > "$tmp/etc/os-release"
tar -C "$tmp" -cf "$target" .
rm -rf "$tmp"
echo "I: success" >&2
"""


@pytest.fixture
def fake_mmdebstrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "mmdebstrap"
    tool.write_text(FAKE_MMDEBSTRAP)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setattr(base, "find_apt_sources", lambda: [tmp_path / "x.sources"])
    return tool


def test_build_base_image_flow_and_cache(tmp_path: Path, fake_mmdebstrap: Path) -> None:
    store = ImageStore(tmp_path / "images")
    lines: list[str] = []
    image = base.build_base_image(store, progress=lines.append)
    assert image.name == "base"
    assert len(image.diff_ids) == 1
    assert (image.layer_dirs[0] / "etc" / "os-release").read_text() == "fake\n"
    assert image.env[0].startswith("PATH=")
    assert any("pretending" in line for line in lines)
    assert any(line.startswith("building base: mmdebstrap") for line in lines)
    assert lines[-1].startswith("image base ready")
    assert list((tmp_path / "images" / "tmp").iterdir()) == []

    # Cached: no second build (a broken mmdebstrap would fail it).
    fake_mmdebstrap.write_text("#!/bin/sh\nexit 1\n")
    again: list[str] = []
    assert base.build_base_image(store, progress=again.append) == image
    assert again == []
    with pytest.raises(Internal, match="mmdebstrap failed"):
        base.build_base_image(store, force=True)
    assert store.resolve("base") == image  # a failed rebuild keeps the old ref


def test_build_without_sources_is_unavailable(
    tmp_path: Path, fake_mmdebstrap: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(base, "find_apt_sources", list)
    with pytest.raises(Unavailable, match="bookworm"):
        base.build_base_image(ImageStore(tmp_path / "images"))


def test_install_base_from_tar(tmp_path: Path) -> None:
    tar = tmp_path / "b.tar"
    src = tmp_path / "tree"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hostname").write_text("localhost\n")
    with tarfile.open(tar, "w") as tf:
        tf.add(src, arcname=".")
    image = base.install_base_from_tar(ImageStore(tmp_path / "images"), tar)
    assert image.diff_ids == (hashlib.sha256(tar.read_bytes()).hexdigest(),)
    assert (image.layer_dirs[0] / "etc" / "hostname").is_file()
