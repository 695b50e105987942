"""The interactive PTY session of ``dsec sandbox shell`` on a real local pseudo-terminal:
raw mode on and restored, keystrokes forwarded, SIGWINCH turned into a resize."""

from __future__ import annotations

import io
import os
import signal
import sys
import termios
import threading
from collections.abc import Iterator
from typing import cast

import pytest

from dsec.cli import terminal
from dsec.sdk import Pty


class FakePty:
    def __init__(self, master: int) -> None:
        self.master = master
        self.sent: list[bytes] = []
        self.sizes: list[tuple[int, int]] = []
        self.got_q = threading.Event()
        self.closed = False
        self.raw_seen = False
        self.slave: int | None = None

    def send(self, data: bytes | str) -> None:
        self.sent.append(data if isinstance(data, bytes) else data.encode())
        if b"q" in self.sent[-1]:
            self.got_q.set()

    def resize(self, cols: int, rows: int) -> None:
        self.sizes.append((cols, rows))

    def __iter__(self) -> Iterator[bytes]:
        assert self.slave is not None
        self.raw_seen = not termios.tcgetattr(self.slave)[3] & termios.ICANON
        yield b"hello"
        os.kill(os.getpid(), signal.SIGWINCH)  # the handler runs in this (main) thread
        os.write(self.master, b"q")  # a keystroke, typed once raw mode is on
        assert self.got_q.wait(10)
        yield b" bye"

    def wait(self) -> int:
        return 3

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def pty_stdin(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, int]]:
    master, slave = os.openpty()
    stdin = os.fdopen(slave, "r", closefd=False)
    monkeypatch.setattr(sys, "stdin", stdin)
    try:
        yield master, slave
    finally:
        stdin.close()
        os.close(master)
        os.close(slave)


def test_pty_session_raw_mode_keys_and_resize(
    pty_stdin: tuple[int, int], capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    master, slave = pty_stdin
    before = termios.tcgetattr(slave)
    fake = FakePty(master)
    fake.slave = slave
    code = terminal.run_pty_session(cast(Pty, fake))
    assert code == 3
    assert fake.raw_seen
    assert termios.tcgetattr(slave) == before  # the terminal is restored
    assert b"q" in b"".join(fake.sent)
    assert len(fake.sizes) == 1
    assert fake.closed
    assert capsysbinary.readouterr().out == b"hello bye"
    assert signal.getsignal(signal.SIGWINCH) in (signal.SIG_DFL, None, signal.SIG_IGN)


def test_exit_status_and_collect() -> None:
    from dsec.sdk.models import ExecEvent

    events = iter(
        [ExecEvent("stdout", b"a"), ExecEvent("stderr", b"b"), ExecEvent("exit", signal=15)]
    )
    result = terminal.collect_output(events)
    assert (result.stdout, result.stderr) == ("a", "b")
    assert terminal.exit_status(result) == 128 + 15
    assert terminal.exit_status(ExecEvent("exit", exit_code=7)) == 7


def test_read_chunks_without_fileno() -> None:
    assert list(terminal.read_chunks(io.BytesIO(b"abc"), 2)) == [b"ab", b"c"]
