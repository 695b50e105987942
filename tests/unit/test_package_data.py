"""A wheel carries every non-Python file the code reads at run time (guest C sources,
the kernel config fragment, protos): pyproject's package-data covers them all."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "dsec"


def _patterns() -> list[str]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        data = tomllib.load(f)
    patterns: list[str] = data["tool"]["setuptools"]["package-data"]["dsec"]
    return patterns


def test_guest_sources_are_package_data() -> None:
    patterns = _patterns()
    wanted = [
        p.relative_to(PKG).as_posix()
        for p in PKG.rglob("*")
        if p.is_file() and p.suffix in (".c", ".h", ".config", ".proto")
    ]
    assert any(w.endswith("guest/vmport.c") for w in wanted)  # the walk found the guests
    missing = [w for w in wanted if not any(fnmatch.fnmatchcase(w, p) for p in patterns)]
    assert missing == [], f"not in [tool.setuptools.package-data] of pyproject.toml: {missing}"
