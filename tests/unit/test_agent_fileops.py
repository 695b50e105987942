"""aether's atomic write where the filesystem has no O_TMPFILE (a named temporary)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from dsec.agent import fileops


def test_write_without_o_tmpfile_goes_through_a_named_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_tmpfile(path: str, flags: int, mode: int = 0o777, **kw: int) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "O_TMPFILE not supported")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", no_tmpfile)
    target = tmp_path / "f.txt"
    target.write_text("old")
    fd, tmp = fileops._open_temp(str(tmp_path), str(target))
    try:
        assert tmp is not None
        assert sorted(os.listdir(tmp_path)) == sorted(["f.txt", os.path.basename(tmp)])
        os.write(fd, b"new")
        fileops._publish(fd, tmp, str(target))
    finally:
        os.close(fd)
    assert os.listdir(tmp_path) == ["f.txt"]
    assert target.read_text() == "new"
