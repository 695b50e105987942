"""Building the function workers' zygote: once per source, cached under the data dir."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsec.edge.backends.function import zygote


def test_binary_is_built_once_and_named_for_its_source(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed (scripts/install installs it)")
    first = zygote.binary(tmp_path)
    assert first.parent == tmp_path / "function"
    assert first.name.startswith("zygote-")
    assert first.stat().st_mode & 0o111
    mtime = first.stat().st_mtime_ns
    assert zygote.binary(tmp_path) == first
    assert first.stat().st_mtime_ns == mtime  # cached, not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dirs left
