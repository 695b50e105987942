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
  own few pages and the next prepared child count too) and unshares new mount, ipc and
  cgroup namespaces;
* mounts a FRESH tmpfs on /call, an overlay of the layers with its upper dir on that
  tmpfs, its own /proc and /dev, pivots into it, loads the seccomp filter and waits;
* when the worker passes it a call (the connection, whose request the pool already
  read, and the request), writes the call's files, runs the command with aether's own
  ``exec`` code as an unprivileged user, reads the files asked for, answers and exits.

The worker reports the running child's pid to the pool, prepares the next child, waits
for the running one and says ``done``. Each child serves exactly one call.

When the child exits the kernel kills whatever the command left behind (it was pid 1),
and its tmpfs, ipc objects and mounts go with its namespaces, so nothing carries over to
the next call; the worker itself never runs a call's code and never holds its data
(requests are read into one buffer that is zeroed after each fork).
"""

from __future__ import annotations

import array
import gc
import json
import os
import signal
import socket
import struct
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
MAX_DISPATCH = 4 * 1024 * 1024 + 65536  # one request (pool.MAX_REQUEST) plus the sandbox
CALL_DIR = "/call"  # in the worker's root: each call mounts its tmpfs here
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_RDONLY, _MS_REMOUNT = 0x2, 0x4, 0x8, 0x1, 0x20


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker is built from (one per image)."""

    layers: tuple[str, ...]  # top..bottom, as overlayfs wants them
    scratch: str  # an empty host directory the worker mounts its base tmpfs on
    oom_file: str  # memory.oom_control (v1) or memory.events (v2) of the worker's cgroup


def fork_worker(spec: WorkerSpec, filt: kernel.SeccompFilter, keep_fd: int) -> int:
    """Fork a worker and return its pid.

    The caller moves it into its cgroup and then sends ``go`` (moving a process between
    cgroups waits for an RCU grace period, so it is done once per worker, never per call:
    the calls' children are born in it); the worker says ``ready`` on ``keep_fd`` once its
    root is built.
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
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the forker ignores it; we wait for ours
    kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)  # the forker (the pool) is gone
    kernel.set_name(b"dsec-fn-worker")
    sock = socket.socket(fileno=sock_fd)
    if sock.recv(16) != b"go":  # the pool moved us into our cgroup (or gave up on us)
        return
    oom_fd = os.open(spec.oom_file, os.O_RDONLY | os.O_CLOEXEC) if spec.oom_file else -1
    pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    kernel.unshare(kernel.WORKER_NAMESPACES)
    try:  # the OOM killer must never pick the worker (needs CAP_SYS_RESOURCE)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError:
        pass
    _build_base(spec)
    gc.freeze()  # a collection in a call's child must not copy the worker's every page
    sock.send(b"ready")
    buf = bytearray(MAX_DISPATCH)
    child = _prepare(spec, filt, pidns, sock, oom_fd)
    while True:
        try:
            n, anc, _flags, _ = sock.recvmsg_into([buf], socket.CMSG_SPACE(4))
        except OSError:
            return
        fds = _received_fds(anc)
        if not fds:
            return  # the pool closed: no more calls for this worker
        if not _hand(child, memoryview(buf)[:n], fds[0]):  # it died waiting: one more
            os.waitpid(child[0], 0)
            child = _prepare(spec, filt, pidns, sock, oom_fd)
            _hand(child, memoryview(buf)[:n], fds[0])
        buf[:n] = bytes(n)  # the next call's child must not inherit this one's request
        for fd in fds:
            os.close(fd)
        running = child[0]
        sock.send(f"pid {running}".encode())
        child = _prepare(spec, filt, pidns, sock, oom_fd)  # while this call runs
        os.waitpid(running, 0)  # pid 1 of its namespace: everything the call started is gone
        sock.send(b"done")


def _prepare(
    spec: WorkerSpec, filt: kernel.SeccompFilter, pidns: int, pool: socket.socket, oom_fd: int
) -> tuple[int, socket.socket]:
    """Fork the next call's child; it builds its root and waits for its call on the link."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = kernel.fork_into_new_pidns(pidns)
    if pid:
        theirs.close()
        return pid, ours
    code = 1
    try:
        gc.disable()
        kernel.set_name(b"dsec-fn-call")
        kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)  # until it becomes the user
        pool.close()
        ours.close()
        code = _call_main(spec, filt, theirs, oom_fd)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _hand(child: tuple[int, socket.socket], dispatch: memoryview, conn_fd: int) -> bool:
    """Give the prepared child its call: the connection and the request (length first)."""
    link = child[1]
    try:
        socket.send_fds(link, [struct.pack("!I", len(dispatch))], [conn_fd])
        link.sendall(dispatch)
        return True
    except OSError:
        return False
    finally:
        link.close()


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


# ---- the call (in the worker's child) -------------------------------------------------------


def _call_main(
    spec: WorkerSpec, filt: kernel.SeccompFilter, link: socket.socket, oom_fd: int
) -> int:
    kernel.unshare(kernel.CALL_NAMESPACES)
    _build_root(len(spec.layers))
    with open("/proc/self/oom_score_adj", "w") as f:  # the worker's -1000 is not the call's
        f.write("0")
    kernel.prctl(kernel.PR_SET_DUMPABLE, 0)
    filt.load()
    head, fds, _, _ = socket.recv_fds(link, 4, 1)
    if not fds:
        return 0  # the worker went away before a call came
    while len(head) < 4:
        more = link.recv(4 - len(head))
        if not more:
            return 1
        head += more
    (size,) = struct.unpack("!I", head)
    dispatch = bytearray(size)
    view, got = memoryview(dispatch), 0
    while got < size:
        k = link.recv_into(view[got:])
        if not k:
            return 1
        got += k
    link.close()
    return serve(fds[0], bytes(dispatch), oom_fd)


def _build_root(layers: int) -> None:
    """Mount a fresh tmpfs, the overlay over it, /proc and /dev, and pivot into it."""
    call = CALL_DIR
    mounts.mount(
        "tmpfs", call, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={SCRATCH_SIZE_MB}m,mode=0755"
    )
    for d in ("upper", "work", "root"):
        os.mkdir(os.path.join(call, d), 0o755)
    root = os.path.join(call, "root")
    lower = [Path(f"/l{i}") for i in range(layers)]
    data = overlay_options(lower, Path(call, "upper"), Path(call, "work"))
    mounts.mount("overlay", root, "overlay", _MS_NODEV, data)
    for d in ("proc", "dev", "tmp"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)
    mounts.mount("proc", os.path.join(root, "proc"), "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    dev = os.path.join(root, "dev")
    mounts.mount("tmpfs", dev, "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,mode=0755")
    kernel.make_devices(dev)
    kernel.pivot_root(root)


def serve(conn_fd: int, dispatch: bytes, oom_fd: int) -> int:
    """Run the call the pool handed over and answer it; return the exit code."""
    os.set_inheritable(conn_fd, False)
    conn = Conn(socket.socket(fileno=conn_fd))
    try:
        msg = _loads(dispatch)
        result = run_call(conn, msg["request"], msg["sandbox"], oom_fd)
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
    while msg := sock.recv(1 << 20):
        req = json.loads(msg)
        spec = WorkerSpec(
            layers=tuple(req["layers"]),
            scratch=scratch,
            oom_file=req["oom_file"],
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
