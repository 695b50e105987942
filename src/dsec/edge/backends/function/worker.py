"""One function worker: a process in fresh namespaces that serves exactly one ``exec``.

The pool forks it ahead of time (:func:`fork_worker`). The first child joins the worker's
cgroup, unshares mount, pid, ipc, uts, net and cgroup namespaces and forks the second,
which is pid 1 of the new pid namespace and exits at once (the pool is a child subreaper,
so it inherits pid 1). Pid 1 then builds its root:

    tmpfs (private, per worker)  ── upper/ work/ ──┐
    image layers (read-only) ─────────── overlay ──┴─> root/   + /proc (own pid ns)
                                                                + /dev (tmpfs, 5 nodes)

pivots into it, brings up ``lo`` in its empty network namespace, loads the seccomp filter
and says ``ready``. When the pool hands it a connection (the request already read), it
writes the call's files, runs the command with aether's own ``exec`` code as an
unprivileged user, reads the files asked for, answers, and exits: the kernel kills
whatever the command left behind with pid 1, and every byte the call wrote lived in the
tmpfs, so nothing carries over to the next call.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.agent import callfiles, execop, users
from dsec.agent.wire import AgentError, Conn
from dsec.edge.backends.container import mounts
from dsec.edge.backends.container.overlay import overlay_options
from dsec.edge.backends.function import kernel

UNPRIVILEGED_UID = 65534  # nobody
SCRATCH_SIZE_MB = 1024  # the per-call tmpfs (writes are charged to the call's memory limit)
HOSTNAME = "function"
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_RDONLY = 0x2, 0x4, 0x8, 0x1


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker is built from (one per image)."""

    layers: tuple[str, ...]  # top..bottom, as overlayfs wants them
    scratch: str  # an empty host directory the worker mounts its tmpfs on
    oom_file: str  # memory.oom_control (v1) or memory.events (v2) of that cgroup


def fork_worker(
    spec: WorkerSpec, filt: kernel.SeccompFilter, keep_fd: int, own_pidns_fd: int
) -> int:
    """Fork a worker (pid 1 of a new pid namespace) and return its host pid.

    The caller moves it into its cgroup and then sends ``go``; the worker says ``ready``
    on ``keep_fd`` once its root is built.
    """
    pid = kernel.fork_into_new_pidns(own_pidns_fd)
    if pid:
        return pid
    code = 1
    try:
        _worker_main(spec, filt, keep_fd)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _worker_main(spec: WorkerSpec, filt: kernel.SeccompFilter, sock_fd: int) -> None:
    os.closerange(3, sock_fd)
    os.closerange(sock_fd + 1, 65536)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the forker ignores it; we wait for ours
    sock = socket.socket(fileno=sock_fd)
    if sock.recv(16) != b"go":  # the pool moved us into our cgroup (or gave up on us)
        return
    oom_fd = os.open(spec.oom_file, os.O_RDONLY | os.O_CLOEXEC) if spec.oom_file else -1
    kernel.unshare(kernel.WORKER_NAMESPACES)
    try:  # the OOM killer should take the command, not the worker (needs CAP_SYS_RESOURCE)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError:
        pass
    _build_root(spec)
    kernel.prctl(kernel.PR_SET_DUMPABLE, 0)
    filt.load()
    sock.send(b"ready")
    code = serve_one(sock, oom_fd)
    os._exit(code)


