"""The container backend: sandboxes as crun containers on an overlay of the image's layers.

create():  resolve image -> state_dir/{upper,work,rootfs} -> overlay mount -> listening
           agent socket -> config.json -> ``crun run -d`` (socket as fd 3) -> Started(pid)
destroy(): crun kill -9 + delete -f -> cgroups -> umount -> state_dir, socket

Every step of create() is undone if a later one fails, and destroy() tolerates any
half-made sandbox, so both are safe to repeat after a crash. Blocking work runs in
subprocesses or threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import socket
from pathlib import Path

from dsec.core.errors import (
    DsecError,
    InvalidArgument,
    InvalidState,
    SandboxFailed,
    SandboxNotFound,
)
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import (
    SANDBOX_NAME_RE,
    Availability,
    Capabilities,
    RuntimeState,
    SandboxPaths,
    Started,
)
from dsec.edge.backends.container import cgroups, mntns, ocispec, overlay
from dsec.edge.backends.container.crun import Crun
from dsec.edge.backends.container.leaks import find_leaks
from dsec.edge.images.store import ImageStore
from dsec.edge.net.edgenet import EdgeNetwork
from dsec.obs import log
from dsec.paths import Paths

_log = logging.getLogger(__name__)
_STATES = {
    "running": RuntimeState.RUNNING,
    "paused": RuntimeState.PAUSED,
    "created": RuntimeState.STOPPED,
    "stopped": RuntimeState.STOPPED,
}
LISTEN_BACKLOG = 128


class ContainerBackend:
    """:class:`dsec.edge.backends.api.Backend` on crun, overlayfs and cgroups."""

    name = "container"

    def __init__(
        self,
        paths: Paths,
        edge_id: str,
        *,
        image_store: ImageStore,
        cgroup_parent: str = "dsec",
        sandboxes_dir: Path | None = None,
        network: EdgeNetwork | None = None,
    ) -> None:
        """Set up the backend (cheap; host checks happen in availability()/create()).

        Args:
            paths: the node's directories (crun state lives in ``<run>/crun``).
            edge_id: this edge's id (for log lines).
            image_store: where images are resolved.
            cgroup_parent: cgroup under which every sandbox gets ``<parent>/<id>``.
            sandboxes_dir: where the edge keeps sandbox state dirs; on hybrid-cgroup hosts
                it is made a shared mount so crun's namespace sees new rootfs mounts
                (default ``<home>/edge/sandboxes``).
        """
        self.paths = paths
        self.edge_id = edge_id
        self.images = image_store
        self.cgroup_parent = cgroup_parent.strip("/")
        self.crun = Crun(paths.run / "crun")
        self.sandboxes_dir = sandboxes_dir or paths.home / "edge" / "sandboxes"
        self._layout: cgroups.CgroupLayout | None = None
        self._ns: mntns.CrunNamespace | None = None
        self._setup_lock = asyncio.Lock()
        self._setup_done = False
        self.network = network

    # --- host checks -----------------------------------------------------------------

    def layout(self) -> cgroups.CgroupLayout:
        if self._layout is None:
            self._layout = cgroups.detect()
        return self._layout

    def availability(self) -> Availability:
        """Can containers run here, and how (a note on the cgroup workaround)."""
        if os.geteuid() != 0:
            return Availability(False, "the container backend needs root")
        missing = [b for b in ("crun", "nsenter", "unshare") if shutil.which(b) is None]
        if missing:
            return Availability(False, f"missing programs: {', '.join(missing)}")
        try:
            with open("/proc/filesystems") as f:
                if "overlay" not in f.read():
                    return Availability(False, "the kernel has no overlayfs")
            layout = self.layout()
        except (OSError, DsecError) as exc:
            return Availability(False, str(exc))
        note = layout.describe()
        if layout.crun_needs_private_ns:
            note += ", crun via private mntns"
        return Availability(True, note)

    def capabilities(self) -> Capabilities:
        """Containers keep state, pause (cgroup freezer), have PTYs; no snapshot or fork."""
        return Capabilities(
            pause=True,
            pty=True,
            persistent_processes=True,
            persistent_filesystem=True,
            network_policy=self.network is not None,
            max_vcpus=float(os.cpu_count() or 1),
            notes="" if self.network is not None else "no sandbox networking on this edge",
        )

    async def prepare(self) -> None:
        """Do the host setup now (the edge calls it before sandbox networking starts, so
        namespace files made early land below the shared sandboxes dir, not under it)."""
        await self._setup()

    async def _setup(self) -> None:
        """Once per process: detect cgroups; on hybrid hosts prepare crun's namespace."""
        if self._setup_done:
            return
        async with self._setup_lock:
            if self._setup_done:
                return
            layout = await asyncio.to_thread(self.layout)
            if layout.crun_needs_private_ns:
                ns = self._crun_namespace()
                await asyncio.to_thread(ns.ensure)
                self._ns = ns
            self._setup_done = True

    def release_host_setup(self) -> None:
        """Undo the persistent host setup (crun's namespace, the shared bind). Blocking.

        The edge never calls this (the namespace outlives restarts); tests and uninstall do.
        Nothing happens on hosts that never needed the namespace.
        """
        self._ns = None
        self._setup_done = False
        if self.layout().crun_needs_private_ns:
            self._crun_namespace().release()
        cgroups.remove_if_empty(self.layout(), "/" + self.cgroup_parent)

    def _crun_namespace(self) -> mntns.CrunNamespace:
        return mntns.CrunNamespace(self.paths.run / "crun.mntns", self.sandboxes_dir)

    def cgroup_path(self, sandbox_id: str) -> str:
        return f"/{self.cgroup_parent}/{sandbox_id}"

    def _launcher(self, rootfs: Path) -> mntns.Launcher:
        if self._ns is None:
            return mntns.DIRECT
        return self._ns.launcher_for(rootfs)

    # --- lifecycle ---------------------------------------------------------------------

    async def create(self, sandbox_id: str, spec: SandboxSpec, paths: SandboxPaths) -> Started:
        """Build and start the sandbox; on failure leave nothing behind.

        Raises:
            InvalidArgument: malformed sandbox id or unusable paths.
            ImageNotFound: the image is not in the store.
            SandboxFailed: crun or a mount failed (the message says which).
        """
        _check_id(sandbox_id)
        if self.network is None and (spec.network.allow or spec.network.deny):
            raise InvalidArgument("this edge has no sandbox networking: network rules refused")
        existing = await self.crun.state(sandbox_id)
        if existing is not None and existing.status in ("running", "paused"):
            return Started(pid=existing.pid)  # a repeated create after a crash
        image = self.images.resolve(spec.image)
        agent = self.paths.agent_bundle
        _check_agent_bundle(agent)
        await self._setup()
        if existing is not None or paths.state_dir.exists():
            await self.destroy(sandbox_id, paths)  # leftovers of an earlier attempt
        dirs = overlay.RootfsDirs.in_state_dir(paths.state_dir)
        sock: socket.socket | None = None
        try:
            await asyncio.to_thread(_prepare_rootfs, paths.state_dir, dirs, image.layer_dirs)
            netns: Path | None = None
            resolv: str | None = None
            if self.network is not None:
                net = await self.network.create(sandbox_id, spec.network)
                netns, resolv = net.netns, net.resolv_conf()
            etc_dir = paths.state_dir / "etc"
            await asyncio.to_thread(_write_etc, etc_dir, sandbox_id, resolv)
            sock = _listen(paths.agent_socket)
            config = ocispec.build_config(
                sandbox_id=sandbox_id,
                spec=spec,
                image=image,
                rootfs=dirs.rootfs,
                agent_bundle=agent,
                cgroups_path=self.cgroup_path(sandbox_id),
                etc_dir=etc_dir,
                netns_path=netns,
            )
            await asyncio.to_thread(ocispec.write_config, paths.state_dir, config)
            pid_file = paths.state_dir / "init.pid"
            await self.crun.run_detached(
                sandbox_id,
                paths.state_dir,
                listen_fd=sock.fileno(),
                console=paths.state_dir / "console.log",
                log=paths.state_dir / "crun.log",
                pid_file=pid_file,
                prefix=self._launcher(dirs.rootfs).prefix,
            )
            pid = int(pid_file.read_text().strip())
        except BaseException as exc:
            if sock is not None:
                sock.close()
                sock = None
            await asyncio.shield(self._rollback(sandbox_id, paths))
            if isinstance(exc, DsecError | asyncio.CancelledError):
                raise
            if isinstance(exc, OSError | ValueError):
                raise SandboxFailed(f"creating sandbox {sandbox_id} failed: {exc}") from exc
            raise
        finally:
            if sock is not None:
                sock.close()  # the container holds its own copy as fd 3
        log(_log, "container started", sandbox_id=sandbox_id, pid=pid, edge=self.edge_id)
        return Started(pid=pid, main=image.config.main_command())

    async def _rollback(self, sandbox_id: str, paths: SandboxPaths) -> None:
        try:
            await self.destroy(sandbox_id, paths)
        except DsecError as exc:
            log(_log, "rollback left state", logging.WARNING, sandbox_id=sandbox_id, err=str(exc))

    async def state(self, sandbox_id: str) -> tuple[RuntimeState, int]:
        """Runtime state from ``crun state`` and the init's host pid (0 unless running)."""
        if not SANDBOX_NAME_RE.match(sandbox_id):
            return RuntimeState.MISSING, 0
        st = await self.crun.state(sandbox_id)
        if st is None:
            return RuntimeState.MISSING, 0
        rs = _STATES.get(st.status, RuntimeState.STOPPED)
        return rs, (st.pid if rs in (RuntimeState.RUNNING, RuntimeState.PAUSED) else 0)

    async def pause(self, sandbox_id: str) -> None:
        """Freeze the sandbox (idempotent: pausing a paused sandbox is fine).

        Raises:
            SandboxNotFound: no such container.
            InvalidState: it is not running.
        """
        rs, _ = await self.state(sandbox_id)
        if rs is RuntimeState.PAUSED:
            return
        if rs is RuntimeState.MISSING:
            raise SandboxNotFound(f"no container for sandbox {sandbox_id}")
        if rs is not RuntimeState.RUNNING:
            raise InvalidState(f"sandbox {sandbox_id} is {rs.value}, cannot pause")
        await self.crun.pause(sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        """Thaw the sandbox (idempotent: resuming a running sandbox is fine)."""
        rs, _ = await self.state(sandbox_id)
        if rs is RuntimeState.RUNNING:
            return
        if rs is RuntimeState.MISSING:
            raise SandboxNotFound(f"no container for sandbox {sandbox_id}")
        if rs is not RuntimeState.PAUSED:
            raise InvalidState(f"sandbox {sandbox_id} is {rs.value}, cannot resume")
        await self.crun.resume(sandbox_id)

    async def destroy(self, sandbox_id: str, paths: SandboxPaths) -> None:
        """Kill everything and remove container, cgroups, mount, state_dir and socket.

        Idempotent; fine on a half-created or unknown sandbox.

        Raises:
            InvalidArgument: malformed sandbox id.
            SandboxFailed: something could not be removed (the message lists it).
        """
        _check_id(sandbox_id)
        problems: list[str] = []
        layout = await asyncio.to_thread(self.layout)
        path = self.cgroup_path(sandbox_id)
        if self.crun.exists(sandbox_id):
            # A paused sandbox's tasks cannot die until thawed; `delete --force` SIGKILLs
            # every process of the container and removes it in one crun call.
            await asyncio.to_thread(cgroups.thaw, layout, path)
            try:
                await self.crun.delete(sandbox_id, force=True)
            except DsecError as exc:
                problems.append(exc.message)
        left = await asyncio.to_thread(cgroups.remove, layout, path)
        problems.extend(f"cgroup {p} not removable" for p in left)
        try:
            await asyncio.to_thread(_remove_files, paths)
        except OSError as exc:
            problems.append(str(exc))
        if self.network is not None:
            try:
                await self.network.destroy(sandbox_id)
            except DsecError as exc:
                problems.append(exc.message)
        if problems:
            raise SandboxFailed(f"destroying {sandbox_id} left state: " + "; ".join(problems))

    async def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        """Replace a running sandbox's network policy.

        Raises:
            InvalidArgument: this edge has no sandbox networking.
            SandboxNotFound: the sandbox has no network.
        """
        if self.network is None:
            raise InvalidArgument("this edge has no sandbox networking")
        await self.network.set_policy(sandbox_id, policy)

    async def network_stats(self, sandbox_id: str) -> dict[str, int]:
        """Allowed/denied bytes, packets and connections (empty without networking)."""
        if self.network is None or self.network.get(sandbox_id) is None:
            return {}
        return (await self.network.counters()).get(sandbox_id, {})

    async def usage(self, sandbox_id: str) -> dict[str, float]:
        """Live usage from the sandbox's cgroups (see :func:`cgroups.read_usage`).

        Raises:
            SandboxNotFound: the sandbox has no cgroup.
        """
        _check_id(sandbox_id)
        layout = await asyncio.to_thread(self.layout)
        path = self.cgroup_path(sandbox_id)
        if not cgroups.sandbox_cgroups(layout, path):
            raise SandboxNotFound(f"no cgroup for sandbox {sandbox_id}")
        return await asyncio.to_thread(cgroups.read_usage, layout, path)

    def leaked(self, sandbox_id: str, paths: SandboxPaths | None = None) -> list[str]:
        """Describe whatever is left of a sandbox on this host (empty: nothing). Blocking.

        Looks for mounts (also inside crun's namespace), cgroups in every hierarchy,
        crun state, the agent socket and the state dir.
        """
        layout = self.layout()
        net = self.network.leaked_files(sandbox_id) if self.network is not None else []
        return net + find_leaks(
            sandbox_id,
            paths,
            layout=layout,
            cgroup_path=self.cgroup_path(sandbox_id),
            crun_root=self.crun.root,
            ns_file=self._crun_namespace().ns_file if layout.crun_needs_private_ns else None,
        )


def _check_id(sandbox_id: str) -> None:
    if not SANDBOX_NAME_RE.match(sandbox_id):
        raise InvalidArgument(f"invalid sandbox id {sandbox_id!r}")


def _check_agent_bundle(agent: Path) -> None:
    init = agent / "init"
    if not os.access(init, os.X_OK):
        raise SandboxFailed(
            f"the agent bundle is missing: {init} is not an executable file "
            "(build it with `dsec setup`)"
        )
    run = agent / "run"
    if not run.is_dir():
        # /.dsec is read-only inside, so the mount point of /.dsec/run must exist in it.
        try:
            run.mkdir(mode=0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            raise SandboxFailed(f"the agent bundle has no run/ directory: {exc}") from None


def _write_etc(etc_dir: Path, sandbox_id: str, resolv_conf: str | None) -> None:
    etc_dir.mkdir(mode=0o755)
    for name, text in ocispec.etc_files(sandbox_id, resolv_conf).items():
        (etc_dir / name).write_text(text)


def _prepare_rootfs(
    state_dir: Path, dirs: overlay.RootfsDirs, layers_top_first: tuple[Path, ...]
) -> None:
    state_dir.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    state_dir.mkdir(mode=0o700)
    dirs.make()
    try:
        overlay.mount_rootfs(dirs, layers_top_first)
    except OSError as exc:
        raise SandboxFailed(f"mounting the root filesystem failed: {exc}") from None


def _listen(path: Path) -> socket.socket:
    if len(os.fsencode(path)) >= 108:
        raise InvalidArgument(f"agent socket path too long for a unix socket: {path}")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, 0o600)
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _remove_files(paths: SandboxPaths) -> None:
    rootfs = paths.state_dir / "rootfs"
    overlay.unmount_rootfs(rootfs)
    with contextlib.suppress(FileNotFoundError):
        paths.agent_socket.unlink()
    if paths.state_dir.exists():
        if os.path.ismount(rootfs):  # never rmtree into a mounted image
            raise OSError(errno.EBUSY, f"{rootfs} is still mounted")
        shutil.rmtree(paths.state_dir)
