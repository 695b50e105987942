"""The builder's layer steps without sandboxes: COPY/ADD layout, owners, WORKDIR, cache."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.core.errors import Internal, InvalidArgument
from dsec.edge.images.build import Builder, BuildEvent, BuildOptions, RunResult, unpack_context
from dsec.edge.images.store import Image, ImageStore
from dsec.paths import Paths
from dsec.testing.image_data import private_data

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (layer unpack, owners)"),
]


@contextlib.asynccontextmanager
async def no_run(*_: object) -> AsyncIterator[tuple[RunResult, Path]]:
    raise Internal("no RUN in these tests")
    yield  # pragma: no cover


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    shared = Paths.from_env().data
    if not (shared / "images" / "refs" / "base.json").is_file():
        pytest.skip("the base image is not installed (run scripts/install)")
    return ImageStore(private_data(shared, tmp_path / "top") / "images")


def build(store: ImageStore, ctx: Path, text: str, **kw: object) -> tuple[Image, list[BuildEvent]]:
    (ctx / "Dockerfile").write_text(text)
    events: list[BuildEvent] = []

    async def run() -> Image:
        image = None
        async for ev in Builder(store, no_run).build(ctx, BuildOptions(tag="t/x:1", **kw)):  # type: ignore[arg-type]
            if isinstance(ev, Image):
                image = ev
            else:
                events.append(ev)
        assert image is not None
        return image

    return asyncio.run(run()), events


def find(image: Image, rel: str) -> Path:
    for d in image.layer_dirs:
        if os.path.lexists(d / rel):
            return d / rel
    raise AssertionError(f"{rel} is in no layer")


def test_copy_layout_owners_workdir_and_cache(store: ImageStore, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "dir" / "sub").mkdir(parents=True)
    (ctx / "dir" / "sub" / "a.txt").write_text("a")
    (ctx / "dir" / "run.sh").write_text("#!/bin/sh\n")
    (ctx / "dir" / "run.sh").chmod(0o755)
    (ctx / "one.txt").write_text("1")
    os.symlink("one.txt", ctx / "link")
    text = (
        "FROM base\n"
        "COPY dir /opt/app\n"  # a directory: its content goes into /opt/app
        "COPY one.txt /opt/renamed.txt\n"  # one file to a new name
        "ADD --chown=1000:1001 one.txt link /data/\n"  # into a directory, owned
        "WORKDIR /work/deep\n"  # missing: a layer creates it
        "COPY one.txt ./\n"  # relative to WORKDIR
    )
    image, events = build(store, ctx, text)
    assert (find(image, "opt/app/sub/a.txt")).read_text() == "a"
    assert stat.S_IMODE(find(image, "opt/app/run.sh").stat().st_mode) == 0o755
    assert find(image, "opt/renamed.txt").read_text() == "1"
    st = find(image, "data/one.txt").lstat()
    assert (st.st_uid, st.st_gid) == (1000, 1001)
    assert os.readlink(find(image, "data/link")) == "one.txt"
    assert find(image, "work/deep/one.txt").read_text() == "1"
    assert find(image, "opt").lstat().st_uid == 0
    assert image.config.workdir == "/work/deep"
    assert not [e for e in events if e.kind == "cached"]

    again, events = build(store, ctx, text)
    assert again.diff_ids == image.diff_ids
    assert len([e for e in events if e.kind == "cached"]) == 5
    _, events = build(store, ctx, text, no_cache=True)
    assert not [e for e in events if e.kind == "cached"]


def test_bad_steps(store: ImageStore, tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "f").write_text("x")
    with pytest.raises(InvalidArgument, match="line 2: COPY source 'missing'"):
        build(store, ctx, "FROM base\nCOPY missing /x\n")
    with pytest.raises(InvalidArgument, match="no user 'nobody-here'"):
        build(store, ctx, "FROM base\nCOPY --chown=nobody-here f /x\n")
    with pytest.raises(InvalidArgument, match="no Dockerfile"):
        build(store, ctx, "FROM base\n", dockerfile="../x")


def test_context_tar_is_unpacked_safely(tmp_path: Path) -> None:
    import io
    import tarfile

    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        info = tarfile.TarInfo("../escape")
        data = b"x"
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    dest = tmp_path / "ctx"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match="not a usable tar"):
        unpack_context(bad, dest)
    assert not (tmp_path / "escape").exists()
