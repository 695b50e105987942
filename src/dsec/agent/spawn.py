"""Start a command without the ``subprocess`` module.

aether's first ``exec`` used to import ``subprocess`` (and with it ``signal``, ``enum``,
``selectors``, ``locale``, ``re``...), which cost ~10-15 ms and ~1 MiB in every sandbox.
This is the small part of it aether needs. The common case (the agent's own user and
working directory) uses ``posix_spawn``, which glibc implements with ``vfork``: ~0.5 ms.
Otherwise it forks (~1.5 ms for a Python process), and the child sets up stdio, a new
session, the working directory and the user, restores the signal dispositions Python
changed, and execs; an exec failure travels back over a close-on-exec pipe as an errno.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # `signal` would import enum
import os

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Python ignores SIGPIPE and SIGXFSZ (and may ignore SIGINT); commands get the defaults.
_DEFAULT_SIGNALS = (_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGINT)


class Child:
    """A started command: its pid and the parent's ends of its pipes (-1 when absent)."""

    def __init__(self, pid: int, stdin: int, stdout: int, stderr: int) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def wait(self) -> int:
        """Reap the child; returncode is -signal for a killed child, like subprocess."""
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def exit_fd(self) -> int:
        """A new fd that polls readable once the command exited (the caller closes it)."""
        return os.pidfd_open(self.pid)

    def close_pipes(self) -> None:
        for fd in (self.stdin, self.stdout, self.stderr):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.stdin = self.stdout = self.stderr = -1


def which(name: str, env: dict[str, str]) -> str:
    """Resolve ``name`` like a shell does, on the child's PATH; raise FileNotFoundError."""
    if "/" in name:
        return name
    denied: OSError | None = None
    for d in env.get("PATH", DEFAULT_PATH).split(":"):
        path = os.path.join(d or ".", name)
        if os.path.isfile(path):
            if os.access(path, os.X_OK):
                return path
            denied = PermissionError(13, "Permission denied", name)
    raise denied or FileNotFoundError(2, "No such file or directory", name)


def spawn(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    stdin: bool,
    uid: int | None = None,
    gid: int | None = None,
    groups: tuple[int, ...] = (),
) -> Child:
    """Start ``argv`` in a new session with piped stdout/stderr (and stdin if asked).

    Raises:
        OSError: the program or the working directory is unusable (``filename`` says
            which: the program's name, or ``cwd``).
    """
    path = which(argv[0], env)
    in_r, in_w = os.pipe2(os.O_CLOEXEC) if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    errp_r, errp_w = os.pipe2(os.O_CLOEXEC)
    if uid is None and gid is None and cwd == os.getcwd():
        try:
            pid = os.posix_spawn(
                path,
                argv,
                env,
                setsid=True,
                setsigdef=_DEFAULT_SIGNALS,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate((in_r, out_w, errp_w))
                ],
            )
        except OSError as exc:
            for fd in (in_r, in_w, out_r, out_w, errp_r, errp_w):
                if fd >= 0:
                    os.close(fd)
            raise OSError(exc.errno, os.strerror(exc.errno or 0), argv[0]) from None
        for fd in (in_r, out_w, errp_w):
            os.close(fd)
        return Child(pid, in_w, out_r, errp_r)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # the child: only os calls from here to exec
        stage = b"cwd"
        try:
            os.setsid()
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(errp_w, 2)
            for sig in _DEFAULT_SIGNALS:
                _signal.signal(sig, _signal.SIG_DFL)
            os.chdir(cwd)
            stage = b"user"
            if gid is not None:
                os.setgroups(list(groups))
                os.setgid(gid)
            if uid is not None:
                os.setuid(uid)
            stage = b"exec"
            os.closerange(3, err_w)
            os.closerange(err_w + 1, 65536)
            os.execve(path, argv, env)
        except OSError as exc:
            os.write(err_w, b"%s:%d" % (stage, exc.errno or 0))
        except BaseException:
            os.write(err_w, b"%s:%d" % (stage, 22))  # EINVAL: a bad argument
        finally:
            os._exit(127)
    for fd in (err_w, in_r, out_w, errp_w):
        os.close(fd)
    report = os.read(err_r, 64)
    os.close(err_r)
    child = Child(pid, in_w, out_r, errp_r)
    if report:
        child.wait()
        child.close_pipes()
        stage, _, num = report.partition(b":")
        code = int(num or 0)
        name = {b"cwd": cwd, b"user": f"uid {uid}", b"exec": argv[0]}[stage]
        raise OSError(code, os.strerror(code), name)
    return child
