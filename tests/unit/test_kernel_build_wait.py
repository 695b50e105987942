"""Waiting for the background guest kernel build scripts/test starts (dsec.testing.kernel_build)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsec.testing.kernel_build import ENV, KernelBuild, from_env


def _build(tmp_path: Path, log: str, pid: int | None = None) -> KernelBuild:
    (tmp_path / "log").write_text(log)
    (tmp_path / "pid").write_text(str(pid if pid is not None else os.getpid()))
    return KernelBuild(tmp_path)


def test_wait_returns_once_the_build_writes_success(tmp_path: Path) -> None:
    build = _build(tmp_path, "guest kernel: 10 objects built, 5 s\n")
    seen: list[str] = []
    threading.Timer(1.5, (tmp_path / "rc").write_text, ["0\n"]).start()
    t0 = time.monotonic()
    assert build.wait(seen.append, every_s=0.5) is None
    assert time.monotonic() - t0 >= 1.0
    assert seen
    assert "guest kernel: 10 objects built" in seen[0]


def test_a_failed_build_gives_its_status_and_the_end_of_its_log(tmp_path: Path) -> None:
    build = _build(tmp_path, "".join(f"line {i}\n" for i in range(100)) + "Error 2\n")
    (tmp_path / "rc").write_text("1\n")
    why = build.wait(lambda _: None)
    assert why is not None
    assert "exit status 1" in why
    assert str(build.log) in why
    assert why.endswith("line 99\nError 2")
    assert "line 69" not in why


def test_a_build_that_died_without_a_status_fails(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    build = _build(tmp_path, "guest kernel: make -j2 vmlinux\n", pid=dead.pid)
    why = build.wait(lambda _: None)
    assert why is not None
    assert "stopped without an exit status" in why


def test_the_command_line_waiter_exits_1_on_failure(tmp_path: Path) -> None:
    _build(tmp_path, "make: *** [vmlinux] Error 2\n")
    (tmp_path / "rc").write_text("2")
    env = {**os.environ, ENV: str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "dsec.testing.kernel_build"], env=env, capture_output=True, text=True
    )
    assert r.returncode == 1
    assert "exit status 2" in r.stderr
    assert "Error 2" in r.stderr


def test_no_background_build_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert from_env() is None
