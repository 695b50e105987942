"""The microVM backend: every sandbox is a guest booted from the image layers.

The VMM is QEMU ``microvm`` or Firecracker, driven only through
:class:`dsec.edge.backends.microvm.vmm.Vmm`; the edge's ``--vmm`` picks it
(:func:`choice.choose_vmm`) and each VM records its driver, so a re-adopted VM keeps it.

create():  image layers -> erofs images (shared) + bundle image + writable disk (a qcow2
           overlay for QEMU, a sparse raw copy for Firecracker) + config disk -> cgroup
           (limits cap the VMM) -> VMM -> agent mux on the agent socket -> wait for the
           guest's multiplexer -> Started(keeper pid)
pause():   snapshot to ``snapshots/current`` (QEMU: RAM stays in its file) and quit the
           VMM; resume(): restore it (the snapshot is refused if a digest differs)
fork():    snapshot the parent into a template, then restore the parent and N children
           from it, RAM mapped privately, each with its own scratch overlay and identity;
           a VM whose RAM is so mapped first moves onto a RAM file of its own before any
           snapshot (fork, pause, named snapshot), so no snapshot writes guest RAM
destroy(): kill the VMM by its pid, the mux, cgroups, files. Idempotent.

The edge watches one pid per sandbox; the VMM's pid changes on every pause/resume, so the
sandbox's pid is a *keeper* (a sleeping process in the sandbox's session that lives from
create to destroy). When the VMM dies on its own (guest panic, OOM kill) the keeper is killed
too, which the edge sees as the sandbox dying.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dsec.agent.protocol import ProtocolError
from dsec.core.errors import (
    BackendUnavailable,
    DsecError,
    InvalidArgument,
    InvalidState,
    SandboxFailed,
    SandboxNotFound,
    SnapshotNotFound,
)
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.api import (
    SANDBOX_NAME_RE,
    Availability,
    Capabilities,
    RuntimeState,
    SandboxPaths,
    Started,
)
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.microvm import (
    choice,
    disks,
    kernel,
    qemu,
    snapshot_cache,
    snapshot_copy,
    snapshots,
)
from dsec.edge.backends.microvm.mux import GuestLink, HostMux
from dsec.edge.backends.microvm.snapshot_cache import SnapshotCache
from dsec.edge.backends.microvm.vmm import Drive, NetIface, Snapshot, VmConfig, Vmm, watched
from dsec.edge.images.store import Image, ImageStore
from dsec.edge.net.edgenet import EdgeNetwork
from dsec.obs import log
from dsec.paths import Paths

_log = logging.getLogger(__name__)
BOOT_TIMEOUT_S = 60.0
RESTORE_TIMEOUT_S = 30.0
# On top of guest RAM: QEMU itself (~50 MiB resident), its TCG code buffer, page tables.
VMM_OVERHEAD_MIB = qemu.TCG_TB_MIB + 128
MAX_FORK = 64
GUEST_SYNC_TIMEOUT_S = 3.0  # the guest's sync before a snapshot (best effort)
PINNED = "pinned"  # in a template directory: a named snapshot (holds the source sandbox id)
# snapshots being taken in by this process (any backend instance: they share directories)
_IMPORTS: set[snapshot_copy.Importer] = set()


@dataclass
class _Vm:
    """What the backend keeps in memory for one live microVM."""

    vmm: Vmm
    mux: HostMux | None = None
    keeper: int = 0
    watch: asyncio.Task[None] | None = None
    expected_exit: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class MicrovmBackend:
    """:class:`dsec.edge.backends.api.Backend` on QEMU microvm or Firecracker."""

    name = "microvm"
    boot_timeout_s: float | None = None  # a subclass's own (default: BOOT_TIMEOUT_S)
    fixed_vmm: str | None = None  # a subclass that runs on one VMM only (q35: "qemu")
    guest_network = True  # the guest configures eth0 from ip= (the vm image does not yet)

    def __init__(
        self,
        paths: Paths,
        edge_id: str,
        *,
        image_store: ImageStore,
        cgroup_parent: str = "dsec",
        sandboxes_dir: Path | None = None,
        mem_dir: Path | None = None,
        kernel_image: Path | None = None,
        vmm: str = "auto",
        network: EdgeNetwork | None = None,
    ) -> None:
        self.paths = paths
        # the edge's sandbox networking: each VM gets a pooled namespace with a TAP
        self.network = network if self.guest_network else None
        self.edge_id = edge_id
        self.images = image_store
        self.cgroup_parent = cgroup_parent.strip("/")
        self.sandboxes_dir = sandboxes_dir or paths.home / "edge" / "sandboxes"
        self.vm_dir = kernel.vm_dir(paths.data)
        self.templates_dir = self.sandboxes_dir.parent / "vm-templates"
        self.mem_dir = mem_dir or Path("/dev/shm") / f"dsec-vm-{_short_hash(paths.home)}"
        self.kernel_image = kernel_image
        self._vms: dict[str, _Vm] = {}
        self._layout: cgroups.CgroupLayout | None = None
        self.vmm_preference = self.fixed_vmm or vmm
        self._vmm_choice: tuple[str, str] | None = None

    def vmm_choice(self) -> tuple[str, str]:
        """``(driver, why)`` for new VMs of this edge (decided once, see ``choose_vmm``).

        Raises:
            BackendUnavailable: the ``--vmm`` asked for cannot run here (the reason says why).
        """
        if self._vmm_choice is None:
            self._vmm_choice = choice.choose_vmm(self.vmm_preference)
        return self._vmm_choice

    def _vmm_note(self) -> str:
        name, why = self.vmm_choice()
        if name == "qemu":
            return f"QEMU microvm, accel {qemu.accelerator()} (VMM qemu: {why})"
        return f"Firecracker (VMM firecracker: {why})"

    # --- host checks -------------------------------------------------------------------

    def availability(self) -> Availability:
        if os.geteuid() != 0:
            return Availability(False, "the microvm backend needs root")
        try:
            name, _ = self.vmm_choice()
        except DsecError as exc:
            return Availability(False, f"no VMM: {exc.message}")
        why = qemu.available()  # qemu-img makes the writable disks of QEMU guests
        if why and name == "qemu":
            return Availability(False, why)
        if self.kernel() is None:
            return Availability(False, "no guest kernel: run `dsec setup`")
        if shutil.which("mkfs.erofs") is None:
            return Availability(False, "mkfs.erofs is missing (apt-get install erofs-utils)")
        return Availability(True, self._vmm_note())

    def capabilities(self) -> Capabilities:
        """A guest kernel of its own: pause/resume by memory snapshot, fork, PTYs, state."""
        try:
            note = self._vmm_note()
        except DsecError as exc:
            note = f"no VMM: {exc.message}"
        return Capabilities(
            pause=True,
            fork=True,
            snapshot=True,
            pty=True,
            persistent_processes=True,
            persistent_filesystem=True,
            network_policy=self.network is not None,
            max_vcpus=float(os.cpu_count() or 1),
            notes=f"{note}"
            + ("" if self.network is not None else "; no sandbox networking on this edge"),
        )

    def kernel(self) -> Path | None:
        if self.kernel_image is not None:
            return self.kernel_image if self.kernel_image.exists() else None
        return kernel.current_kernel(self.paths.data)

    def layout(self) -> cgroups.CgroupLayout:
        if self._layout is None:
            self._layout = cgroups.detect()
        return self._layout

    def release_host_setup(self) -> None:
        with contextlib.suppress(OSError, DsecError):
            cgroups.remove_if_empty(self.layout(), "/" + self.cgroup_parent)

    # --- paths -------------------------------------------------------------------------

    def run_dir(self, sandbox_id: str) -> Path:
        return self.paths.run / "vm" / sandbox_id

    def mem_file(self, sandbox_id: str, gen: str = "") -> Path:
        return self.mem_dir / f"{sandbox_id}{gen}.mem"

    def cgroup_path(self, sandbox_id: str) -> str:
        return f"/{self.cgroup_parent}/{sandbox_id}"

    # --- create ------------------------------------------------------------------------

    async def create(self, sandbox_id: str, spec: SandboxSpec, paths: SandboxPaths) -> Started:
        """Boot a microVM for the sandbox; on failure leave nothing behind.

        Raises:
            InvalidArgument: malformed id, or network rules without sandbox networking.
            ImageNotFound: the image is not in the store.
            BackendUnavailable: no QEMU or no guest kernel on this node.
            SandboxFailed / DeadlineExceeded: the guest did not come up (console attached).
        """
        _check_id(sandbox_id)
        if self.network is None and (spec.network.allow or spec.network.deny):
            raise InvalidArgument(
                f"{self.name} sandboxes on this edge have no network: network rules refused"
            )
        vm = self._vms.get(sandbox_id)
        if vm is not None and vm.vmm.alive():
            return Started(pid=vm.keeper)
        kern = self.kernel()
        if kern is None:
            raise BackendUnavailable("no guest kernel on this node: run `dsec setup`")
        image = self._image(spec)
        if paths.state_dir.exists():
            await self.destroy(sandbox_id, paths)
        try:
            shared = await asyncio.to_thread(self._shared_images, image.layer_dirs)
            env = _guest_env(sandbox_id, image.env, spec.env)
            net: dict[str, str] = {}
            if self.network is not None:
                sn = await self.network.create(sandbox_id, spec.network, tap=True)
                net = {"netns": str(sn.netns), "tap": sn.tap, "mac": sn.guest_mac(),
                       "ip": sn.kernel_ip_arg(), "resolv_conf": sn.resolv_conf()}  # fmt: skip
            await asyncio.to_thread(
                self._prepare_state,
                sandbox_id,
                paths,
                spec,
                shared,
                kern,
                env,
                len(image.layer_dirs),
                net,
            )
            meta = _load_meta(paths.state_dir)
            config = self._config(sandbox_id, paths, meta)
            vm = _Vm(vmm=choice.new_vmm(_vmm_of(meta)))
            self._vms[sandbox_id] = vm
            await asyncio.to_thread(self._make_cgroup, sandbox_id, spec)
            vm.keeper = await asyncio.to_thread(_start_keeper, paths.state_dir)
            boot_s = self.boot_timeout_s or BOOT_TIMEOUT_S
            await vm.vmm.boot(config, boot_s)
            await self._attach(sandbox_id, vm, paths, vm.vmm.link(config), boot_s)
        except BaseException as exc:
            await asyncio.shield(self._rollback(sandbox_id, paths))
            if isinstance(exc, DsecError | asyncio.CancelledError):
                raise
            if isinstance(exc, OSError | ValueError):
                raise SandboxFailed(f"creating microVM {sandbox_id} failed: {exc}") from exc
            raise
        log(_log, "microvm started", sandbox_id=sandbox_id, vmm=vm.vmm.name, pid=vm.vmm.pid,
            edge=self.edge_id)  # fmt: skip
        return Started(pid=vm.keeper)

    def _image(self, spec: SandboxSpec) -> Image:
        return self.images.resolve(spec.image)

    def _shared_images(self, layer_dirs: tuple[Path, ...]) -> dict[str, str]:
        out = {
            "bundle": str(disks.bundle_image(self.paths.agent_bundle, self.vm_dir)),
            "initrd": str(disks.initramfs(self.vm_dir)),
            "scratch_base": str(disks.scratch_base(self.vm_dir)),
        }
        for i, d in enumerate(reversed(layer_dirs)):  # bottom first
            out[f"l{i}"] = str(disks.layer_image(d))
        return out

    def _prepare_state(
        self,
        sandbox_id: str,
        paths: SandboxPaths,
        spec: SandboxSpec,
        shared: dict[str, str],
        kern: Path,
        env: dict[str, str],
        layers: int,
        net: dict[str, str],
    ) -> None:
        sd = paths.state_dir
        sd.mkdir(parents=True, exist_ok=True)
        vmm = self.vmm_choice()[0]
        _writable_disk(Path(shared["scratch_base"]), sd / _scratch(vmm), "raw", vmm)
        env = {
            **env,
            **({"dsec.resolv_conf": net["resolv_conf"]} if net else {}),
            "dsec.layers": str(layers),
            "dsec.machine_id": secrets.token_hex(16),
            "dsec.seed": secrets.token_hex(32),
        }
        disks.write_config(sd / "config.img", env)
        meta = {
            "vcpus": max(1, round(spec.cpu)),
            "memory_mib": spec.memory_mb,
            "kernel": str(kern),
            "shared": shared,
            "layers": layers,
            "agent_socket": str(paths.agent_socket),
            "mem_gen": "",
            "shared_ram": True,
            "vmm": vmm,
            "net": net,
        }
        _save_meta(sd, meta)

    def _config(self, sandbox_id: str, paths: SandboxPaths, meta: dict[str, Any]) -> VmConfig:
        sd = paths.state_dir
        shared = meta["shared"]
        drives = [
            Drive("config", sd / "config.img", read_only=True),
            Drive("bundle", Path(shared["bundle"]), read_only=True),
            *(Drive(f"l{i}", Path(shared[f"l{i}"]), read_only=True) for i in range(meta["layers"])),
            Drive("scratch", sd / _scratch(_vmm_of(meta)), read_only=False),
        ]
        run = self.run_dir(sandbox_id)
        driver = choice.new_vmm(_vmm_of(meta))
        config = VmConfig(
            vcpus=meta["vcpus"],
            memory_mib=meta["memory_mib"],
            kernel=Path(meta["kernel"]),
            cmdline=driver.cmdline("quiet"),
            run_dir=run,
            mem_file=self.mem_file(sandbox_id, meta.get("mem_gen", "")),
            drives=tuple(drives),
            agent_socket=driver.channel_socket(run),
            extra={"initrd": shared["initrd"], "cgroups": ":".join(self._cgroup_dirs(sandbox_id))},
        )
        return _with_net(config, meta.get("net") or {})

    def _cgroup_dirs(self, sandbox_id: str, memory: str | None = None) -> list[str]:
        """The VM's cgroup directories (one per hierarchy); ``memory``: another memory
        cgroup instead of the VM's (last, so it wins where all share one hierarchy)."""
        lay = self.layout()
        seen: dict[str, str] = {}
        for ctl in ("cpu", "pids", "memory"):
            d = lay.controller_dir(ctl, memory if memory and ctl == "memory" else
                                   self.cgroup_path(sandbox_id))  # fmt: skip
            if d is not None:
                seen.setdefault(os.path.realpath(d), str(d))
        return list(seen.values())

    def _make_cgroup(self, sandbox_id: str, spec: SandboxSpec) -> None:
        lay = self.layout()
        cg = self.cgroup_path(sandbox_id)
        for d in self._cgroup_dirs(sandbox_id):
            Path(d).mkdir(parents=True, exist_ok=True)
        limit = (spec.memory_mb + VMM_OVERHEAD_MIB) << 20
        quota = max(1000, round(spec.cpu * 100_000))
        mem = lay.controller_dir("memory", cg)
        cpu = lay.controller_dir("cpu", cg)
        if mem is not None:
            if (mem / "memory.max").exists():
                (mem / "memory.max").write_text(str(limit))
            else:
                (mem / "memory.limit_in_bytes").write_text(str(limit))
        if cpu is not None:
            if (cpu / "cpu.max").exists():
                (cpu / "cpu.max").write_text(f"{quota} 100000")
            else:
                (cpu / "cpu.cfs_quota_us").write_text(str(quota))

    @contextlib.asynccontextmanager
    async def _charged_to_templates(self, sandbox_id: str, vmm: Vmm) -> AsyncIterator[None]:
        """While a VMM whose RAM is mapped copy-on-write from a template writes a snapshot,
        it runs in the edge's template memory cgroup: reading all guest RAM fills the
        holes of that template's tmpfs file, and the state stream's page cache is written,
        and neither is the VM's memory (charged to the VM, they counted the template's RAM
        against its limit). A VMM that owns its RAM file stays where it is."""
        if vmm.shared_ram or vmm.pid <= 0:
            yield
            return
        pid = vmm.pid
        tpl = f"/{self.cgroup_parent}/vm-templates"
        try:
            moved = await asyncio.to_thread(self._move_memory_cgroup, pid, tpl)
        except OSError as exc:  # accounting only: the snapshot goes on where QEMU is
            log(_log, "template cgroup refused the VMM", logging.WARNING, sandbox_id=sandbox_id,
                error=str(exc))  # fmt: skip
            moved = False
        try:
            yield
        finally:
            if moved:
                if vmm.alive():
                    with contextlib.suppress(OSError):
                        await asyncio.to_thread(
                            self._move_memory_cgroup, pid, self.cgroup_path(sandbox_id)
                        )
                with contextlib.suppress(OSError, DsecError):
                    await asyncio.to_thread(cgroups.remove_if_empty, self.layout(), tpl)

    async def _own_ram(self, sandbox_id: str, vm: _Vm, meta: dict[str, Any]) -> None:
        """Before a snapshot of a QEMU whose RAM is copy-on-write from a template (a fork
        child, or a parent since it forked): move the guest onto a RAM file of its own, so
        the snapshot skips the RAM as the first fork's did instead of writing all of it into
        the state stream (see ``QemuVmm.own_ram``); records the file in ``meta``. Both QEMUs
        run in the edge's template memory cgroup meanwhile: reading all guest RAM fills the
        template's holes and, until they are punched again, the new file's, which would
        count twice against the VM's limit (the new file's pages stay charged there).
        Called with ``vm.lock`` held and the mux detached; the guest is left stopped."""
        if vm.vmm.shared_ram or not vm.vmm.alive():
            return
        sd = self.sandboxes_dir / sandbox_id
        gen = f".{secrets.token_hex(3)}"
        paths = SandboxPaths(state_dir=sd, agent_socket=Path(meta["agent_socket"]))
        config = self._config(sandbox_id, paths, {**meta, "mem_gen": gen})
        tpl = f"/{self.cgroup_parent}/vm-templates"
        try:
            moved = await asyncio.to_thread(self._move_memory_cgroup, vm.vmm.pid, tpl)
        except OSError as exc:  # accounting only: the move goes on where QEMU is
            log(_log, "template cgroup refused the VMM", logging.WARNING, sandbox_id=sandbox_id,
                error=str(exc))  # fmt: skip
            moved = False
        cgs = ":".join(self._cgroup_dirs(sandbox_id, tpl if moved else None))
        config = replace(config, extra={**config.extra, "cgroups": cgs})
        # A named snapshot's RAM file keeps its stamp (else every sandbox started from it
        # would hash it again): only zero pages the move filled are punched in it.
        named = self._ram_snapshot(meta)
        fresh = named is not None and await asyncio.to_thread(snapshots.ram_unchanged, named)
        try:
            phases = await vm.vmm.own_ram(config, RESTORE_TIMEOUT_S)
            if named is not None and fresh:
                await asyncio.to_thread(snapshots.restamp_ram, named)
        finally:
            if moved:
                if vm.vmm.alive():
                    with contextlib.suppress(OSError):
                        await asyncio.to_thread(
                            self._move_memory_cgroup, vm.vmm.pid, self.cgroup_path(sandbox_id)
                        )
                with contextlib.suppress(OSError, DsecError):
                    await asyncio.to_thread(cgroups.remove_if_empty, self.layout(), tpl)
        if phases is None:
            return
        meta["mem_gen"], meta["shared_ram"] = gen, True
        old = meta.pop("ram_template", None)
        await asyncio.to_thread(_save_meta, sd, meta)
        if old:
            await asyncio.to_thread(self._drop_unused_ram, [old])
        log(_log, "microvm has its own RAM file", logging.INFO, sandbox_id=sandbox_id, **phases)

    def _ram_snapshot(self, meta: dict[str, Any]) -> Snapshot | None:
        """The named snapshot whose RAM file a VM maps copy-on-write, if it does."""
        tid = meta.get("ram_template")
        if meta.get("shared_ram", True) or not tid:
            return None
        with contextlib.suppress(DsecError):
            return self._named(str(tid))
        return None

    def _move_memory_cgroup(self, pid: int, cgroup_path: str) -> bool:
        """Put ``pid`` (all its threads) in ``cgroup_path``'s memory cgroup (made if need
        be); False when this host has no memory controller."""
        d = self.layout().controller_dir("memory", cgroup_path)
        if d is None:
            return False
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text(str(pid))
        return True

    async def _sync_guest(self, meta: dict[str, Any]) -> None:
        """Have the guest write out its dirty file data and commit its journals before a
        snapshot stops it. Otherwise every guest restored from the snapshot (each fork
        child again) does it after its restore: the ext4 journal commit and the block
        layer run in code translated again under TCG, ~1,500 blocks (~20 ms) of the first
        call. It waits for aether to close the call's connection too, so its thread is not
        still ending (socket teardown, the interpreter's part) when the guest is stopped:
        ~800 blocks more after each restore. Best effort: a guest that does not answer in
        time (``GUEST_SYNC_TIMEOUT_S``) is snapshotted as it is."""
        sock = Path(meta["agent_socket"])
        with contextlib.suppress(
            DsecError, OSError, ProtocolError, asyncio.IncompleteReadError, TimeoutError
        ):
            async with asyncio.timeout(GUEST_SYNC_TIMEOUT_S):
                stream = await agent_client.open_stream(sock, {"op": "sync"}, connect_retry_s=0)
                try:
                    async for _ in stream:
                        pass
                    await stream.until_closed()
                finally:
                    await stream.aclose()

    async def _attach(
        self,
        sandbox_id: str,
        vm: _Vm,
        paths: SandboxPaths,
        link: GuestLink,
        timeout_s: float,
        identity: dict[str, Any] | None = None,
    ) -> None:
        """Start the agent mux (unless a restore started it already) and wait for the
        guest's end; watch the VMM from now on."""
        if vm.mux is None:
            vm.mux = HostMux(paths.agent_socket, link, identity)
        if not vm.mux.started:
            await vm.mux.start()
        await watched(vm.vmm, vm.mux.wait_ready(timeout_s + 1), timeout_s)
        vm.expected_exit = False
        vm.watch = asyncio.create_task(self._watch_vmm(sandbox_id, vm))

    async def _watch_vmm(self, sandbox_id: str, vm: _Vm) -> None:
        """When the VMM exits on its own, end the keeper: the edge sees the sandbox die."""
        await _wait_exit(vm.vmm.pid)
        if not vm.expected_exit:
            panic = vm.vmm.panicked()
            log(_log, "microvm exited", logging.WARNING, sandbox_id=sandbox_id, panic=panic or "")
            await asyncio.to_thread(_kill_pid, vm.keeper)

    async def _detach(self, vm: _Vm) -> None:
        vm.expected_exit = True
        if vm.watch is not None:
            vm.watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await vm.watch
            vm.watch = None
        if vm.mux is not None:
            await vm.mux.close()
            vm.mux = None

    async def _rollback(self, sandbox_id: str, paths: SandboxPaths) -> None:
        try:
            await self.destroy(sandbox_id, paths)
        except DsecError as exc:
            log(_log, "rollback left state", logging.WARNING, sandbox_id=sandbox_id, err=str(exc))

    # --- state, re-adoption ------------------------------------------------------------

    def _paths(self, sandbox_id: str) -> SandboxPaths:
        sd = self.sandboxes_dir / sandbox_id
        meta = _load_meta(sd)
        return SandboxPaths(state_dir=sd, agent_socket=Path(meta["agent_socket"]))

    async def _vm(self, sandbox_id: str) -> _Vm | None:
        """The live VM record, re-attaching after an edge restart (QMP + a new mux)."""
        vm = self._vms.get(sandbox_id)
        if vm is not None:
            return vm
        sd = self.sandboxes_dir / sandbox_id
        try:
            meta = await asyncio.to_thread(_load_meta, sd)
            keeper = await asyncio.to_thread(_read_keeper, sd)
        except (OSError, ValueError, KeyError):
            return None
        if keeper <= 0:
            return None
        vm = _Vm(vmm=choice.new_vmm(_vmm_of(meta)), keeper=keeper)
        if meta.get("paused"):
            self._vms[sandbox_id] = vm
            return vm
        mem = self.mem_file(sandbox_id, meta.get("mem_gen", ""))
        if not meta.get("shared_ram", True) and meta.get("ram_template"):
            mem = self.mem_dir / f"tpl-{meta['ram_template']}.mem"  # mapped copy-on-write
        if not await vm.vmm.adopt(self.run_dir(sandbox_id), mem, meta.get("shared_ram", True)):
            await asyncio.to_thread(_kill_pid, keeper)
            return None
        self._vms[sandbox_id] = vm
        paths = SandboxPaths(state_dir=sd, agent_socket=Path(meta["agent_socket"]))
        try:
            link = vm.vmm.link(self._config(sandbox_id, paths, meta))
            await self._attach(sandbox_id, vm, paths, link, 10)
        except (DsecError, OSError, TimeoutError) as exc:
            log(_log, "microvm re-adoption failed", logging.WARNING, sandbox_id=sandbox_id,
                error=str(exc))  # fmt: skip
        return vm

    async def state(self, sandbox_id: str) -> tuple[RuntimeState, int]:
        if not SANDBOX_NAME_RE.match(sandbox_id):
            return RuntimeState.MISSING, 0
        vm = await self._vm(sandbox_id)
        if vm is None:
            return RuntimeState.MISSING, 0
        if not _alive(vm.keeper):
            return RuntimeState.STOPPED, 0
        meta = await asyncio.to_thread(_load_meta, self.sandboxes_dir / sandbox_id)
        if meta.get("paused"):
            return RuntimeState.PAUSED, vm.keeper
        if not vm.vmm.alive():
            return RuntimeState.STOPPED, 0
        return RuntimeState.RUNNING, vm.keeper

    # --- pause / resume (snapshot to disk, VMM freed) ----------------------------------

    async def pause(self, sandbox_id: str) -> None:
        """Snapshot the guest and quit its VMM (idempotent)."""
        vm = await self._need(sandbox_id)
        async with vm.lock:
            sd = self.sandboxes_dir / sandbox_id
            meta = await asyncio.to_thread(_load_meta, sd)
            if meta.get("paused"):
                return
            if not vm.vmm.alive():
                raise InvalidState(f"microVM {sandbox_id} is not running")
            await self._sync_guest(meta)
            await self._detach(vm)
            try:
                await self._own_ram(sandbox_id, vm, meta)
            except BaseException:
                await self._go_on(sandbox_id, vm, meta)
                raise
            dest = sd / "snapshots" / "current"
            await asyncio.to_thread(disks.remove, dest)
            snap = await vm.vmm.snapshot(dest)
            await vm.vmm.kill()
            await asyncio.to_thread(snapshots.write_manifest, snap)
            meta["paused"] = True
            await asyncio.to_thread(_save_meta, sd, meta)
            log(_log, "microvm paused", sandbox_id=sandbox_id)

    async def _go_on(self, sandbox_id: str, vm: _Vm, meta: dict[str, Any]) -> None:
        """Let a guest stopped for a snapshot that did not happen run on (mux attached)."""
        if not vm.vmm.alive():
            return
        with contextlib.suppress(DsecError, OSError, TimeoutError):
            await vm.vmm.resume()
            sd = self.sandboxes_dir / sandbox_id
            paths = SandboxPaths(state_dir=sd, agent_socket=Path(meta["agent_socket"]))
            link = vm.vmm.link(self._config(sandbox_id, paths, meta))
            await self._attach(sandbox_id, vm, paths, link, RESTORE_TIMEOUT_S)

    async def resume(self, sandbox_id: str) -> None:
        """Restore the paused guest from its snapshot (verified by digest first)."""
        vm = await self._need(sandbox_id)
        async with vm.lock:
            sd = self.sandboxes_dir / sandbox_id
            meta = await asyncio.to_thread(_load_meta, sd)
            if not meta.get("paused"):
                if vm.vmm.alive():
                    return
                raise InvalidState(f"microVM {sandbox_id} is not paused")
            dest = sd / "snapshots" / "current"
            paths = SandboxPaths(state_dir=sd, agent_socket=Path(meta["agent_socket"]))
            config = self._config(sandbox_id, paths, meta)
            snap = vm.vmm.saved_snapshot(dest, config.mem_file)
            phases = await self._restore(sandbox_id, vm, paths, config, snap, private=False)
            meta["paused"] = False
            meta["shared_ram"] = vm.vmm.shared_ram
            if vm.vmm.shared_ram:
                meta.pop("ram_template", None)
            await asyncio.to_thread(_save_meta, sd, meta, drop=dest)  # one hop, not two
            log(_log, "microvm resumed", logging.INFO, sandbox_id=sandbox_id, **phases)

    async def _restore(
        self,
        sandbox_id: str,
        vm: _Vm,
        paths: SandboxPaths,
        config: VmConfig,
        snap: Snapshot,
        *,
        private: bool,
        identity: dict[str, Any] | None = None,
        verified: bool = False,
        timeout_s: float = RESTORE_TIMEOUT_S,
    ) -> dict[str, float]:
        """Start the VMM on the snapshot while its digests are checked; refuse a bad one.

        ``verified``: the caller made this snapshot itself just now. Returns how long each
        phase took (ms): ``check_ms`` (the manifest check, beside the VMM's start),
        ``vmm_ms`` (VMM started and its state loaded: the guest runs, or under QEMU
        starts the moment the load ends), ``agent_ms`` (until the guest's multiplexer
        answered). The agent mux is started before the state is loaded (``on_listening``),
        so its link and HELLO wait in the channel when the guest runs."""
        phases = {"check_ms": 0.0}

        def check() -> None:
            t = time.perf_counter()
            _check_snapshot(snap, private)
            phases["check_ms"] = _ms(t)

        t0 = time.perf_counter()
        link = vm.vmm.link(config)
        vm.mux = HostMux(paths.agent_socket, link, identity)
        try:
            await vm.vmm.restore(
                config,
                snap,
                private=private,
                timeout_s=timeout_s,
                check=None if verified else check,
                on_listening=vm.mux.start,
            )
            phases["vmm_ms"] = _ms(t0)
            t1 = time.perf_counter()
            await self._attach(sandbox_id, vm, paths, link, timeout_s, identity)
            phases["agent_ms"] = _ms(t1)
            return phases
        except BaseException:
            await self._detach(vm)
            await vm.vmm.kill()
            raise

    # --- fork --------------------------------------------------------------------------

    async def fork(
        self, sandbox_id: str, children: list[tuple[str, SandboxPaths]]
    ) -> list[Started]:
        """Start ``children`` (id, paths) from a snapshot of the running ``sandbox_id``.

        The parent's RAM file becomes a frozen template; the parent and every child map it
        privately (copy-on-write), so clean pages are shared between all of them.
        """
        if not 1 <= len(children) <= MAX_FORK:
            raise InvalidArgument(f"fork count must be 1..{MAX_FORK}")
        for cid, _ in children:
            _check_id(cid)
        vm = await self._need(sandbox_id)
        async with vm.lock:
            tid = f"{sandbox_id}-{secrets.token_hex(4)}"
            paths, meta, tsnap = await self._make_template(sandbox_id, vm, tid)
            # The parent and every child start from the template at the same time; they
            # share the host's cores, so each may take that many times a lone restore.
            wait = RESTORE_TIMEOUT_S * max(1.0, (len(children) + 1) / (os.cpu_count() or 1))
            results = await asyncio.gather(
                self._fork_parent(sandbox_id, vm, paths, meta, tsnap, wait),
                *(self._fork_child(sandbox_id, meta, tsnap, cid, cp, timeout_s=wait)
                  for cid, cp in children),
                return_exceptions=True,
            )  # fmt: skip
        if isinstance(results[0], BaseException):
            for (cid, cp), r in zip(children, results[1:], strict=True):
                if not isinstance(r, BaseException):
                    await self.destroy(cid, cp)
            raise results[0]
        results = results[1:]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for (cid, cp), r in zip(children, results, strict=True):
                if not isinstance(r, BaseException):
                    await self.destroy(cid, cp)
            raise errors[0]
        return [r for r in results if isinstance(r, Started)]

    async def _make_template(
        self, sandbox_id: str, vm: _Vm, tid: str
    ) -> tuple[SandboxPaths, dict[str, Any], Snapshot]:
        """Snapshot the running ``sandbox_id`` into template ``tid`` (RAM file, device state,
        its disk as it was, config disk, manifest, the parent's settings) and quit its QEMU;
        the caller restarts the parent from it. Called with ``vm.lock`` held."""
        sd = self.sandboxes_dir / sandbox_id
        meta = await asyncio.to_thread(_load_meta, sd)
        if meta.get("paused") or not vm.vmm.alive():
            raise InvalidState(f"microVM {sandbox_id} is not running: cannot snapshot or fork it")
        _refuse_networked(meta, "fork")
        tdir = self.templates_dir / tid
        # Recorded first: whatever happens next, destroying the parent removes it.
        meta["templates"] = [*meta.get("templates", []), tid]
        await asyncio.to_thread(_save_meta, sd, meta)
        paths = SandboxPaths(state_dir=sd, agent_socket=Path(meta["agent_socket"]))
        try:
            await self._sync_guest(meta)
            await self._detach(vm)
            await self._own_ram(sandbox_id, vm, meta)
            async with self._charged_to_templates(sandbox_id, vm.vmm):
                snap = await vm.vmm.snapshot(tdir)
            await vm.vmm.kill()
            await asyncio.to_thread(_settle, snap.state)
            frozen_mem = self.mem_dir / f"tpl-{tid}.mem"
            # RAM mapped privately from an older template went into the state stream: that
            # template's file stays its own, this one gets an empty RAM file.
            ram = snap.mem_file if snap.ram_in_file else None
            scratch = _scratch(_vmm_of(meta))
            await asyncio.to_thread(_freeze, ram, frozen_mem, sd, tdir, scratch)
            tsnap = replace(snap, dir=tdir, mem_file=frozen_mem)
            # Used at once by the parent and children restored from it (not re-checked):
            # sizes and stamps, no digests to compute while they wait.
            await asyncio.to_thread(snapshots.write_manifest, tsnap, digests=False)
            # The parent goes on from the template too (its own disk overlay on top).
            await asyncio.to_thread(
                _writable_disk, tdir / scratch, sd / scratch, "qcow2", _vmm_of(meta)
            )
        except BaseException:
            await vm.vmm.kill()
            await asyncio.to_thread(_kill_pid, vm.keeper)  # the edge sees the parent die
            raise
        meta["mem_gen"] = f".{secrets.token_hex(3)}"
        meta["shared_ram"] = False
        meta["ram_template"] = tid  # the RAM file it maps copy-on-write from now on
        await asyncio.to_thread(_save_meta, sd, meta)
        await asyncio.to_thread(_save_meta, tdir, meta)  # what a sandbox made from it gets
        return paths, meta, tsnap

    async def _fork_parent(
        self,
        sandbox_id: str,
        vm: _Vm,
        paths: SandboxPaths,
        meta: dict[str, Any],
        tsnap: Snapshot,
        timeout_s: float,
    ) -> None:
        try:
            config = self._config(sandbox_id, paths, meta)
            await self._restore(sandbox_id, vm, paths, config, tsnap, private=True, verified=True,
                                timeout_s=timeout_s)  # fmt: skip
        except BaseException:
            await asyncio.to_thread(_kill_pid, vm.keeper)  # the edge sees the parent die
            raise

    async def _fork_child(
        self,
        parent: str,
        pmeta: dict[str, Any],
        tsnap: Snapshot,
        cid: str,
        cp: SandboxPaths,
        *,
        verified: bool = True,
        timeout_s: float = RESTORE_TIMEOUT_S,
    ) -> Started:
        vm = _Vm(vmm=choice.new_vmm(_vmm_of(pmeta)))
        self._vms[cid] = vm
        try:
            meta = {**pmeta, "agent_socket": str(cp.agent_socket), "mem_gen": "",
                    "parent": parent, "shared_ram": False,
                    "ram_template": tsnap.dir.name}  # fmt: skip
            # one thread hop for the child's files, cgroup and keeper: many children start
            # at once and the default executor has few threads
            vm.keeper = await asyncio.to_thread(self._prepare_child, cid, cp.state_dir, tsnap, meta)
            config = self._config(cid, cp, meta)
            ident = {
                "hostname": cid,
                "machine_id": secrets.token_hex(16),
                "seed": secrets.token_hex(32),
            }
            await self._restore(
                cid, vm, cp, config, tsnap, private=True, identity=ident, verified=verified,
                timeout_s=timeout_s,
            )  # fmt: skip
        except BaseException:
            await asyncio.shield(self._rollback(cid, cp))
            raise
        return Started(pid=vm.keeper)

    # --- named snapshots ---------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, snapshot_id: str) -> int:
        """Take named snapshot ``snapshot_id`` of the running ``sandbox_id``: the guest stops
        while its device state is written and its RAM file and disk are copied, then goes on
        in the same QEMU. The snapshot is a template pinned until :meth:`delete_snapshot`.
        Returns its size in bytes."""
        _check_id(snapshot_id)
        vm = await self._need(sandbox_id)
        async with vm.lock:
            sd = self.sandboxes_dir / sandbox_id
            meta = await asyncio.to_thread(_load_meta, sd)
            if meta.get("paused") or not vm.vmm.alive():
                raise InvalidState(f"microVM {sandbox_id} is not running: cannot snapshot it")
            _refuse_networked(meta, "snapshot")
            tdir = self.templates_dir / snapshot_id
            tmem = self.mem_dir / f"tpl-{snapshot_id}.mem"
            # Sandboxes made from it keep it and the templates its disk stands on.
            tmeta = {**meta, "templates": [*meta.get("templates", []), snapshot_id]}
            moving = not vm.vmm.shared_ram  # onto a RAM file of its own: another QEMU
            await self._sync_guest(meta)
            try:
                try:
                    if moving:
                        await self._detach(vm)
                        await self._own_ram(sandbox_id, vm, meta)
                    async with self._charged_to_templates(sandbox_id, vm.vmm):
                        snap = await vm.vmm.snapshot(tdir)  # stops the guest
                    await asyncio.to_thread(
                        _copy_template, snap, tmem, sd, tdir, _scratch(_vmm_of(meta))
                    )
                finally:
                    if moving:
                        await self._go_on(sandbox_id, vm, meta)
                    elif vm.vmm.alive():
                        await vm.vmm.resume()
                tsnap = replace(snap, mem_file=tmem)
                await asyncio.to_thread(snapshots.write_manifest, tsnap)
                await asyncio.to_thread(_save_meta, tdir, tmeta)
                await asyncio.to_thread((tdir / PINNED).write_text, sandbox_id)
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, tdir, True)
                tmem.unlink(missing_ok=True)
                raise
        log(_log, "microvm snapshot taken", sandbox_id=sandbox_id, snapshot_id=snapshot_id)
        return await asyncio.to_thread(_tree_bytes, tdir, tmem)

    async def create_from_snapshot(
        self, snapshot_id: str, sandbox_id: str, paths: SandboxPaths
    ) -> Started:
        """Start ``sandbox_id`` from named snapshot ``snapshot_id`` (refused unless every
        file matches its manifest); its RAM is mapped copy-on-write, as a fork child's."""
        _check_id(sandbox_id)
        tsnap = self._named(snapshot_id)
        try:
            meta = await asyncio.to_thread(_load_meta, tsnap.dir)
        except (OSError, ValueError) as exc:
            raise snapshots.SnapshotCorrupt(f"snapshot {snapshot_id} has no settings") from exc
        parent = (tsnap.dir / PINNED).read_text().strip()
        return await self._fork_child(parent, meta, tsnap, sandbox_id, paths, verified=False)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Unpin ``snapshot_id``; its files go once no sandbox started from it remains."""
        tsnap = self._named(snapshot_id)
        try:  # it and the templates its disk stands on
            chain = (await asyncio.to_thread(_load_meta, tsnap.dir)).get("templates", [])
        except (OSError, ValueError):
            chain = []
        (tsnap.dir / PINNED).unlink(missing_ok=True)
        await asyncio.to_thread(self._drop_unused_templates, [*chain, snapshot_id])

    # --- copying a named snapshot to another edge (see snapshot_copy) -------------------

    def export_snapshot(self, snapshot_id: str) -> snapshot_copy.Export:
        """The transfer manifest of ``snapshot_id`` and its files' paths (blocking)."""
        tsnap = self._named(snapshot_id)
        try:
            meta = _load_meta(tsnap.dir)
        except (OSError, ValueError) as exc:
            raise snapshots.SnapshotCorrupt(f"snapshot {snapshot_id} has no settings") from exc
        snapshot_copy.load_digests(self._digest_cache)
        exp = snapshot_copy.export_manifest(tsnap.dir, tsnap.mem_file, self.templates_dir, meta)
        bases = [p for n, p in exp.paths.items() if n.startswith("base/")]
        snapshot_copy.save_digests(self._digest_cache, bases)
        return exp

    @property
    def _digest_cache(self) -> Path:
        """Digests of the shared base files, kept across edge restarts."""
        return self.sandboxes_dir.parent / "vm-digests.json"

    def export_paused(self, sandbox_id: str) -> snapshot_copy.Export:
        """The transfer manifest of paused ``sandbox_id``'s pause snapshot (its RAM file,
        device state, config disk and disk layer, all still while it is paused), to start
        it on another edge (blocking)."""
        sd = self.sandboxes_dir / sandbox_id
        try:
            meta = _load_meta(sd)
        except (OSError, ValueError) as exc:
            raise SandboxNotFound(f"no microVM for sandbox {sandbox_id}") from exc
        if not meta.get("paused"):
            raise InvalidState(f"microVM {sandbox_id} is not paused")
        if _vmm_of(meta) != "qemu":
            raise InvalidArgument("only QEMU microVMs can be moved to another edge")
        cur = sd / "snapshots" / "current"
        if not (cur / snapshots.MANIFEST).exists():
            raise SnapshotNotFound(
                f"the pause snapshot of {sandbox_id} is gone: it can only be killed"
            )
        mem = self.mem_file(sandbox_id, meta.get("mem_gen", ""))
        snap = choice.new_vmm("qemu").saved_snapshot(cur, mem)
        if not snap.ram_in_file:  # the RAM is in the state stream: send an empty file
            mem = cur / "ram.empty"
            mem.touch()
        snapshot_copy.load_digests(self._digest_cache)
        exp = snapshot_copy.export_manifest(cur, mem, self.templates_dir, meta, disk_dir=sd)
        bases = [p for n, p in exp.paths.items() if n.startswith("base/")]
        snapshot_copy.save_digests(self._digest_cache, bases)
        return exp

    @property
    def snapshot_cache(self) -> SnapshotCache:
        """Snapshot files taken in from other edges, kept for the next copy."""
        cache_dir = self.sandboxes_dir.parent / "vm-cache"
        return SnapshotCache(cache_dir, self.mem_dir, snapshot_cache.max_bytes_from_env())

    def drop_copies(self, source_snapshot: str) -> int:
        """Forget the cached files of ``source_snapshot`` (deleted on its edge)."""
        return self.snapshot_cache.drop_source(source_snapshot)

    def snapshot_importer(
        self, copy_id: str, manifest: dict[str, Any], image: str, *, source: str = "",
        keep: bool = True,
    ) -> snapshot_copy.Importer:  # fmt: skip
        """An importer of ``manifest`` as snapshot ``copy_id``, its wanted files decided
        (blocking: hashes candidate files). ``source``: the snapshot it copies; ``keep``:
        cache what is received for the next copy of it."""
        _check_id(copy_id)
        if (self.templates_dir / copy_id).exists():
            raise InvalidArgument(f"snapshot {copy_id} already exists on this edge")
        self._sweep_imports()
        snapshot_copy.load_digests(self._digest_cache)
        imp = snapshot_copy.Importer(
            copy_id=copy_id,
            manifest=manifest,
            templates_dir=self.templates_dir,
            mem_dir=self.mem_dir,
            bases_dir=self.sandboxes_dir.parent / "vm-bases",
            local_bases=self._local_bases(image),
            cache=self.snapshot_cache,
            keep=keep,
            source=source,
        )
        imp.plan()
        _IMPORTS.add(imp)
        have = [p for n, p in imp.resolved.items() if n.startswith("base/")]
        snapshot_copy.save_digests(self._digest_cache, have)
        return imp

    def _local_bases(self, image: str) -> dict[str, Path]:
        """This edge's own kernel, bundle, initramfs, scratch base and (when the image is
        here) layer images: what a copied snapshot's files may match by digest."""
        out: dict[str, Path] = {}
        kern = self.kernel()
        if kern is not None:
            out["kernel"] = kern
        with contextlib.suppress(DsecError, OSError):
            layers = self._image(SandboxSpec(image=image)).layer_dirs if image else ()
            out.update({k: Path(v) for k, v in self._shared_images(layers).items()})
        return out

    def _sweep_imports(self) -> None:
        """Remove staging files of imports no longer running here (an edge that died while
        taking a snapshot in leaves them): only this process imports into these dirs."""
        live = {i.copy_id for i in list(_IMPORTS)}  # list(): one step under the GIL
        for d in (self.templates_dir, self.mem_dir):
            for p in d.glob(".import-*") if d.exists() else ():
                if p.name.removeprefix(".import-").removesuffix(".mem") not in live:
                    snapshot_copy.remove(p)

    def import_commit(self, imp: snapshot_copy.Importer, source_sandbox: str) -> int:
        """Verify and move in what ``imp`` received; returns the copy's size in bytes. On
        failure nothing of it stays."""
        try:
            tdir, tmem = imp.commit(source_sandbox, source_sandbox)
            snapshots.restamp(Snapshot(dir=tdir, mem_file=tmem, state=tdir / "state"))
            _IMPORTS.discard(imp)
            return _tree_bytes(tdir, tmem)
        except BaseException:
            self.import_abort(imp)
            raise

    def import_abort(self, imp: snapshot_copy.Importer) -> None:
        _IMPORTS.discard(imp)
        imp.abort(self._drop_unused_templates)

    def _named(self, snapshot_id: str) -> Snapshot:
        tdir = self.templates_dir / snapshot_id
        if not SANDBOX_NAME_RE.match(snapshot_id) or not (tdir / PINNED).exists():
            raise SnapshotNotFound(f"no microVM snapshot {snapshot_id} on edge {self.edge_id}")
        return Snapshot(dir=tdir, mem_file=self.mem_dir / f"tpl-{snapshot_id}.mem",
                        state=tdir / "state")  # fmt: skip

    def _prepare_child(self, cid: str, sd: Path, tsnap: Snapshot, meta: dict[str, Any]) -> int:
        """A child's disk overlay, config disk, settings and cgroup; returns its keeper."""
        sd.mkdir(parents=True, exist_ok=True)
        scratch = _scratch(_vmm_of(meta))
        _writable_disk(tsnap.dir / scratch, sd / scratch, "qcow2", _vmm_of(meta))
        shutil.copyfile(tsnap.dir / "config.img", sd / "config.img")
        _save_meta(sd, meta)
        self._make_cgroup(cid, SandboxSpec(cpu=float(meta["vcpus"]), memory_mb=meta["memory_mib"]))
        return _start_keeper(sd)

    # --- destroy / usage ---------------------------------------------------------------

    async def destroy(self, sandbox_id: str, paths: SandboxPaths) -> None:
        """Kill the VMM, the keeper and the mux; remove cgroups, files, sockets. Idempotent."""
        if not SANDBOX_NAME_RE.match(sandbox_id):
            raise InvalidArgument(f"invalid sandbox id {sandbox_id!r}")
        vm = self._vms.pop(sandbox_id, None)
        if vm is None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                keeper = await asyncio.to_thread(_read_keeper, paths.state_dir)
                meta = await asyncio.to_thread(_load_meta, paths.state_dir)
                vm = _Vm(vmm=choice.new_vmm(_vmm_of(meta)), keeper=keeper)
                await vm.vmm.adopt(self.run_dir(sandbox_id), Path(), True)
        if vm is not None:
            await self._detach(vm)
            await vm.vmm.kill()
            await asyncio.to_thread(_kill_pid, vm.keeper)
        left = await asyncio.to_thread(cgroups.remove, self.layout(), self.cgroup_path(sandbox_id))
        if self.network is not None:  # after QEMU is gone (it holds the TAP)
            await self.network.destroy(sandbox_id)
        try:
            templates = (await asyncio.to_thread(_load_meta, paths.state_dir)).get("templates", [])
        except (OSError, ValueError):
            templates = []
        await asyncio.to_thread(self._remove_files, sandbox_id, paths)
        await asyncio.to_thread(self._drop_unused_templates, templates)
        await asyncio.to_thread(self._drop_unused_ram, templates)
        for d in (self.mem_dir, self.templates_dir, self.paths.run / "vm"):
            with contextlib.suppress(OSError):
                await asyncio.to_thread(d.rmdir)  # only when empty
        if left:
            raise SandboxFailed(f"cgroups of {sandbox_id} could not be removed: {left}")
        log(_log, "microvm destroyed", sandbox_id=sandbox_id)

    def _remove_files(self, sandbox_id: str, paths: SandboxPaths) -> None:
        paths.agent_socket.unlink(missing_ok=True)
        shutil.rmtree(self.run_dir(sandbox_id), ignore_errors=True)
        for f in self.mem_dir.glob(f"{sandbox_id}.*mem") if self.mem_dir.exists() else ():
            f.unlink(missing_ok=True)
        self.mem_file(sandbox_id).unlink(missing_ok=True)
        shutil.rmtree(paths.state_dir, ignore_errors=True)

    def _drop_unused_templates(self, templates: list[str]) -> None:
        """Remove fork templates no sandbox's disk or RAM depends on any more."""
        if not templates:
            return
        used: set[str] = set()
        for sd in self.sandboxes_dir.iterdir() if self.sandboxes_dir.exists() else ():
            with contextlib.suppress(OSError, ValueError):
                used.update(_load_meta(sd).get("templates", []))
        for pin in self.templates_dir.glob(f"*/{PINNED}") if self.templates_dir.exists() else ():
            with contextlib.suppress(OSError, ValueError):  # a named snapshot's backing disks
                used.update(t for t in _load_meta(pin.parent).get("templates", [])
                            if t != pin.parent.name)  # fmt: skip
        for tid in templates:
            if tid not in used and not (self.templates_dir / tid / PINNED).exists():
                shutil.rmtree(self.templates_dir / tid, ignore_errors=True)
                (self.mem_dir / f"tpl-{tid}.mem").unlink(missing_ok=True)
        self._drop_unused_bases()

    def _drop_unused_ram(self, templates: list[str]) -> None:
        """Remove the RAM files of fork templates no running sandbox maps any more: a
        template whose disk is still needed (under a parent's or child's overlay) keeps its
        directory, but its RAM is only read by the VMs restored from it, and a VM that
        moved onto a RAM file of its own (``_own_ram``) no longer does."""
        mapped: set[str] = set()
        for sd in self.sandboxes_dir.iterdir() if self.sandboxes_dir.exists() else ():
            with contextlib.suppress(OSError, ValueError):
                mapped.add(str(_load_meta(sd).get("ram_template", "")))
        for tid in templates:
            if tid not in mapped and not (self.templates_dir / tid / PINNED).exists():
                (self.mem_dir / f"tpl-{tid}.mem").unlink(missing_ok=True)

    def _drop_unused_bases(self) -> None:
        """Remove base files taken in from other edges (``vm-bases``) that no sandbox or
        snapshot of this edge names any more (not while a copy is being taken in)."""
        bases = self.sandboxes_dir.parent / "vm-bases"
        if _IMPORTS or not bases.exists():
            return
        named: set[str] = set()
        dirs = [*(self.sandboxes_dir.iterdir() if self.sandboxes_dir.exists() else ()),
                *(p.parent for p in self.templates_dir.glob(f"*/{PINNED}"))]  # fmt: skip
        for d in dirs:
            with contextlib.suppress(OSError, ValueError):
                meta = _load_meta(d)
                named.update([str(meta.get("kernel")), *map(str, meta.get("shared", {}).values())])
        for f in bases.iterdir():
            if str(f) not in named:
                f.unlink(missing_ok=True)

    async def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        """Replace a running VM's network policy (the firewall outside the guest).

        Raises:
            InvalidArgument: this edge has no sandbox networking.
            SandboxNotFound: the sandbox has no network.
        """
        if self.network is None:
            raise InvalidArgument(f"{self.name} sandboxes on this edge have no networking")
        await self.network.set_policy(sandbox_id, policy)

    async def network_stats(self, sandbox_id: str) -> dict[str, int]:
        """Allowed/denied bytes, packets and connections (empty without networking)."""
        if self.network is None or self.network.get(sandbox_id) is None:
            return {}
        return (await self.network.counters()).get(sandbox_id, {})

    async def usage(self, sandbox_id: str) -> dict[str, float]:
        return await asyncio.to_thread(
            cgroups.read_usage, self.layout(), self.cgroup_path(sandbox_id)
        )

    async def _need(self, sandbox_id: str) -> _Vm:
        vm = await self._vm(sandbox_id) if SANDBOX_NAME_RE.match(sandbox_id) else None
        if vm is None:
            raise SandboxNotFound(f"no microVM for sandbox {sandbox_id}")
        return vm


