"""The function pool: one process per edge that keeps isolated workers ready and serves calls.

``python -m dsec.edge.backends.function.pool --control-fd N --state DIR --cgroup PATH``

The backend (in the edge) registers each function sandbox over the control socket with the
listening socket of its ``agent_socket``; from then on the pool speaks aether's runtime
protocol on it, so the edge relays calls exactly as it does for containers:

* it reads the request frame itself: ``ping`` is answered here, ops that need state
  (files on a persistent filesystem, processes, PTYs, shells, HTTP/TCP to a server) get a
  ``backend_unavailable`` error naming the backend to use instead;
* an ``exec`` goes, with the connection, to a ready worker of the sandbox's image after
  the call's memory, CPU and pids limits are written to that worker's cgroup. The worker
  forks a fresh child for the call (new pid, mount, ipc and cgroup namespaces, a new
  tmpfs under its root: see :mod:`.worker`), which answers on the connection itself; the
  worker reports the child's pid and then ``done``, prepares its next call's child (a
  worker doing that counts as starting) and says ``ready`` again.

Workers are long-lived: ``WARM`` idle ones per image, more while calls queue (up to
``MAX_WORKERS``), the extra ones retired when they fall idle. An image's workers stay
``LINGER_S`` after its last sandbox is removed, so a sandbox made next (create, call,
kill, create...) finds them warm; workers hold no sandbox's data, so sharing them is safe.

One thread, one ``selectors`` loop: control messages, listening sockets, half-read
requests, worker sockets (``ready``/``pid N``/``done``), worker pidfds (exit) and call
deadlines (a call over its deadline has its child killed). The pool gets SIGTERM when the
edge dies; on SIGTERM or a closed control socket it kills every worker and call, removes
their cgroups and exits.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import select
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.agent import protocol
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.function import kernel, worker, zygote
from dsec.edge.backends.function.limits import WorkerCgroups
from dsec.paths import Paths

WARM = int(os.environ.get("DSEC_FUNCTION_WARM", "4"))  # idle workers kept per image
MAX_WORKERS = max(WARM, int(os.environ.get("DSEC_FUNCTION_MAX_WORKERS", "16")))  # per image
LINGER_S = float(os.environ.get("DSEC_FUNCTION_LINGER_S", "30"))  # an unused image's workers
DEFAULT_CALL_TIMEOUT_S = 300.0
DEADLINE_GRACE_S = 2.0  # the worker enforces the timeout; the pool kills it after this
MAX_REQUEST = 4 * 1024 * 1024
START_FAILURES_TO_GIVE_UP = 5

# Ops a function call cannot serve, with the backend that can.
STATEFUL = {
    "files.": "has no persistent filesystem (pass files with exec's 'files'/'outputs')",
    "process.": "has no persistent processes",
    "pty.": "has no terminals",
    "shell.": "has no persistent shells",
    "http": "runs no servers between calls",
    "tcp": "runs no servers between calls",
}


def stateful_error(op: str) -> str | None:
    for prefix, why in STATEFUL.items():
        if op == prefix or (prefix.endswith(".") and op.startswith(prefix)):
            return f"backend 'function' {why}; use backend='container' for {op!r}"
    return None


@dataclass(eq=False)
class Sandbox:
    id: str
    listener: socket.socket
    image: tuple[str, ...]
    env: dict[str, str]
    workdir: str
    memory_mb: int
    cpu: float
    pids: int


@dataclass(eq=False)
class Worker:
    seq: int
    image: tuple[str, ...]
    sock: socket.socket
    cgroup: str
    pid: int
    pidfd: int = -1
    phase: str = "starting"  # starting | ready | busy | retiring
    sandbox: str = ""
    deadline: float = 0.0
    call_pid: int = 0  # the busy call's child (pid 1 of its pid namespace)
    calls: int = 0  # calls served


@dataclass(eq=False)
class PendingCall:
    sandbox: Sandbox
    conn: socket.socket
    request: dict[str, Any]


@dataclass(eq=False)
class HalfRead:
    sandbox: Sandbox
    conn: socket.socket
    buf: bytearray = field(default_factory=bytearray)


@dataclass(eq=False)
class ImagePool:
    users: int = 0
    ready: collections.deque[Worker] = field(default_factory=collections.deque)
    starting: int = 0
    busy: int = 0
    pending: collections.deque[PendingCall] = field(default_factory=collections.deque)
    failures: int = 0
    unused_since: float = 0.0  # when its last sandbox went (0: it has sandboxes)


class Pool:
    def __init__(self, control: socket.socket, state_dir: Path, cgroup: str) -> None:
        self.control = control
        self.state_dir = state_dir
        self.scratch = state_dir / "mnt"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.cgroups = WorkerCgroups(cgroups.detect(), cgroup)
        self.spawning: dict[int, tuple[tuple[str, ...], str]] = {}
        exe = zygote.binary(Paths.from_env().data)
        self.forker, self.forker_pid = worker.start_forker(str(self.scratch), str(exe))
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.forker, selectors.EVENT_READ, ("forker", None))
        self.sandboxes: dict[str, Sandbox] = {}
        self.images: dict[tuple[str, ...], ImagePool] = {}
        self.workers: dict[int, Worker] = {}  # by seq
        self.free_cgroups: list[str] = []
        self.seq = 0
        self.started = time.monotonic()
        self.running = True
        self.sel.register(control, selectors.EVENT_READ, ("control", None))
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wakeup", None))
        self.cgroups.remove_stale()

    # ---- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        while self.running:
            timeout = self._next_deadline()
            for key, _ in self.sel.select(timeout):
                kind, obj = key.data
                try:
                    getattr(self, f"_on_{kind}")(obj)
                except Exception as exc:  # one bad event must not stop the pool
                    _log(f"{kind} event failed: {type(exc).__name__}: {exc}")
            self._enforce_deadlines()
        self.shutdown()

    def _next_deadline(self) -> float | None:
        busy = [w.deadline for w in self.workers.values() if w.phase == "busy"]
        busy += [p.unused_since + LINGER_S for p in self.images.values() if p.unused_since]
        return max(0.0, min(busy) - time.monotonic()) if busy else None

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for w in list(self.workers.values()):
            if w.phase == "busy" and w.deadline <= now:
                _log(f"the call in worker {w.pid} overran its deadline; killing it")
                self._kill_call(w)
                w.deadline = now + 3600
        for image, pool in list(self.images.items()):
            if pool.unused_since and pool.unused_since + LINGER_S <= now:
                self._drop_image(image)

    def _on_wakeup(self, _: None) -> None:
        with contextlib.suppress(OSError):
            os.read(self.wake_r, 512)

    # ---- control -----------------------------------------------------------------------

    def _on_control(self, _: None) -> None:
        fds: list[int] = []
        try:
            msg, fds, _flags, _addr = socket.recv_fds(self.control, 1 << 20, 1)
        except OSError:
            msg = b""
        if not msg:
            self.running = False
            return
        try:
            req = json.loads(msg)
            reply = self._control(req, fds)
        except Exception as exc:
            for fd in fds:
                os.close(fd)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        self.control.send(json.dumps(reply).encode())

    def _control(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        op = req.get("op")
        if op == "add":
            self._add(req, fds[0])
        elif op == "remove":
            self._remove(str(req["id"]))
        elif op == "stats":
            return {
                "pid": os.getpid(),
                "sandboxes": sorted(self.sandboxes),
                "workers": [
                    {
                        "pid": w.pid,
                        "state": w.phase,
                        "sandbox": w.sandbox,
                        "cgroup": w.cgroup,
                        "calls": w.calls,
                        "call_pid": w.call_pid,
                    }
                    for w in self.workers.values()
                ],
            }
        elif op == "shutdown":
            self.running = False
        else:
            raise ValueError(f"unknown control op {op!r}")
        return {"ok": True}

    def _add(self, req: dict[str, Any], fd: int) -> None:
        sid = str(req["id"])
        if sid in self.sandboxes:
            os.close(fd)
            return
        listener = socket.socket(fileno=fd)
        listener.setblocking(False)
        sb = Sandbox(
            id=sid,
            listener=listener,
            image=tuple(req["layers"]),
            env=dict(req.get("env") or {}),
            workdir=str(req.get("workdir") or ""),
            memory_mb=int(req["memory_mb"]),
            cpu=float(req["cpu"]),
            pids=int(req["pids"]),
        )
        self.sandboxes[sid] = sb
        self.sel.register(listener, selectors.EVENT_READ, ("accept", sb))
        pool = self.images.setdefault(sb.image, ImagePool())
        pool.users += 1
        pool.unused_since = 0.0
        pool.failures = 0  # a new sandbox tries again
        self._refill(sb.image)

    def _remove(self, sid: str) -> None:
        sb = self.sandboxes.pop(sid, None)
        if sb is None:
            return
        self.sel.unregister(sb.listener)
        sb.listener.close()
        for key in list(self.sel.get_map().values()):
            kind, obj = key.data
            if kind == "request" and obj.sandbox is sb:
                self._drop_half(obj)
        for w in list(self.workers.values()):
            if w.phase == "busy" and w.sandbox == sid:
                self._kill(w)  # the worker holds the call's connection: cut it off too
        pool = self.images[sb.image]
        for call in [c for c in pool.pending if c.sandbox is sb]:
            pool.pending.remove(call)
            call.conn.close()
        pool.users -= 1
        if pool.users <= 0:
            pool.unused_since = time.monotonic()
            if LINGER_S <= 0 or not self.running:
                self._drop_image(sb.image)

    def _drop_image(self, image: tuple[str, ...]) -> None:
        """Retire an image none of whose sandboxes is left: its idle workers are killed."""
        pool = self.images.pop(image)
        while pool.ready:
            self._kill(pool.ready.popleft())

    # ---- calls -------------------------------------------------------------------------

    def _on_accept(self, sb: Sandbox) -> None:
        while True:
            try:
                conn, _ = sb.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.setblocking(False)
            half = HalfRead(sb, conn)
            self.sel.register(conn, selectors.EVENT_READ, ("request", half))
            self._on_request(half)  # the request has usually arrived with the connection

    def _drop_half(self, half: HalfRead) -> None:
        self.sel.unregister(half.conn)
        half.conn.close()

    def _on_request(self, half: HalfRead) -> None:
        """Read the request frame, never a byte beyond it (stdin frames follow): all of it
        that has arrived (header and body usually arrive together), not a part per event."""
        while self._read_request(half):
            pass

    def _read_request(self, half: HalfRead) -> bool:
        """One read of the request frame; True if the next read may find more."""
        need = protocol.HEADER.size
        if len(half.buf) >= need:
            length, _ = protocol.parse_header(bytes(half.buf[:need]))
            need += length
        try:
            chunk = half.conn.recv(need - len(half.buf))
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self._drop_half(half)
            return False
        half.buf += chunk
        if len(half.buf) < protocol.HEADER.size:
            return True
        if len(half.buf) == protocol.HEADER.size:
            length, kind = protocol.parse_header(bytes(half.buf))
            if kind != protocol.KIND_JSON or length > MAX_REQUEST:
                self._answer(half, protocol.error("invalid_argument", "bad request frame"))
                return False
            return True
        length, _ = protocol.parse_header(bytes(half.buf[: protocol.HEADER.size]))
        if len(half.buf) < protocol.HEADER.size + length:
            return True
        self.sel.unregister(half.conn)
        try:
            req = protocol.decode_json(bytes(half.buf[protocol.HEADER.size :]))
        except protocol.ProtocolError as exc:
            self._answer(half, protocol.error("invalid_argument", str(exc)), registered=False)
            return False
        self._route(half.sandbox, half.conn, req)
        return False

    def _answer(self, half: HalfRead, frame: bytes, registered: bool = True) -> None:
        if registered:
            self.sel.unregister(half.conn)
        _send_and_close(half.conn, frame)

    def _route(self, sb: Sandbox, conn: socket.socket, req: dict[str, Any]) -> None:
        op = str(req.get("op", ""))
        if op == "ping":
            uptime = round(time.monotonic() - self.started, 3)
            value = {"version": protocol.PROTOCOL_VERSION, "pid": os.getpid(), "uptime_s": uptime}
            _send_and_close(conn, protocol.result(value))
            return
        why = stateful_error(op)
        if why is not None:
            _send_and_close(conn, protocol.error("backend_unavailable", why))
            return
        if op != "exec":
            _send_and_close(conn, protocol.error("invalid_argument", f"unknown op {op!r}"))
            return
        error = _check_limits(sb, req)
        if error:
            _send_and_close(conn, protocol.error("invalid_argument", error))
            return
        pool = self.images[sb.image]
        pool.pending.append(PendingCall(sb, conn, req))
        self._dispatch(sb.image)

    def _dispatch(self, image: tuple[str, ...]) -> None:
        pool = self.images.get(image)
        if pool is None:
            return
        while pool.pending and pool.ready:
            call, w = pool.pending.popleft(), pool.ready.pop()  # the warmest worker
            try:
                self._hand_over(w, call)
            except OSError as exc:
                _log(f"handing a call to worker {w.pid} failed: {exc}")
                _send_and_close(call.conn, protocol.error("unavailable", "function worker lost"))
                self._kill(w)
        self._refill(image)

    def _hand_over(self, w: Worker, call: PendingCall) -> None:
        sb, req = call.sandbox, call.request
        memory_mb = int(req.get("memory_mb") or sb.memory_mb)
        self.cgroups.set_limits(w.cgroup, memory_mb, sb.cpu, sb.pids)
        timeout = req.get("timeout") or DEFAULT_CALL_TIMEOUT_S
        req = {**req, "timeout": timeout}
        req.pop("memory_mb", None)
        call.conn.setblocking(True)
        msg = json.dumps(
            {"request": req, "sandbox": {"id": sb.id, "env": sb.env, "workdir": sb.workdir}}
        ).encode()
        socket.send_fds(w.sock, [msg], [call.conn.fileno()])
        call.conn.close()
        w.phase, w.sandbox, w.call_pid = "busy", sb.id, 0
        self.images[w.image].busy += 1
        w.deadline = time.monotonic() + float(timeout) + DEADLINE_GRACE_S

    # ---- workers -----------------------------------------------------------------------

    def _refill(self, image: tuple[str, ...]) -> None:
        pool = self.images.get(image)
        if pool is None or pool.failures >= START_FAILURES_TO_GIVE_UP:
            if pool is not None:
                while pool.pending:
                    call = pool.pending.popleft()
                    msg = "function workers fail to start on this edge (see the edge log)"
                    _send_and_close(call.conn, protocol.error("sandbox_failed", msg))
            return

        def short() -> bool:  # calls wait, or fewer than WARM workers are up
            spare = len(pool.ready) + pool.starting
            return spare < len(pool.pending) or spare + pool.busy < WARM

        while short() and len(pool.ready) + pool.starting + pool.busy < MAX_WORKERS:
            self._start_worker(image)
            pool.starting += 1

    def _start_worker(self, image: tuple[str, ...]) -> None:
        """Ask the forker for a worker; :meth:`_on_forker` takes it from there."""
        self.seq += 1
        if self.free_cgroups:  # an empty cgroup of an earlier worker: no mkdir/rmdir per call
            rel = self.free_cgroups.pop()
        else:
            rel = self.cgroups.make(f"w{os.getpid()}-{self.seq}")
        spec = {
            "seq": self.seq,
            "layers": list(image),
            "oom_file": self.cgroups.oom_file(rel),
        }
        self.spawning[self.seq] = (image, rel)
        self.forker.send(json.dumps(spec).encode())

    def _on_forker(self, _unused: None) -> None:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(self.forker, 4096, 1)
        except OSError:
            msg, fds = b"", []
        if not msg:
            _log("the forker exited; stopping")
            self.running = False
            return
        reply = json.loads(msg)
        image, rel = self.spawning.pop(int(reply["seq"]))
        pool = self.images.get(image)
        if not fds:
            _log(f"forking a worker failed: {reply.get('error')}")
            self.free_cgroups.append(rel)
            if pool is not None:
                pool.starting -= 1
                pool.failures += 1
                self._refill(image)
            return
        pid = int(reply["pid"])
        ours = socket.socket(fileno=fds[0])
        w = Worker(seq=int(reply["seq"]), image=image, sock=ours, cgroup=rel, pid=pid)
        self.workers[w.seq] = w
        w.pidfd = os.pidfd_open(pid)
        self.sel.register(w.pidfd, selectors.EVENT_READ, ("exit", w))
        self.sel.register(ours, selectors.EVENT_READ, ("worker", w))
        try:
            self.cgroups.place(rel, pid)
            ours.send(b"go")
        except OSError as exc:
            _log(f"could not place worker {pid} in its cgroup: {exc}")
            self._kill(w)

    def _on_worker(self, w: Worker) -> None:
        try:
            msg = w.sock.recv(64)
        except OSError:
            msg = b""
        if msg.startswith(b"pid ") and w.phase == "busy":
            w.call_pid = int(msg[4:])
            return
        pool = self.images.get(w.image)
        if msg == b"ready" and w.phase == "starting":
            if pool is not None:
                pool.starting -= 1
                pool.failures = 0
        elif msg == b"done" and w.phase == "busy":
            w.calls += 1
            w.call_pid, w.sandbox = 0, ""
            if pool is not None:
                pool.busy -= 1
        else:  # closed: it exited; its pidfd reports that
            self.sel.unregister(w.sock)
            return
        if pool is None or (len(pool.ready) >= WARM and not pool.pending):
            w.phase = "retiring"  # an idle worker more than needed (or its image is gone)
            self._kill(w)
            return
        if msg == b"done":  # it prepares its next call's process now: "ready" follows
            w.phase = "starting"
            pool.starting += 1
            return
        w.phase = "ready"
        pool.ready.append(w)
        self._dispatch(w.image)

    def _on_exit(self, w: Worker) -> None:
        self._reap(w)  # the forker (its parent) reaps it

    def _reap(self, w: Worker) -> None:
        if self.workers.pop(w.seq, None) is None:
            return
        self._kill_call(w)
        if w.pidfd >= 0:
            self.sel.unregister(w.pidfd)
            os.close(w.pidfd)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(w.sock)
        w.sock.close()
        if self.running and self.cgroups.is_empty(w.cgroup):
            self.free_cgroups.append(w.cgroup)
        else:
            left = self.cgroups.remove(w.cgroup)
            if left:
                _log(f"cgroups left by worker {w.pid}: {', '.join(map(str, left))}")
        pool = self.images.get(w.image)
        if pool is not None:
            if w.phase == "starting":
                pool.starting -= 1
                pool.failures += 1
                _log(f"a function worker failed to start ({pool.failures} in a row)")
            elif w.phase == "busy":
                pool.busy -= 1
            elif w in pool.ready:
                pool.ready.remove(w)
            self._refill(w.image)

    def _kill(self, w: Worker) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGKILL)
        self._kill_call(w)  # after the worker: it must not see the call end and answer it

    def _kill_call(self, w: Worker) -> None:
        """Kill the worker's call: its child is pid 1 of the call's pid namespace."""
        if w.call_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.call_pid, signal.SIGKILL)

    # ---- shutdown ----------------------------------------------------------------------

    def shutdown(self) -> None:
        for sid in list(self.sandboxes):
            self._remove(sid)
        for w in list(self.workers.values()):
            self._kill(w)
        deadline = time.monotonic() + 5
        for w in list(self.workers.values()):
            select.select([w.pidfd], [], [], max(0.0, deadline - time.monotonic()))
            self.images.clear()
            self._reap(w)
        self.forker.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.forker_pid, 0)
        for rel in [*self.free_cgroups, *(rel for _, rel in self.spawning.values())]:
            self.cgroups.remove(rel)
        self.free_cgroups.clear()
        self.cgroups.remove_parent()


def _check_limits(sb: Sandbox, req: dict[str, Any]) -> str:
    mem = req.get("memory_mb")
    if mem is not None and (
        not isinstance(mem, int) or isinstance(mem, bool) or not 16 <= mem <= sb.memory_mb
    ):
        return f"memory_mb must be an integer between 16 and the sandbox's {sb.memory_mb}"
    timeout = req.get("timeout")
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0
    ):
        return "timeout must be a positive number of seconds"
    return ""


def _send_and_close(conn: socket.socket, frame: bytes) -> None:
    try:
        conn.setblocking(True)
        conn.settimeout(1.0)
        conn.sendall(frame)
    except OSError:
        pass
    finally:
        conn.close()


def _log(message: str) -> None:
    sys.stderr.write(f"dsec-function-pool[{os.getpid()}]: {message}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="dsec-function-pool")
    ap.add_argument("--control-fd", type=int, required=True)
    ap.add_argument("--state", type=Path, required=True)
    ap.add_argument("--cgroup", required=True)
    args = ap.parse_args(argv)
    kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGTERM)
    control = socket.socket(fileno=args.control_fd)
    pool = Pool(control, args.state, args.cgroup)

    def stop(signum: int, frame: object) -> None:
        pool.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    control.send(b'{"ready": true}')
    pool.run()


if __name__ == "__main__":
    main()
