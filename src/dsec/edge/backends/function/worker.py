"""One function worker: a warm process that serves calls, each in a fresh child.

The pool's forker forks a worker ahead of time (:func:`fork_worker`). The worker unshares
its mount, uts and network namespaces (a network namespace is slow to make and to tear
down, and a call running as ``nobody`` cannot change it), builds a small root and pivots
into it:

    tmpfs (the worker's base)  /l0 /l1 ...  image layers, bind-mounted read-only
                               /call        where each call mounts its own tmpfs

brings up ``lo`` and says ``ready``. From then on it is a zygote that keeps one child
prepared for the next call, forked ahead (so building it is not on the call's path). The
child is pid 1 of a new pid namespace and

* is born in the worker's cgroup (the pool writes each call's limits there; the worker's
  own few pages count too; the next call's child is only prepared once this call is
  answered) and unshares new mount, ipc and cgroup namespaces;
* mounts a FRESH tmpfs on /call, an overlay of the layers with its upper dir on that
  tmpfs, its own /proc and /dev, pivots into it and forks the command's process (pid 2:
  own session, no_new_privs, the seccomp filter loaded), which waits;
* when the worker passes it a call (the connection, whose request the pool already
  read, and the request), writes the call's files, runs the command with aether's own
  ``exec`` code as an unprivileged user, reads the files asked for, answers and exits.

The worker reports the running child's pid to the pool, waits for it, answers and says
``done``; only then does it have the next child prepared (on a busy machine building it
alongside the call slowed the call down) and say ``ready`` again, so the pool hands calls
to workers that are prepared. Each child serves exactly one call.

The child stays as the call's init (pid 1); its own child, forked ahead with the seccomp
filter already loaded, execs the command (``zygote.c``); when the command exits so does
the init, and the kernel kills whatever the command left behind,
and its tmpfs, ipc objects and mounts go with its namespaces, so nothing carries over to
the next call; the worker itself never runs a call's code and never holds its data
(requests are read into one buffer that is zeroed after each fork).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dsec.agent import callfiles, execop, spawn, users
from dsec.agent.wire import AgentError, Conn
from dsec.edge.backends.container import mounts
from dsec.edge.backends.function import kernel, zygote

Resolver = Callable[[str | int | None], users.User]

UNPRIVILEGED_UID = 65534  # nobody
HOSTNAME = "function"
MAX_DISPATCH = 4 * 1024 * 1024 + 65536  # one request (pool.MAX_REQUEST) plus the sandbox
CALL_DIR = "/call"  # in the worker's root: each call mounts its tmpfs here
_MS_NOSUID, _MS_NODEV, _MS_RDONLY, _MS_REMOUNT = 0x2, 0x4, 0x1, 0x20


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker is built from (one per image)."""

    layers: tuple[str, ...]  # top..bottom, as overlayfs wants them
    scratch: str  # an empty host directory the worker mounts its base tmpfs on
    oom_file: str  # memory.oom_control (v1) or memory.events (v2) of the worker's cgroup
    zygote: str  # the compiled zygote (zygote.binary)