# --- helpers ---------------------------------------------------------------------------


def _vmm_of(meta: dict[str, Any]) -> str:
    """The driver a VM was made with (VMs from before the choice existed ran on QEMU)."""
    return str(meta.get("vmm", "qemu"))


def _scratch(vmm: str) -> str:
    """The name of a VM's writable disk: qcow2 for QEMU, raw for Firecracker."""
    return "scratch.qcow2" if vmm == "qemu" else "scratch.raw"


def _writable_disk(base: Path, dest: Path, base_format: str, vmm: str) -> None:
    """``dest``, a writable disk whose content starts as ``base``'s: a qcow2 overlay for
    QEMU; for Firecracker (raw files only) a copy, reflinked where the filesystem can,
    sparse (holes stay holes) elsewhere."""
    if vmm == "qemu" and base_format == "qcow2":
        # A template's disk: every overlay on it is the same small file (the base's path is
        # all it holds), so qemu-img runs once per template, not once per fork child.
        proto = base.with_name(base.name + ".child")
        if not proto.exists():
            tmp = base.with_name(f".{base.name}.{secrets.token_hex(4)}")
            disks.make_overlay(base, tmp, base_format)
            os.replace(tmp, proto)
        shutil.copyfile(proto, dest)
        return
    if vmm == "qemu":
        disks.make_overlay(base, dest, base_format)
        return
    r = subprocess.run(
        ["cp", "--reflink=auto", "--sparse=always", str(base), str(dest)],
        capture_output=True, text=True,
    )  # fmt: skip
    if r.returncode != 0:
        raise SandboxFailed(f"cannot make the writable disk {dest.name}: {r.stderr.strip()}")