def _build_root(spec: WorkerSpec) -> None:
    mounts.mount(None, "/", None, mounts.MS_REC | mounts.MS_PRIVATE)
    base = spec.scratch
    mounts.mount(
        "tmpfs", base, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={SCRATCH_SIZE_MB}m,mode=0755"
    )
    for d in ("upper", "work", "root"):
        os.mkdir(os.path.join(base, d), 0o755)
    root = os.path.join(base, "root")
    data = overlay_options([Path(p) for p in spec.layers], Path(base, "upper"), Path(base, "work"))
    mounts.mount("overlay", root, "overlay", _MS_NODEV, data)
    for d in ("proc", "dev", "tmp"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)
    mounts.mount("proc", os.path.join(root, "proc"), "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    dev = os.path.join(root, "dev")
    mounts.mount("tmpfs", dev, "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,mode=0755")
    kernel.make_devices(dev)
    socket.sethostname(HOSTNAME)
    kernel.loopback_up()
    kernel.pivot_root(root)


# ---- the call -----------------------------------------------------------------------------


def serve_one(sock: socket.socket, oom_fd: int) -> int:
    """Wait for the pool's dispatch, run the call, answer it; return the exit code."""
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
    except OSError:
        return 1
    if not msg or not fds:
        return 0  # the pool closed: no call for this worker
    os.set_inheritable(fds[0], False)
    conn = Conn(socket.socket(fileno=fds[0]))
    try:
        dispatch = _loads(msg)
        result = run_call(conn, dispatch["request"], dispatch["sandbox"], oom_fd)
        if not conn.answered:
            conn.result(result)
    except AgentError as exc:
        if not conn.answered:
            conn.error(exc.code, exc.message)
    except (BrokenPipeError, ConnectionResetError):
        pass
    except Exception as exc:
        traceback.print_exc()
        if not conn.answered:
            conn.error("internal", f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    return 0


def _loads(data: bytes) -> dict[str, Any]:
    from dsec.agent.wire import loads

    return loads(data)


def run_call(
    conn: Conn, req: dict[str, Any], sandbox: dict[str, Any], oom_fd: int
) -> dict[str, Any] | None:
    """Run one ``exec`` request in this worker's root as the unprivileged user."""
    user = users.resolve(req.get("user", UNPRIVILEGED_UID))
    if user.uid == 0:
        raise AgentError(
            "permission_denied",
            "backend 'function' runs calls as an unprivileged user; use backend='container' "
            "to run as root",
        )
    os.environ.clear()
    os.environ.update(sandbox.get("env") or {})
    os.environ.setdefault("PATH", users.DEFAULT_PATH)
    env = dict(req.get("env") or {})
    env.setdefault("HOME", "/tmp")
    workdir = sandbox.get("workdir") or "/"
    cwd = os.path.join("/tmp" if workdir == "/" else workdir, str(req.get("cwd") or "."))
    cwd = os.path.normpath(cwd)
    req = {**req, "user": user.uid, "env": env, "cwd": cwd}
    budget = [callfiles.MAX_BYTES]
    outputs = callfiles.check_outputs(req)
    if req.get("files") is not None:  # as root, before the user's code ever ran
        callfiles.write_files(req["files"], user.uid, user.gid, cwd, budget)
    req.pop("files", None)
    req.pop("outputs", None)
    oom_before = _oom_kills(oom_fd) if oom_fd >= 0 else 0  # the cgroup is reused
    _become(user, cwd)
    result = execop.op_exec(conn, req)
    assert result is not None
    if outputs is not None:  # as the user: the call cannot read more than it could itself
        result["files"] = callfiles.read_outputs(outputs, cwd, budget)
    if oom_fd >= 0 and _oom_kills(oom_fd) > oom_before:
        result["oom_killed"] = True
    return result


def _become(user: users.User, cwd: str) -> None:
    """Switch to the call's user and directory, so the command starts by vfork (fast)."""
    os.setgroups(list(user.groups))
    os.setgid(user.gid)
    os.setuid(user.uid)
    kernel.prctl(kernel.PR_SET_DUMPABLE, 0)  # setuid reset it; keep the pool's memory private
    try:
        os.chdir(cwd)
    except OSError as exc:
        raise AgentError("not_found", f"working directory {cwd}: {exc.strerror}") from None


def _oom_kills(fd: int) -> int:
    try:
        text = os.pread(fd, 4096, 0).decode()
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0


def start_forker(scratch: str) -> tuple[socket.socket, int]:
    """Fork the process that forks workers, before any sandbox is registered.

    Forking a worker takes milliseconds; doing it here keeps the pool's loop free for
    calls, and workers copy the forker's memory, which never held another sandbox's env.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid:
        theirs.close()
        return ours, pid
    code = 1
    try:
        ours.close()
        _forker_main(theirs, scratch)
        code = 0
    except BaseException:
        traceback.print_exc()  # to the edge log
    finally:
        os._exit(code)


def _forker_main(sock: socket.socket, scratch: str) -> None:
    os.closerange(3, sock.fileno())  # the edge's control socket above all
    os.closerange(sock.fileno() + 1, 65536)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    filt = kernel.SeccompFilter()
    pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    while msg := sock.recv(1 << 20):
        req = json.loads(msg)
        spec = WorkerSpec(layers=tuple(req["layers"]), scratch=scratch, oom_file=req["oom_file"])
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = fork_worker(spec, filt, theirs.fileno(), pidns_fd)
        except OSError as exc:
            sock.send(json.dumps({"seq": req["seq"], "error": str(exc)}).encode())
            continue
        finally:
            theirs.close()
        socket.send_fds(
            sock, [json.dumps({"seq": req["seq"], "pid": pid}).encode()], [ours.fileno()]
        )
        ours.close()
