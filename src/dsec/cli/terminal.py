"""The live parts of the CLI: streaming a command's output, and an interactive PTY session.

The PTY session puts the local terminal in raw mode (restored on every exit path), turns
SIGWINCH into resize messages, and also works when stdin is a pipe or file (no raw mode;
end of input is sent as Ctrl-D).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from types import FrameType
from typing import IO, BinaryIO, cast

from dsec.agent.protocol import CHUNK
from dsec.core.errors import DsecError, Internal
from dsec.sdk import Pty
from dsec.sdk.models import ExecEvent, ExecResult

EOT = b"\x04"


def _binary(stream: IO[str]) -> BinaryIO:
    buffer = getattr(stream, "buffer", None)
    return cast(BinaryIO, buffer if buffer is not None else stream)


def binary_stdin() -> BinaryIO:
    return _binary(sys.stdin)


def binary_stdout() -> BinaryIO:
    return _binary(sys.stdout)


def binary_stderr() -> BinaryIO:
    return _binary(sys.stderr)


def is_tty(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # closed
        return False


def read_chunks(stream: BinaryIO, size: int = CHUNK) -> Iterator[bytes]:
    """Yield what arrives on ``stream`` as soon as it arrives, until end of file."""
    try:
        fd: int | None = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        fd = None
    read1 = getattr(stream, "read1", None)
    while True:
        if fd is not None:
            chunk = os.read(fd, size)
        elif callable(read1):
            chunk = read1(size)
        else:
            chunk = stream.read(size)
        if not chunk:
            return
        yield chunk


def exit_status(event: ExecEvent | ExecResult) -> int:
    """A shell-style exit status: the code, or 128 + the signal that killed the command."""
    if event.exit_code is not None:
        return event.exit_code
    return 128 + event.signal if event.signal else 1


def stream_output(events: Iterator[ExecEvent]) -> ExecEvent:
    """Copy output events to our stdout/stderr as they arrive; return the final event."""
    out, err = binary_stdout(), binary_stderr()
    for event in events:
        if event.kind == "exit":
            return event
        target = out if event.kind == "stdout" else err
        target.write(event.data)
        target.flush()
    raise Internal("the command's output ended without an exit status")


def collect_output(events: Iterator[ExecEvent]) -> ExecResult:
    """Gather a streamed command into one result (for ``--json``)."""
    out, err = bytearray(), bytearray()
    for event in events:
        if event.kind == "exit":
            return ExecResult(
                stdout=out.decode("utf-8", "replace"),
                stderr=err.decode("utf-8", "replace"),
                exit_code=event.exit_code,
                signal=event.signal,
                duration_ms=event.duration_ms or 0.0,
                timed_out=event.timed_out,
            )
        (out if event.kind == "stdout" else err).extend(event.data)
    raise Internal("the command's output ended without an exit status")


def terminal_size() -> tuple[int, int]:
    size = shutil.get_terminal_size((80, 24))
    return max(size.columns, 1), max(size.lines, 1)


@contextlib.contextmanager
def raw_terminal(fd: int | None) -> Iterator[None]:
    """Raw mode on ``fd`` for the duration (no-op when ``fd`` is None)."""
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def forward_resizes(pty: Pty, enabled: bool) -> Iterator[None]:
    """Send the terminal's new size to ``pty`` on every SIGWINCH."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_winch(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(DsecError):
            pty.resize(*terminal_size())

    previous = signal.signal(signal.SIGWINCH, on_winch)
    try:
        yield
    finally:
        signal.signal(signal.SIGWINCH, previous)


def _pump_keys(pty: Pty, stdin: BinaryIO, interactive: bool) -> None:
    """Send stdin to the PTY; at the end of a non-interactive input send Ctrl-D."""
    last = b"\n"
    try:
        for chunk in read_chunks(stdin, 4096):
            pty.send(chunk)
            last = chunk[-1:]
        if not interactive:
            pty.send(EOT if last == b"\n" else EOT + EOT)
    except (DsecError, OSError):
        pass  # the session ended first


def run_pty_session(pty: Pty) -> int:
    """Attach our terminal (or pipes) to ``pty`` until its process exits; its exit status."""
    stdin = binary_stdin()
    interactive = is_tty(stdin)
    out = binary_stdout()
    fd = stdin.fileno() if interactive else None
    with raw_terminal(fd), forward_resizes(pty, interactive):
        threading.Thread(target=_pump_keys, args=(pty, stdin, interactive), daemon=True).start()
        for chunk in pty:
            out.write(chunk)
            out.flush()
        code = pty.wait()
    pty.close()
    return code if code >= 0 else 128 - code


def stdin_for_exec() -> Iterator[bytes] | None:
    """Our stdin as a chunk iterator when it is a pipe or file, else None (not forwarded)."""
    stdin = binary_stdin()
    return None if is_tty(stdin) else read_chunks(stdin)


def write_stdout(data: bytes) -> None:
    sys.stdout.flush()
    out = binary_stdout()
    out.write(data)
    out.flush()