def fork_worker(spec: WorkerSpec, filt: kernel.SeccompFilter, keep_fd: int) -> int:
    """Fork a worker and return its pid.

    The caller moves it into its cgroup and then sends ``go`` (moving a process between
    cgroups waits for an RCU grace period, so it is done once per worker, never per call:
    the calls' processes are born in it); the worker says ``ready`` on ``keep_fd`` once its
    root is built and its zygote has the first call's process prepared.
    """
    pid = os.fork()
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
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the forker ignores it
    kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)  # the forker (the pool) is gone
    kernel.set_name(b"dsec-fn-worker")
    sock = socket.socket(fileno=sock_fd)
    if sock.recv(16) != b"go":  # the pool moved us into our cgroup (or gave up on us)
        return
    oom_fd = os.open(spec.oom_file, os.O_RDONLY | os.O_CLOEXEC) if spec.oom_file else -1
    proc = os.open("/proc", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # the host's
    kernel.unshare(kernel.WORKER_NAMESPACES)
    try:  # the OOM killer must never pick the worker (needs CAP_SYS_RESOURCE)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError:
        pass
    own_mnt = os.open("self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc)
    zyg = _start_zygote(spec.zygote, len(spec.layers))  # pivot_root moves it along
    zyg.expect(b"H")
    _build_base(spec)
    zyg.sock.send(filt.program())  # the zygote starts preparing once it has the filter
    zyg.wait_prepared()
    execop_spawn = _spawner(zyg)
    resolve = cached_lookup(users.resolve)  # this process serves only this image
    sock.send(b"ready")
    buf = bytearray(MAX_DISPATCH)
    while True:
        try:
            n, anc, _flags, _ = sock.recvmsg_into([buf], socket.CMSG_SPACE(4))
        except OSError:
            return
        fds = _received_fds(anc)
        if not fds:
            return  # the pool closed: no more calls for this worker
        pid = zyg.prepared  # built after the previous call, before its "ready"
        mnt = os.open(f"{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc)
        sock.send(f"pid {pid}".encode())
        kernel.setns(mnt, kernel.CLONE_NEWNS)  # into the call's root (and cwd "/")
        os.close(mnt)
        zyg.used = False
        try:
            serve(fds[0], bytes(memoryview(buf)[:n]), oom_fd, execop_spawn, resolve)
        finally:
            if not zyg.used:  # the call failed before its command started
                zyg.discard()
            zyg.prepared = 0
            kernel.setns(own_mnt, kernel.CLONE_NEWNS)
        buf[:n] = bytes(n)
        for fd in fds[1:]:
            os.close(fd)
        sock.send(b"done")
        zyg.prepare()  # the call has been answered: off its path
        sock.send(b"ready")


def _start_zygote(exe: str, layers: int) -> zygote.Zygote:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(theirs.fileno(), 3)
            os.closerange(4, 65536)
            os.execve(exe, ["dsec-fn-zygote", str(layers)], {})
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(127)
    theirs.close()
    return zygote.Zygote(ours, pid)


def _spawner(zyg: zygote.Zygote) -> execop.Spawner:
    """``spawn.spawn`` for the worker: the command runs in the zygote's prepared process."""

    def spawn_in_call(
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        stdin: bool,
        uid: int | None = None,
        gid: int | None = None,
        groups: tuple[int, ...] = (),
    ) -> spawn.Child:
        if uid is None or gid is None:
            raise AgentError("permission_denied", "backend 'function' runs calls as a user")
        path = spawn.which(argv[0], env)
        cloexec = os.O_CLOEXEC
        in_r, in_w = os.pipe2(cloexec) if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        out_r, out_w = os.pipe2(cloexec)
        err_r, err_w = os.pipe2(cloexec)
        pid = zyg.prepared
        zyg.used = True
        try:
            stage, err = zyg.start(path, argv, env, cwd, (uid, gid, *groups), (in_r, out_w, err_w))
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        if stage:
            for fd in (in_w, out_r, err_r, zyg.take_pidfd()):
                if fd >= 0:
                    os.close(fd)
            zyg.wait_exit()
            raise OSError(err, os.strerror(err), cwd if stage == 1 else argv[0])
        return zygote.ZygoteChild(zyg, pid, in_w, out_r, err_r)

    return spawn_in_call


def cached_lookup(lookup: Resolver) -> Resolver:
    """``users.resolve``, each user looked up once per worker.

    A lookup reads the call's ``/etc/passwd`` and ``/etc/group`` (each file parsed whole);
    before a call's files are written these are the image's, on the worker's read-only
    layers, so the same for every call the worker serves. Users are taken from the image:
    a call's own files never change who its command runs as. Failed lookups are not kept.
    A call looks its user up once, before its files are written (:func:`run_call`), and
    ``exec`` gets that user (:func:`pinned`).
    """
    cache: dict[tuple[type, str | int | None], users.User] = {}

    def resolve(spec: str | int | None) -> users.User:
        key = (type(spec), spec)
        user = cache.get(key)
        if user is None:
            user = cache[key] = lookup(spec)
        return user

    return resolve


def pinned(user: users.User, resolve: Resolver) -> Resolver:
    """``resolve``, but the call's own user (by uid, as ``exec`` asks for it) is ``user``:
    exec runs the command as the user :func:`run_call` checked, without a second lookup."""

    def resolve_pinned(spec: str | int | None) -> users.User:
        return user if spec == user.uid else resolve(spec)

    return resolve_pinned


def _received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _build_base(spec: WorkerSpec) -> None:
    """Pivot into a tmpfs that holds only the image's layers (read-only) and /call."""
    mounts.mount(None, "/", None, mounts.MS_REC | mounts.MS_PRIVATE)
    base = spec.scratch
    mounts.mount("tmpfs", base, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64k,mode=0755")
    for i, layer in enumerate(spec.layers):
        d = os.path.join(base, f"l{i}")
        os.mkdir(d, 0o755)
        mounts.mount(layer, d, None, mounts.MS_BIND)
        mounts.mount(None, d, None, mounts.MS_BIND | _MS_REMOUNT | _MS_RDONLY)
    os.mkdir(base + CALL_DIR, 0o755)
    socket.sethostname(HOSTNAME)
    kernel.loopback_up()
    kernel.pivot_root(base)


def serve(
    conn_fd: int, dispatch: bytes, oom_fd: int, spawner: execop.Spawner, resolve: Resolver
) -> int:
    """Run the call the pool handed over and answer it; return the exit code."""
    os.set_inheritable(conn_fd, False)
    conn = Conn(socket.socket(fileno=conn_fd))
    try:
        msg = _loads(dispatch)
        result = run_call(conn, msg["request"], msg["sandbox"], oom_fd, spawner, resolve)
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
    conn: Conn,
    req: dict[str, Any],
    sandbox: dict[str, Any],
    oom_fd: int,
    spawner: execop.Spawner,
    resolve: Resolver = users.resolve,
) -> dict[str, Any] | None:
    """Run one ``exec`` request in the call's root, its command as the unprivileged user."""
    user = resolve(req.get("user", UNPRIVILEGED_UID))
    if user.uid == 0:
        raise AgentError(
            "permission_denied",
            "backend 'function' runs calls as an unprivileged user; use backend='container' "
            "to run as root",
        )
    set_environ(sandbox.get("env") or {})
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
    result = execop.op_exec(conn, req, spawner, pinned(user, resolve))
    assert result is not None
    if outputs is not None:  # as the user: the call cannot read more than it could itself
        with _as_user(user):
            result["files"] = callfiles.read_outputs(outputs, cwd, budget)
    if oom_fd >= 0 and _oom_kills(oom_fd) > oom_before:
        result["oom_killed"] = True
    return result


def set_environ(env: dict[str, str]) -> None:
    """Make the process environment the sandbox's (``exec`` builds the command's from it).

    Only when it differs: emptying ``os.environ`` is one ``unsetenv`` per variable, and a
    worker mostly serves the same sandbox again.
    """
    want = dict(env)
    want.setdefault("PATH", users.DEFAULT_PATH)
    if os.environ != want:
        os.environ.clear()
        os.environ.update(want)


@contextlib.contextmanager
def _as_user(user: users.User) -> Iterator[None]:
    """Access files with the user's rights (the effective ids; the worker stays root)."""
    groups = os.getgroups()
    os.setgroups(list(user.groups))
    os.setegid(user.gid)
    os.seteuid(user.uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


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


def start_forker(scratch: str, zygote_exe: str) -> tuple[socket.socket, int]:
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
        _forker_main(theirs, scratch, zygote_exe)
        code = 0
    except BaseException:
        traceback.print_exc()  # to the edge log
    finally:
        os._exit(code)


def _forker_main(sock: socket.socket, scratch: str, zygote_exe: str) -> None:
    os.closerange(3, sock.fileno())  # the edge's control socket above all
    os.closerange(sock.fileno() + 1, 65536)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    filt = kernel.SeccompFilter()
    while msg := sock.recv(1 << 20):
        req = json.loads(msg)
        spec = WorkerSpec(
            layers=tuple(req["layers"]),
            scratch=scratch,
            oom_file=req["oom_file"],
            zygote=zygote_exe,
        )
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = fork_worker(spec, filt, theirs.fileno())
        except OSError as exc:
            sock.send(json.dumps({"seq": req["seq"], "error": str(exc)}).encode())
            continue
        finally:
            theirs.close()
        socket.send_fds(
            sock, [json.dumps({"seq": req["seq"], "pid": pid}).encode()], [ours.fileno()]
        )
        ours.close()