def _check_id(sandbox_id: str) -> None:
    if not SANDBOX_NAME_RE.match(sandbox_id):
        raise InvalidArgument(f"invalid sandbox id {sandbox_id!r}")


def _short_hash(p: Path) -> str:
    import hashlib

    return hashlib.sha256(str(p.resolve()).encode()).hexdigest()[:8]


def _guest_env(
    sandbox_id: str, image_env: tuple[str, ...], spec_env: dict[str, str]
) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/root",
        "TERM": "xterm-256color",
        "LANG": "C.UTF-8",
    }
    for item in image_env:
        k, sep, v = item.partition("=")
        if sep and k:
            env[k] = v
    env.update(spec_env)
    env["DSEC_SANDBOX_ID"] = sandbox_id
    env["HOSTNAME"] = sandbox_id
    return env


def _with_net(config: VmConfig, net: dict[str, str]) -> VmConfig:
    """The VM's NIC: QEMU runs in the sandbox's namespace and opens its TAP; the guest
    kernel takes address, gateway and resolver from ``ip=``."""
    if not net:
        return config
    return replace(
        config,
        cmdline=f"{config.cmdline} {net['ip']}".strip(),
        net=(NetIface("eth0", net["tap"], net["mac"]),),
        netns=net["netns"],
    )


