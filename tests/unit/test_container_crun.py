"""The crun driver's process handling, against small stand-in programs instead of crun."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
from pathlib import Path

import pytest

from dsec.core.errors import DeadlineExceeded, SandboxFailed
from dsec.edge.backends.container import crun as crun_mod
from dsec.edge.backends.container.crun import Crun


@pytest.mark.asyncio
async def test_spawn_puts_socket_on_fd3_and_output_in_console(tmp_path: Path) -> None:
    console = tmp_path / "console.log"
    private = os.open(tmp_path, os.O_RDONLY)  # the edge's own fds are close-on-exec
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(str(tmp_path / "a.sock"))
            s.listen()
            inode = os.fstat(s.fileno()).st_ino
            rc = await crun_mod._spawn_and_wait(
                ["sh", "-c", "readlink /proc/self/fd/3; ls /proc/self/fd; echo oops >&2; exit 3"],
                listen_fd=s.fileno(),
                console=console,
                limit=10,
            )
    finally:
        os.close(private)
    assert rc == 3
    lines = console.read_text().splitlines()
    assert lines[0] == f"socket:[{inode}]"
    fds = {int(x) for x in lines[1:-1]}
    assert {0, 1, 2, 3} <= fds
    assert private not in fds or private == 3
    assert lines[-1] == "oops"


@pytest.mark.asyncio
async def test_spawn_handles_socket_already_on_fd3(tmp_path: Path) -> None:
    console = tmp_path / "console.log"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        saved = os.dup(3) if _fd_open(3) else None
        try:
            os.dup2(s.fileno(), 3)
            rc = await crun_mod._spawn_and_wait(
                ["sh", "-c", "test -S /proc/self/fd/3"], listen_fd=3, console=console, limit=10
            )
        finally:
            if saved is not None:
                os.dup2(saved, 3)
                os.close(saved)
            else:
                os.close(3)
    assert rc == 0


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.asyncio
async def test_spawn_time_limit_kills_the_child(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(DeadlineExceeded):
            await crun_mod._spawn_and_wait(
                ["sleep", "30"], listen_fd=s.fileno(), console=tmp_path / "c", limit=0.3
            )
        assert loop.time() - start < 5


def test_read_errors_prefers_crun_log(tmp_path: Path) -> None:
    log = tmp_path / "crun.log"
    console = tmp_path / "console.log"
    log.write_text(
        json.dumps({"msg": "warming up", "level": "warning"})
        + "\n"
        + json.dumps({"msg": "executable file `/x` not found", "level": "error"})
        + "\nnot json\n"
    )
    console.write_text("first\nlast line\n")
    assert crun_mod.read_errors(log, console) == "executable file `/x` not found"
    log.write_text("")
    assert crun_mod.read_errors(log, console) == "last line"
    assert crun_mod.read_errors(tmp_path / "no", tmp_path / "none") == "no error message"


def _fake_crun(tmp_path: Path, script: str) -> str:
    path = tmp_path / "fake-crun"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.asyncio
async def test_state_of_unknown_container_is_none(tmp_path: Path) -> None:
    c = Crun(tmp_path / "root", binary=_fake_crun(tmp_path, "exit 99\n"))
    assert await c.state("sbx-x") is None
    await c.delete("sbx-x")  # unknown: nothing to do, no error


@pytest.mark.asyncio
async def test_state_parses_crun_json(tmp_path: Path) -> None:
    (tmp_path / "root" / "sbx-x").mkdir(parents=True)
    out = json.dumps({"status": "running", "pid": 4242, "bundle": "/b"})
    c = Crun(tmp_path / "root", binary=_fake_crun(tmp_path, f"echo '{out}'\n"))
    st = await c.state("sbx-x")
    assert st == crun_mod.CrunState(status="running", pid=4242, bundle="/b")


@pytest.mark.asyncio
async def test_run_failure_carries_crun_message(tmp_path: Path) -> None:
    script = (
        'for a in "$@"; do case "$a" in --log=file:*) log="${a#--log=file:}";; esac; done\n'
        'echo \'{"msg":"cannot do it","level":"error"}\' > "$log"\n'
        "exit 1\n"
    )
    c = Crun(tmp_path / "root", binary=_fake_crun(tmp_path, script))
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s,
        pytest.raises(SandboxFailed, match="cannot do it"),
    ):
        await c.run_detached(
            "sbx-x",
            tmp_path,
            listen_fd=s.fileno(),
            console=tmp_path / "console.log",
            log=tmp_path / "crun.log",
            pid_file=tmp_path / "pid",
        )
