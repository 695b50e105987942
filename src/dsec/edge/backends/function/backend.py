"""The function backend: sandboxes that are a record and a socket, calls that run in a pool.

A function sandbox has no process of its own. create() writes ``function.json`` in its
state dir, listens on its ``agent_socket`` and registers both with the edge's pool process
(:mod:`.pool`), which from then on speaks aether's runtime protocol on that socket. So the
manager's readiness ping, the edge's Call/Stream relay, the apiserver and the SDK work
unchanged; each ``exec`` runs in a fresh pre-forked worker (:mod:`.worker`).

The sandbox's "init" is the pool: Started(pid) is the pool's pid, so the manager marks
every function sandbox failed if the pool dies. After an edge restart the pool is new;
state() re-registers a sandbox from its ``function.json``, so function sandboxes are
re-adopted like containers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from dsec.core.errors import (
    BackendUnavailable,
    DsecError,
    InvalidArgument,
    SandboxFailed,
)
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import (
    Availability,
    Capabilities,
    RuntimeState,
    SandboxPaths,
    Started,
)
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.container.backend import _check_id, _listen
from dsec.edge.images.store import ImageStore
from dsec.paths import Paths

CONFIG = "function.json"
POOL_START_TIMEOUT_S = 20.0
CONTROL_TIMEOUT_S = 30.0


class FunctionBackend:
    """:class:`dsec.edge.backends.api.Backend` for short stateless calls."""

    name = "function"

    def __init__(
        self,
        paths: Paths,
        edge_id: str,
        *,
        image_store: ImageStore,
        cgroup_parent: str = "dsec",
        sandboxes_dir: Path | None = None,
    ) -> None:
        self.paths = paths
        self.edge_id = edge_id
        self.images = image_store
        self.cgroup = f"{cgroup_parent.strip('/')}/function-{edge_id}"
        self.sandboxes_dir = sandboxes_dir or paths.home / "edge" / "sandboxes"
        self.state_dir = paths.run / "function"
        self._proc: asyncio.subprocess.Process | None = None
        self._control: socket.socket | None = None
        self._control_lock = threading.Lock()
        self._start_lock = asyncio.Lock()
        self._registered: set[str] = set()

    # ---- host checks ---------------------------------------------------------------------

    def availability(self) -> Availability:
        if os.geteuid() != 0:
            return Availability(False, "the function backend needs root")
        try:
            with open("/proc/filesystems") as f:
                if "overlay" not in f.read():
                    return Availability(False, "the kernel has no overlayfs")
            layout = cgroups.detect()
        except (OSError, DsecError) as exc:
            return Availability(False, str(exc))
        if layout.controller_dir("memory", "/") is None:
            return Availability(False, "no cgroup memory controller")
        import ctypes.util

        if ctypes.util.find_library("seccomp") is None:
            return Availability(False, "libseccomp is not installed (apt-get install libseccomp2)")
        return Availability(True, f"pre-forked workers, {layout.describe()}")

    def capabilities(self) -> Capabilities:
        return Capabilities(
            max_vcpus=float(os.cpu_count() or 1),
            notes="stateless calls: exec with files in/out, per-call time and memory limits; "
            "no network",
        )

    # ---- the pool process ----------------------------------------------------------------

    def pool_pid(self) -> int:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else 0

    async def _ensure_pool(self) -> int:
        async with self._start_lock:
            if self.pool_pid():
                return self.pool_pid()
            self._registered.clear()
            self.state_dir.mkdir(parents=True, exist_ok=True)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "dsec.edge.backends.function.pool",
                    "--control-fd",
                    str(theirs.fileno()),
                    "--state",
                    str(self.state_dir),
                    "--cgroup",
                    self.cgroup,
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
            finally:
                theirs.close()
            ours.settimeout(POOL_START_TIMEOUT_S)
            try:
                hello = await asyncio.to_thread(ours.recv, 4096)
            except OSError as exc:
                hello = f"{exc}".encode()
            if not hello.startswith(b'{"ready"'):
                ours.close()
                await self._kill_pool()
                raise SandboxFailed(f"the function pool did not start: {hello[:200]!r}")
            ours.settimeout(CONTROL_TIMEOUT_S)
            self._control = ours
            return self._proc.pid

    async def _kill_pool(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    def _send(self, msg: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any]:
        """One control request and its reply (blocking: call it in a thread)."""
        with self._control_lock:
            ctl = self._control
            if ctl is None:
                raise SandboxFailed("the function pool is not running")
            try:
                socket.send_fds(ctl, [json.dumps(msg).encode()], fds or [])
                reply = ctl.recv(1 << 20)
            except OSError as exc:
                raise SandboxFailed(f"the function pool does not answer: {exc}") from None
        if not reply:
            raise SandboxFailed("the function pool exited")
        out: dict[str, Any] = json.loads(reply)
        if "error" in out:
            raise SandboxFailed(f"the function pool refused {msg.get('op')}: {out['error']}")
        return out

    async def stats(self) -> dict[str, Any]:
        """The pool's sandboxes and workers (pid, state, cgroup), for tests and metrics."""
        if not self.pool_pid():
            return {"pid": 0, "sandboxes": [], "workers": []}
        return await asyncio.to_thread(self._send, {"op": "stats"})

    async def close(self) -> None:
        """Stop the pool: every worker killed, every cgroup removed."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(DsecError):
                await asyncio.to_thread(self._send, {"op": "shutdown"})
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                await self._kill_pool()
        self._proc = None
        if self._control is not None:
            self._control.close()
            self._control = None
        self._registered.clear()

    # ---- lifecycle -----------------------------------------------------------------------

    async def create(self, sandbox_id: str, spec: SandboxSpec, paths: SandboxPaths) -> Started:
        """Register the sandbox with the pool (starting the pool if needed).

        Raises:
            InvalidArgument: network rules (function calls have no network).
            ImageNotFound: the image is not in the store.
            SandboxFailed: the pool could not start.
        """
        _check_id(sandbox_id)
        if spec.network.allow:
            raise InvalidArgument(
                "backend 'function' has no network access; use backend='container' for "
                "network rules"
            )
        image = self.images.resolve(spec.image)
        env = dict(e.split("=", 1) for e in image.env if "=" in e)
        env.update(spec.env)
        config = {
            "id": sandbox_id,
            "socket": str(paths.agent_socket),
            "layers": [str(p) for p in image.layer_dirs],
            "env": env,
            "workdir": image.config.workdir,
            "memory_mb": spec.memory_mb,
            "cpu": spec.cpu,
            "pids": spec.pids,
        }
        try:
            paths.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            (paths.state_dir / CONFIG).write_text(json.dumps(config))
            pid = await self._register(config)
        except BaseException:
            await asyncio.shield(self.destroy(sandbox_id, paths))
            raise
        return Started(pid=pid)

    async def _register(self, config: dict[str, Any]) -> int:
        pid = await self._ensure_pool()
        sock = _listen(Path(config["socket"]))
        try:
            await asyncio.to_thread(self._send, {"op": "add", **config}, [sock.fileno()])
        finally:
            sock.close()
        self._registered.add(config["id"])
        return pid

    async def state(self, sandbox_id: str) -> tuple[RuntimeState, int]:
        """RUNNING (with the pool's pid) while the sandbox's record is on disk."""
        if sandbox_id in self._registered and self.pool_pid():
            return RuntimeState.RUNNING, self.pool_pid()
        try:
            _check_id(sandbox_id)
            config = json.loads((self.sandboxes_dir / sandbox_id / CONFIG).read_text())
        except (OSError, ValueError, DsecError):
            return RuntimeState.MISSING, 0
        try:
            return RuntimeState.RUNNING, await self._register(config)
        except (OSError, DsecError):
            return RuntimeState.STOPPED, 0

    async def pause(self, sandbox_id: str) -> None:
        raise BackendUnavailable(
            "backend 'function' cannot pause: nothing runs between calls; "
            "use backend='container' to pause"
        )

    async def resume(self, sandbox_id: str) -> None:
        raise BackendUnavailable("backend 'function' cannot pause or resume")

    async def destroy(self, sandbox_id: str, paths: SandboxPaths) -> None:
        """Unregister (killing its calls in flight) and remove its socket and state dir."""
        _check_id(sandbox_id)
        if sandbox_id in self._registered and self.pool_pid():
            with contextlib.suppress(SandboxFailed):  # a dead pool has dropped it already
                await asyncio.to_thread(self._send, {"op": "remove", "id": sandbox_id})
        self._registered.discard(sandbox_id)
        with contextlib.suppress(FileNotFoundError):
            paths.agent_socket.unlink()
        if paths.state_dir.exists():
            await asyncio.to_thread(shutil.rmtree, paths.state_dir)

    async def usage(self, sandbox_id: str) -> dict[str, float]:
        stats = await self.stats()
        busy = [w for w in stats["workers"] if w["sandbox"] == sandbox_id]
        return {"calls_running": float(len(busy))}

    def leaked(self, sandbox_id: str, paths: SandboxPaths | None = None) -> list[str]:
        """What is left of a destroyed sandbox, or of the pool once closed (empty: nothing)."""
        out: list[str] = []
        if paths is not None:
            out += [f"{p} exists" for p in (paths.agent_socket, paths.state_dir) if p.exists()]
        if sandbox_id in self._registered:
            out.append(f"{sandbox_id} is still registered with the pool")
        if not self.pool_pid():
            layout = cgroups.detect()
            out += [f"cgroup left: {d}" for d in cgroups.list_children(layout, self.cgroup)]
        return out

    def release_host_setup(self) -> None:
        """Remove the pool's cgroup and the edge's cgroup parent (the pool's mkdir may have
        made it) where they are empty; the pool removes the rest when it closes."""
        with contextlib.suppress(OSError, DsecError):
            layout = cgroups.detect()
            parent = self.cgroup.rpartition("/")[0]
            if cgroups.remove_if_empty(layout, "/" + self.cgroup) and parent:
                cgroups.remove_if_empty(layout, "/" + parent)
        shutil.rmtree(self.state_dir, ignore_errors=True)