def _save_meta(sd: Path, meta: dict[str, Any], drop: Path | None = None) -> None:
    """Write ``vm.json``, then remove ``drop`` (what the new state no longer needs)."""
    tmp = sd / ".vm.json.tmp"
    tmp.write_text(json.dumps(meta))
    tmp.rename(sd / "vm.json")
    if drop is not None:
        disks.remove(drop)


def _load_meta(sd: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((sd / "vm.json").read_text())
    return meta


def _freeze(mem: Path | None, frozen_mem: Path, sd: Path, tdir: Path, scratch: str) -> None:
    """Move the parent's RAM file (None: its RAM is in the state stream) and scratch disk
    into the (read-only from now) template."""
    # shutil.move: the sandboxes dir may be a bind mount (the container backend makes it
    # one), and rename(2) across mounts fails even on one filesystem; Firecracker's RAM
    # file is written beside its state, not on the RAM tmpfs.
    if mem is not None:
        shutil.move(mem, frozen_mem)
    else:
        frozen_mem.touch()
    shutil.move(sd / scratch, tdir / scratch)
    shutil.copyfile(sd / "config.img", tdir / "config.img")


def _copy_template(snap: Snapshot, tmem: Path, sd: Path, tdir: Path, scratch: str) -> None:
    """Copy a stopped guest's RAM file and disks into template ``tdir`` (data extents
    only: holes stay holes). When the RAM is in the state stream: an empty RAM file."""
    _settle(snap.state)
    with open(tmem, "wb") as dst:
        if snap.ram_in_file:
            _copy_extents(snap.mem_file, dst.fileno())
    with open(tdir / scratch, "wb") as dst:
        _copy_extents(sd / scratch, dst.fileno())
    shutil.copyfile(sd / "config.img", tdir / "config.img")


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 1)


