"""The client side of a build: .dockerignore, the context tar, the progress reader."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from dsec.core.errors import InvalidArgument
from dsec.sdk import build


def names(tar: bytes) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        return set(t.getnames())


def test_dockerignore_excludes_and_reincludes(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("a")
    (tmp_path / "src" / "a.pyc").write_text("c")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "keep.log").write_text("k")
    (tmp_path / "logs" / "x.log").write_text("x")
    (tmp_path / "Dockerfile").write_text("FROM base\n")
    (tmp_path / ".dockerignore").write_text("# comment\n**/*.pyc\nlogs\n!logs/keep.log\n")
    tar, df_name = build.context_tar(tmp_path)
    assert df_name == "Dockerfile"
    got = names(tar)
    assert "src/a.py" in got
    assert "src/a.pyc" not in got
    assert "logs/x.log" not in got
    assert "logs/keep.log" in got


def test_a_dockerfile_outside_the_context_is_carried_in(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "f").write_text("x")
    outside = tmp_path / "Build.df"
    outside.write_text("FROM base\n")
    tar, df_name = build.context_tar(ctx, outside)
    assert df_name == build.DOCKERFILE_IN_CONTEXT
    assert names(tar) == {"f", build.DOCKERFILE_IN_CONTEXT}
    with pytest.raises(InvalidArgument, match="no Dockerfile"):
        build.context_tar(ctx)


def test_reader_reports_and_raises_the_error_line() -> None:
    seen: list[dict[str, object]] = []
    r = build.BuildReader(seen.append)
    r.feed(b'{"step":{"index":1,"total":2,"instruction":"FROM base","line":1}}\n{"cac')
    r.feed(b'hed":true}\n{"image":{"name":"t"}}\n')
    assert r.result() == {"name": "t"}
    assert seen[1] == {"cached": True}
    bad = build.BuildReader(None)
    with pytest.raises(InvalidArgument, match="line 3"):
        bad.feed(b'{"error":{"code":"invalid_argument","message":"Dockerfile line 3: x"}}\n')
