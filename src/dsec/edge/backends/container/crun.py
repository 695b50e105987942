"""The crun driver: one async method per crun verb, state kept under ``--root``.

``crun run -d`` forks the container's init, which inherits crun's stdio: a pipe there would
never reach EOF while the container lives, so ``run`` gets files (stdout/stderr: the
sandbox's console log; crun's own messages: a JSON log file read on failure). ``run`` is
started with ``posix_spawn`` so the listening agent socket lands exactly on fd 3 of crun
(``--preserve-fds=1`` hands fd 3 to the init) and waited on through a pidfd; the other
verbs are short-lived and use asyncio subprocesses with pipes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.core.errors import DeadlineExceeded, InvalidState, SandboxFailed, SandboxNotFound

RUN_TIMEOUT_S = 30.0
VERB_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class CrunState:
    """What ``crun state`` reports."""

    status: str  # created | running | paused | stopped
    pid: int
    bundle: str


@dataclass(frozen=True, slots=True)
class ExecResult:
    returncode: int
    stdout: bytes
    stderr: bytes


class Crun:
    """Runs crun with its state directory at ``root``."""

    def __init__(self, root: Path, *, binary: str = "crun") -> None:
        self.root = root
        self.binary = binary

    def _base(self) -> list[str]:
        return [self.binary, f"--root={self.root}"]

    def exists(self, container_id: str) -> bool:
        """True if crun keeps state for ``container_id`` (cheap: one stat)."""
        return (self.root / container_id).is_dir()

    async def run_detached(
        self,
        container_id: str,
        bundle: Path,
        *,
        listen_fd: int,
        console: Path,
        log: Path,
        pid_file: Path,
        prefix: Sequence[str] = (),
        time_limit: float = RUN_TIMEOUT_S,
        start: bool = True,
    ) -> None:
        """``crun run -d --preserve-fds=1`` with ``listen_fd`` as the container's fd 3.

        With ``start=False`` this is ``crun create`` instead: the container is set up and
        its init waits for :meth:`start`.

        Args:
            container_id: crun's id (the sandbox id).
            bundle: directory holding config.json.
            listen_fd: the listening agent socket, handed to init as fd 3.
            console: file receiving the init's stdout and stderr (appended).
            log: crun's JSON log (its error messages).
            pid_file: where crun writes the init's host pid.
            prefix: launcher argv placed before crun (nsenter / unshare).
            time_limit: seconds before crun is killed and the run fails.
            start: run (default) or only create.

        Raises:
            SandboxFailed: crun failed; the message is crun's.
            DeadlineExceeded: crun did not finish in time.
        """
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        argv = [
            *prefix,
            *self._base(),
            f"--log=file:{log}",
            "--log-format=json",
            *(["run", "--detach"] if start else ["create"]),
            "--preserve-fds=1",
            f"--bundle={bundle}",
            f"--pid-file={pid_file}",
            container_id,
        ]
        rc = await _spawn_and_wait(argv, listen_fd=listen_fd, console=console, limit=time_limit)
        if rc != 0:
            verb = "run" if start else "create"
            raise SandboxFailed(f"crun {verb} failed (exit {rc}): {read_errors(log, console)}")

    async def start(self, container_id: str) -> None:
        """Start a container made with ``run_detached(start=False)`` (see :meth:`pause`)."""
        await self._verb("start", container_id)

    async def state(self, container_id: str) -> CrunState | None:
        """Return crun's view of the container, or None if crun does not know it."""
        if not self.exists(container_id):
            return None
        res = await self._call(["state", container_id])
        if res.returncode != 0:
            if not self.exists(container_id):
                return None
            raise SandboxFailed(f"crun state {container_id}: {_msg(res)}")
        data = json.loads(res.stdout)
        return CrunState(
            status=str(data.get("status", "")),
            pid=int(data.get("pid") or 0),
            bundle=str(data.get("bundle", "")),
        )

    async def kill(self, container_id: str, sig: str = "KILL", *, all_procs: bool = True) -> bool:
        """Signal the container's processes; False if it was not running."""
        args = ["kill", *(["--all"] if all_procs else []), container_id, sig]
        res = await self._call(args)
        return res.returncode == 0

    async def delete(self, container_id: str, *, force: bool = True) -> None:
        """``crun delete [-f]``; a container crun does not know is not an error.

        Raises:
            SandboxFailed: crun could not delete it.
        """
        if not self.exists(container_id):
            return
        res = await self._call(["delete", *(["--force"] if force else []), container_id])
        if res.returncode != 0 and self.exists(container_id):
            raise SandboxFailed(f"crun delete {container_id}: {_msg(res)}")

    async def pause(self, container_id: str) -> None:
        """Freeze every process of the container.

        Raises:
            SandboxNotFound: crun does not know it.
            InvalidState: crun refused (e.g. not running).
        """
        await self._verb("pause", container_id)

    async def resume(self, container_id: str) -> None:
        """Thaw the container (see :meth:`pause` for errors)."""
        await self._verb("resume", container_id)

    async def exec(
        self, container_id: str, argv: Sequence[str], *, time_limit: float = VERB_TIMEOUT_S
    ) -> ExecResult:
        """Run ``argv`` inside the container and collect its output (tests, diagnostics)."""
        return await self._call(["exec", container_id, *argv], limit=time_limit)

    async def _verb(self, verb: str, container_id: str) -> None:
        if not self.exists(container_id):
            raise SandboxNotFound(f"no container {container_id!r}")
        res = await self._call([verb, container_id])
        if res.returncode != 0:
            raise InvalidState(f"crun {verb} {container_id}: {_msg(res)}")

    async def _call(self, args: list[str], *, limit: float = VERB_TIMEOUT_S) -> ExecResult:
        proc = await asyncio.create_subprocess_exec(
            *self._base(),
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), limit)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise DeadlineExceeded(f"crun {args[0]} took more than {limit:g} s") from None
        assert proc.returncode is not None
        return ExecResult(proc.returncode, out, err)


