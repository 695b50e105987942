"""The worker's zygote (``zygote.c``): builds it, and talks to it from the worker.

Forking a call's process from the Python worker cost ~4 ms of page-table and copy-on-write
work per call; the zygote is a tiny C process in the worker's namespaces that clones each
call's process (pid 1 of new pid, mount, ipc and cgroup namespaces, its root already built,
the command's process forked under it with its seccomp filter loaded) ahead of the call,
and execs the command in it when the worker says so. The worker keeps
doing what needs Python (the request, files in and out, the output pump) with its mount
namespace switched into the call's root.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import subprocess
import tempfile
from pathlib import Path

from dsec.agent import spawn

SOURCE = Path(__file__).with_name("zygote.c")
STAGES = {1: "cwd", 2: "exec", 3: "internal", 4: "discarded"}


def binary(data_dir: Path) -> Path:
    """The compiled zygote under ``data_dir/function`` (built on first use, by hash)."""
    src = SOURCE.read_bytes()
    dest = data_dir / "function" / f"zygote-{hashlib.sha256(src).hexdigest()[:16]}"
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        out = Path(tmp) / "zygote"
        subprocess.run(
            ["gcc", "-static", "-O2", "-s", "-o", str(out), str(SOURCE)],
            check=True,
            capture_output=True,
        )
        out.rename(dest)  # atomic: a concurrent build of the same source is the same file
    return dest


class ZygoteError(RuntimeError):
    """The zygote could not prepare a call's process."""


class Zygote:
    """The worker's end of the link; one call at a time."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.prepared = 0  # pid of the process the next call gets
        self.used = False  # the prepared process got its command (else: discard it)
        self.pidfd = -1  # of the prepared process
        self.status: int | None = None

    def expect(self, kind: bytes) -> bytes:
        msg, fds, _, _ = socket.recv_fds(self.sock, 512, 1)
        for fd in fds:
            if kind == b"R" and msg[:1] == b"R":
                self.pidfd = fd
            else:
                os.close(fd)
        if not msg:
            raise ZygoteError("the zygote exited")
        if msg[:1] == b"E":
            raise ZygoteError(msg[1:].decode(errors="replace"))
        if msg[:1] != kind:
            raise ZygoteError(f"unexpected message from the zygote: {msg[:16]!r}")
        return msg[1:]

    def wait_prepared(self) -> int:
        if (old := self.take_pidfd()) >= 0:
            os.close(old)
        (self.prepared,) = struct.unpack("=i", self.expect(b"R"))
        return self.prepared

    def prepare(self) -> int:
        """After a call (its "X"): have the next call's process prepared; return its pid.

        The worker asks once the call's answer is out, so building the next process (a
        clone into new namespaces, a tmpfs, an overlay, /proc and /dev) never takes CPU
        from the call it follows.
        """
        self.sock.send(b"N")
        return self.wait_prepared()

    def start(
        self, path: str, argv: list[str], env: dict[str, str], cwd: str, ids: tuple[int, ...],
        fds: tuple[int, int, int],
    ) -> tuple[int, int]:  # fmt: skip
        """Run the command in the prepared process; return (stage, errno), (0, 0) if it runs."""
        uid, gid, *groups = ids
        head = struct.pack(f"=III{len(groups)}I", uid, gid, len(groups), *groups)
        parts = [s.encode() + b"\0" for s in (path, cwd)]
        parts.append(struct.pack("=I", len(argv)))
        parts += [a.encode() + b"\0" for a in argv]
        parts += [f"{k}={v}".encode() + b"\0" for k, v in env.items()]
        socket.send_fds(self.sock, [b"G" + head + b"".join(parts)], list(fds))
        return self._started()

    def take_pidfd(self) -> int:
        """The prepared process's pidfd, now the caller's to close (or closed here: -1)."""
        fd, self.pidfd = self.pidfd, -1
        return fd

    def discard(self) -> None:
        """The prepared process was not used (the call failed first): drop it."""
        self.sock.send(b"D")
        os.close(self.take_pidfd())
        self._started()
        self.wait_exit()

    def _started(self) -> tuple[int, int]:
        stage, err = struct.unpack("=ii", self.expect(b"S"))
        self.status = None
        return stage, err

    def wait_exit(self) -> int:
        """After a start: the call's process exited (its wait status)."""
        status: int = struct.unpack("=ii", self.expect(b"X"))[0]
        self.status = status
        return status


class ZygoteChild(spawn.Child):
    """A command the zygote started: :meth:`wait` reads its status from the zygote."""

    def __init__(self, zyg: Zygote, pid: int, stdin: int, stdout: int, stderr: int) -> None:
        super().__init__(pid, stdin, stdout, stderr)
        self.zygote = zyg
        self.pidfd = zyg.take_pidfd()

    def exit_fd(self) -> int:
        """Readable once the command's end is known: the zygote's "X" is the next message
        (sent once the call's init has ended everything the call started, before the
        call's namespaces are torn down)."""
        return os.dup(self.zygote.sock.fileno())

    def close_pipes(self) -> None:
        super().close_pipes()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(self.zygote.wait_exit())
        return self.returncode