def _check_snapshot(snap: Snapshot, private: bool) -> None:
    """Refuse ``snap`` unless it matches its manifest (unchanged stamps are trusted). A VMM
    restored with its RAM shared (``private=False``) writes into the RAM file: the stamps
    are dropped first, so should this snapshot be restored again, every file is hashed."""
    snapshots.verify(snap)
    if not private:
        snapshots.restamp(snap, keep=False)


def _refuse_networked(meta: dict[str, Any], what: str) -> None:
    if meta.get("net"):
        raise InvalidArgument(
            f"{what} of a microVM with a network is not supported yet "
            "(sandboxes made from it would wake up with its address)"
        )


def _copy_extents(src: Path, dst: int) -> None:
    """Copy ``src``'s data runs into the open file ``dst`` at the same offsets (holes stay
    holes)."""
    fd = os.open(src, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.ftruncate(dst, size)
        for start, end in snapshots.data_extents(fd, size):
            off = start
            while off < end:
                n = os.copy_file_range(fd, dst, end - off, off, off)
                if n <= 0:
                    raise OSError(f"short copy of {src} at {off}")
                off += n
    finally:
        os.close(fd)


def _settle(path: Path) -> None:
    """Write ``path`` out and drop it from the page cache: the state stream is written from
    inside the VM's memory cgroup, where up to guest-RAM-sized dirty pages (RAM that was
    mapped privately goes into the stream) would push the restored VM into an OOM kill."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _tree_bytes(d: Path, *files: Path) -> int:
    """Bytes allocated on disk (sparse files count what they use) by ``d``'s files and
    ``files``."""
    paths = [p for p in d.rglob("*") if p.is_file()] + list(files)
    return sum(p.stat().st_blocks * 512 for p in paths if p.exists())


def _start_keeper(sd: Path) -> int:
    """A sleeping process standing for the sandbox (see the module docstring)."""
    proc = subprocess.Popen(
        ["sleep", "infinity"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    start = qemu._start_time(proc.pid)
    (sd / "keeper.pid").write_text(f"{proc.pid} {start}\n")
    _reap_later(proc)
    return proc.pid


_keepers: list[subprocess.Popen[bytes]] = []


def _reap_later(proc: subprocess.Popen[bytes]) -> None:
    _keepers[:] = [p for p in _keepers if p.poll() is None]
    _keepers.append(proc)


def _read_keeper(sd: Path) -> int:
    pid_s, start = (sd / "keeper.pid").read_text().split()
    pid = int(pid_s)
    return pid if qemu._start_time(pid) == start else 0


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    for p in _keepers:
        if p.pid == pid:
            return p.poll() is None
    return qemu._start_time(pid) is not None


async def _wait_exit(pid: int) -> None:
    """Until process ``pid`` exits (a pidfd on the event loop, no polling)."""
    if pid <= 0:
        return
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def _kill_pid(pid: int) -> None:
    if pid > 0:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        for p in _keepers:
            if p.pid == pid:
                with contextlib.suppress(Exception):
                    p.wait(timeout=2)
        deadline = time.monotonic() + 2
        while qemu._start_time(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