def _msg(res: ExecResult) -> str:
    text = (res.stderr or res.stdout).decode(errors="replace").strip()
    return text.splitlines()[-1] if text else f"exit {res.returncode}"


def read_errors(log: Path, console: Path) -> str:
    """crun's error messages from its JSON log (else the console's last line)."""
    msgs: list[str] = []
    try:
        for line in log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("level") in ("error", "fatal"):
                msgs.append(str(entry.get("msg", "")))
    except OSError:
        pass
    if msgs:
        return "; ".join(msgs)
    try:
        lines = console.read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1] if lines else "no error message"


def _spawn(argv: list[str], *, listen_fd: int, console: Path) -> int:
    """posix_spawn ``argv`` with fd 0 = /dev/null, 1+2 = console, 3 = listen_fd."""
    out_fd = os.open(console, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    # posix_spawn's dup2 onto the same number would keep FD_CLOEXEC set: move it first.
    sock_fd = os.dup(listen_fd) if listen_fd == 3 else listen_fd
    try:
        return os.posix_spawnp(
            argv[0],
            argv,
            dict(os.environ),
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, out_fd, 1),
                (os.POSIX_SPAWN_DUP2, out_fd, 2),
                (os.POSIX_SPAWN_DUP2, sock_fd, 3),
            ],
        )
    finally:
        os.close(out_fd)
        if sock_fd != listen_fd:
            os.close(sock_fd)


def _reap(pid: int, *, kill: bool) -> int:
    """Collect our child's exit code (it has exited, or is SIGKILLed first)."""
    if kill:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return -1
    return os.waitstatus_to_exitcode(status)


async def _spawn_and_wait(argv: list[str], *, listen_fd: int, console: Path, limit: float) -> int:
    """Start ``argv`` (see :func:`_spawn`) and wait for it without blocking the loop."""
    pid = _spawn(argv, listen_fd=listen_fd, console=console)
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    exited: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, on_exit)
    try:
        await asyncio.wait_for(exited, limit)
    except TimeoutError:
        _reap(pid, kill=True)
        raise DeadlineExceeded(f"crun run took more than {limit:g} s") from None
    except BaseException:
        _reap(pid, kill=True)  # cancelled: never leave crun running or unreaped
        raise
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return _reap(pid, kill=False)
