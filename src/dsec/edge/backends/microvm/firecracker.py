"""The Firecracker driver: one ``firecracker`` process per guest, configured over its API.

Boot: spawn ``firecracker --api-sock`` (under ``jailer`` when it is installed and we are
root: chroot, uid/gid, network namespace), wait for the socket, then ``PUT``
``/machine-config``, ``/boot-source``, ``/drives/{id}``, ``/network-interfaces/{id}``,
``/vsock`` (hybrid vsock: a host unix socket), ``/balloon`` and ``/actions InstanceStart``.
Pause/resume are ``PATCH /vm``; a snapshot is ``PUT /snapshot/create`` (Full: a memory
file and a state file); a restore is a fresh process and ``PUT /snapshot/load`` with the
memory file mapped (``File``, which Firecracker always maps copy-on-write) or served by
a page-fault handler (``Uffd``, when ``VmConfig.extra["uffd_socket"]`` names one).

Every step of a boot or restore runs under one deadline (the boot watchdog); on any
failure the process group is killed and the driver's files are removed before raising.
The pid and config are saved in ``run_dir`` so that a restarted edge can ``adopt`` the
still-running VMM.
The API is checked against Firecracker's published spec in tests (the version we test
against is ``API_VERSION``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from dsec.core.errors import (
    DeadlineExceeded,
    DsecError,
    InvalidArgument,
    InvalidState,
    SandboxFailed,
)
from dsec.edge.backends.microvm import frames
from dsec.edge.backends.microvm.fc_api import FirecrackerApi, FirecrackerApiError
from dsec.edge.backends.microvm.mux import HybridVsockLink
from dsec.edge.backends.microvm.vmm import Drive, NetIface, Snapshot, VmConfig, netns_path
from dsec.obs import log

_log = logging.getLogger("dsec.edge.firecracker")

API_VERSION = "1.17.0-dev"  # the spec (firecracker-api.yaml) the driver is checked against
GUEST_CID = 3  # the first cid a guest may have; each VM has its own vsock device
JAIL_UID = JAIL_GID = 65534  # nobody/nogroup unless VmConfig.extra says otherwise
API_SOCKET = "firecracker.sock"
VSOCK_SOCKET = "vsock.sock"  # the host end of the guest's vsock device, in run_dir
AGENT_VSOCK_PORT = frames.VSOCK_PORT  # the guest's channel multiplexer listens here
BASE_CMDLINE = "console=ttyS0 reboot=k panic=1 pci=off"
MEM_NAME, STATE_NAME = "mem", "vmstate"


def find_binary(name: str) -> Path | None:
    found = shutil.which(name)
    return Path(found) if found else None


class FirecrackerVmm:
    """Drives one Firecracker process. Paths in ``VmConfig`` are host paths; under the
    jailer they are hard-linked into the chroot and the API gets chroot paths."""

    name = "firecracker"
    disk_format = "raw"  # no qcow2: a writable disk is a plain (sparse or reflinked) file
    shared_ram = False  # RAM is restored from a snapshot file mapped copy-on-write

    def __init__(
        self,
        binary: Path | None = None,
        *,
        jailer: Path | None = None,
        use_jailer: bool | None = None,
        api_timeout_s: float = 30.0,
    ) -> None:
        self.binary = binary or find_binary("firecracker") or Path("firecracker")
        self.jailer = jailer or find_binary("jailer")
        if use_jailer is None:
            use_jailer = self.jailer is not None and os.geteuid() == 0
        if use_jailer and self.jailer is None:
            raise InvalidState("use_jailer=True but no jailer binary was found")
        self.use_jailer = use_jailer
        self.api_timeout_s = api_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._adopted = 0  # pid of a Firecracker an earlier edge started (see adopt)
        self._config: VmConfig | None = None
        self._paused = False
        self._made: list[Path] = []  # files and dirs to remove on kill

    # -- the Vmm protocol ---------------------------------------------------------------

    @property
    def pid(self) -> int:
        p = self._proc
        if p is not None:
            return p.pid if p.returncode is None else 0
        return self._adopted if self._adopted and pid_alive(self._adopted) else 0

    def alive(self) -> bool:
        return self.pid != 0

    @property
    def returncode(self) -> int | None:
        """The process's exit status once it ended (a guest panic with ``panic=1``)."""
        return None if self._proc is None else self._proc.returncode

    async def boot(self, config: VmConfig, timeout_s: float) -> None:
        await self._guarded(config, timeout_s, "boot", lambda: self._boot(config))

    async def pause(self) -> None:
        await self._api().patch("/vm", {"state": "Paused"})
        self._paused = True

    async def resume(self) -> None:
        await self._api().patch("/vm", {"state": "Resumed"})
        self._paused = False

    async def snapshot(self, dest: Path) -> Snapshot:
        """Pause (the VM stays paused) and write a Full snapshot: RAM and device state."""
        if not self._paused:
            await self.pause()
        snap = _fresh_snapshot_dir(dest)
        inner = self._jail_dir("snapshot") if self.use_jailer else dest
        await self._api().put(
            "/snapshot/create",
            {
                "snapshot_type": "Full",
                "snapshot_path": self._guest_path(inner / STATE_NAME),
                "mem_file_path": self._guest_path(inner / MEM_NAME),
            },
        )
        _collect_snapshot(inner, snap)
        return snap

    async def own_ram(self, config: VmConfig, timeout_s: float) -> dict[str, float] | None:
        """Nothing: a Firecracker snapshot always writes the RAM file (a Full snapshot)."""
        return None

    async def restore(
        self,
        config: VmConfig,
        snap: Snapshot,
        *,
        private: bool,
        timeout_s: float,
        check: Callable[[], None] | None = None,
        on_listening: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Start a fresh Firecracker from ``snap`` and resume it. RAM is always mapped
        copy-on-write from the file (Firecracker's File backend is MAP_PRIVATE), so
        ``private=False`` cannot share writes back; a Uffd server, when configured,
        serves the pages instead. ``check`` runs while the process starts, before the
        snapshot is loaded."""
        for f in (snap.mem_file, snap.state):
            if not f.is_file():
                raise InvalidState(f"snapshot {snap.dir} is incomplete: {f.name} is missing")
        await self._guarded(
            config, timeout_s, "restore", lambda: self._restore(config, snap, check)
        )
        if on_listening is not None:  # the guest listens on vsock only once it runs
            await on_listening()

    def saved_snapshot(self, dest: Path, mem_file: Path) -> Snapshot:
        return Snapshot(dir=dest, mem_file=dest / MEM_NAME, state=dest / STATE_NAME)

    # -- the agent channel: hybrid vsock (a unix socket Firecracker serves) -------------

    def channel_socket(self, run_dir: Path) -> Path:
        return run_dir / VSOCK_SOCKET

    def link(self, config: VmConfig) -> HybridVsockLink:
        """Under the jailer ``config.agent_socket`` is a symlink into the chroot."""
        return HybridVsockLink(config.agent_socket, AGENT_VSOCK_PORT)

    def cmdline(self, base: str) -> str:
        return f"{BASE_CMDLINE} {base}".strip()

    # -- what went wrong ----------------------------------------------------------------

    def console(self) -> str:
        """The guest's serial console goes to Firecracker's stdout, i.e. its log."""
        if self._config is None:
            return ""
        try:
            text = (self._config.run_dir / "firecracker.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-15:])

    def panicked(self) -> str | None:
        for line in self.console().splitlines():
            if "Kernel panic" in line:
                return line.strip()
        return None

    def failure(self, what: str) -> SandboxFailed:
        panic = self.panicked()
        if panic:
            return SandboxFailed(f"the guest kernel panicked: {panic}\n{self.console()}")
        code = self.returncode
        status = f" (status {code})" if code is not None else ""
        return SandboxFailed(f"{what}{status}; log:\n{self.console()}")

    async def kill(self) -> None:
        proc, self._proc = self._proc, None
        adopted, self._adopted = self._adopted, 0
        if proc is not None:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await proc.wait()
        elif adopted and pid_alive(adopted):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(adopted, signal.SIGKILL)  # it leads its own process group
            for _ in range(1000):  # not our child: poll until it is gone (or a zombie)
                if not pid_alive(adopted):
                    break
                await asyncio.sleep(0.01)
        for path in reversed(self._made):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self._made.clear()
        self._paused = False

    # -- beyond the protocol ------------------------------------------------------------

    @property
    def run_dir(self) -> Path | None:
        return None if self._config is None else self._config.run_dir

    async def adopt(
        self, run_dir: Path, mem_file: Path | None = None, shared_ram: bool = False
    ) -> bool:
        """Re-attach to the Firecracker an earlier edge started in ``run_dir`` (it outlives
        the edge); False when it is gone or does not answer on its API socket. (``mem_file``
        and ``shared_ram`` are accepted for the QEMU driver's signature; Firecracker keeps
        guest RAM itself.)"""
        if self.pid:
            raise InvalidState(f"firecracker driver already runs pid {self.pid}")
        try:
            saved = load_state(run_dir)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        pid, config = saved
        if not pid_alive(pid):
            return False
        self._config, self._adopted, self.use_jailer = config[0], pid, config[1]
        try:
            info = await self.describe()
        except DsecError:
            self._adopted = 0
            return False
        self._paused = info.get("state") == "Paused"
        self._made = self._files_of(config[0])
        return True

    async def set_balloon(self, amount_mib: int) -> None:
        """Inflate (or deflate) the balloon: the guest gives that much RAM back."""
        await self._api().patch("/balloon", {"amount_mib": amount_mib})

    async def describe(self) -> dict[str, Any]:
        """``GET /``: id, state ("Not started", "Running", "Paused"), version."""
        info = await self._api().get("/")
        return info if isinstance(info, dict) else {}

    def guest_listen_path(self, port: int) -> Path:
        """Where the host must listen for guest-initiated vsock connections to ``port``
        (Firecracker connects to ``<uds_path>_<port>``, inside its chroot when jailed)."""
        config = self._require_config()
        base = self._jail_root() / config.agent_socket.name if self.use_jailer else (
            config.agent_socket
        )  # fmt: skip
        return Path(f"{base}_{port}")

    # -- internals ----------------------------------------------------------------------

    async def _guarded(
        self, config: VmConfig, timeout_s: float, what: str, step: Callable[[], Awaitable[None]]
    ) -> None:
        if self.pid:
            raise InvalidState(f"firecracker driver already runs pid {self.pid}")
        self._proc, self._adopted, self._made = None, 0, []
        self._config = config
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                await step()
        except BaseException as exc:
            tail = self._log_tail()
            await asyncio.shield(self.kill())  # even when the boot itself is cancelled
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded(
                    f"firecracker {what} did not finish within {timeout_s:g}s{tail}"
                ) from None
            if isinstance(exc, OSError) or type(exc) in (SandboxFailed, FirecrackerApiError):
                msg = exc.message if isinstance(exc, SandboxFailed) else str(exc)
                raise SandboxFailed(f"firecracker {what} failed: {msg}{tail}") from None
            raise
        log(_log, f"firecracker {what}", pid=self.pid, ms=round((time.monotonic() - start) * 1000))

    async def _boot(self, config: VmConfig) -> None:
        api = await self._spawn(config)
        await api.put(
            "/machine-config", {"vcpu_count": config.vcpus, "mem_size_mib": config.memory_mib}
        )
        boot: dict[str, str] = {
            "kernel_image_path": self._expose(config.kernel),
            "boot_args": boot_args(config),
        }
        if config.extra.get("initrd"):
            boot["initrd_path"] = self._expose(Path(config.extra["initrd"]))
        await api.put("/boot-source", boot)
        for d in config.drives:
            await api.put(
                f"/drives/{d.drive_id}",
                {
                    "drive_id": d.drive_id,
                    "path_on_host": self._expose(d.path),
                    "is_root_device": False,
                    "is_read_only": d.read_only,
                },
            )
        for n in config.net:
            await api.put(
                f"/network-interfaces/{n.iface_id}",
                {"iface_id": n.iface_id, "host_dev_name": n.tap, "guest_mac": n.mac},
            )
        if config.agent_socket != Path():
            await api.put("/vsock", {"guest_cid": GUEST_CID, "uds_path": self._vsock_path()})
        balloon = config.extra.get("balloon_mib", "0")
        if not balloon.isdigit():
            raise InvalidArgument(f"balloon_mib must be a whole number of MiB, not {balloon!r}")
        await api.put("/balloon", {"amount_mib": int(balloon), "deflate_on_oom": True})
        await api.put("/actions", {"action_type": "InstanceStart"})
        await self._expect_state(api, "Running")

    async def _restore(
        self, config: VmConfig, snap: Snapshot, check: Callable[[], None] | None
    ) -> None:
        verify = asyncio.create_task(asyncio.to_thread(check or _noop))
        try:
            api = await self._spawn(config)
            await verify
        except BaseException:
            verify.cancel()
            with contextlib.suppress(BaseException):
                await verify
            raise
        # A snapshot names the drive files of the VM it was taken of. Jailed, every VM
        # sees its own files under the same chroot paths; unjailed, the restored VM is
        # pointed at its own files (a fork child's disks) before it runs.
        repoint = bool(config.drives) and not self.use_jailer
        if self.use_jailer:
            for d in config.drives:
                self._expose(d.path)
        uffd = config.extra.get("uffd_socket")
        backend = (
            {"backend_type": "Uffd", "backend_path": self._guest_path(Path(uffd))}
            if uffd
            else {"backend_type": "File", "backend_path": self._expose(snap.mem_file)}
        )
        body: dict[str, Any] = {
            "snapshot_path": self._expose(snap.state),
            "mem_backend": backend,
            "resume_vm": not repoint,
        }
        if config.net:
            body["network_overrides"] = [
                {"iface_id": n.iface_id, "host_dev_name": n.tap} for n in config.net
            ]
        if config.agent_socket != Path():
            body["vsock_override"] = {"uds_path": self._vsock_path()}
        await api.put("/snapshot/load", body)
        if repoint:
            for d in config.drives:
                await api.patch(
                    f"/drives/{d.drive_id}", {"drive_id": d.drive_id, "path_on_host": str(d.path)}
                )
            await api.patch("/vm", {"state": "Resumed"})
        self._paused = False
        await self._expect_state(api, "Running")

    async def _expect_state(self, api: FirecrackerApi, want: str) -> None:
        info = await api.get("/")
        state = info.get("state") if isinstance(info, dict) else None
        if state != want:
            raise SandboxFailed(f"firecracker reports state {state!r}, expected {want!r}")

    async def _spawn(self, config: VmConfig) -> FirecrackerApi:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        log_file = config.run_dir / "firecracker.log"
        if self.use_jailer:
            root = self._jail_root()
            if root.exists():
                shutil.rmtree(root.parent)
            self._made.append(root.parent)
            socket = root / "run" / API_SOCKET
        else:
            socket = config.run_dir / API_SOCKET
            socket.unlink(missing_ok=True)
            self._made.append(socket)
        if config.agent_socket != Path():
            config.agent_socket.unlink(missing_ok=True)  # Firecracker binds it anew
            self._made.append(config.agent_socket)
        argv = self.command(config)
        out = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # its own process group: kill takes every child
            )
        finally:
            os.close(out)
        for cg in _cgroups_of(config):  # the VM's limits cap Firecracker itself
            (cg / "cgroup.procs").write_text(f"{self._proc.pid}\n")
        save_state(config, self._proc.pid, self.use_jailer)
        self._made.append(config.run_dir / STATE_FILE)
        await self._wait_socket(socket)
        if self.use_jailer and config.agent_socket != Path():
            # Firecracker binds the vsock socket in its chroot; the host's path points there
            config.agent_socket.symlink_to(self._jail_root() / config.agent_socket.name)
        return FirecrackerApi(socket, self.api_timeout_s)

    def _files_of(self, config: VmConfig) -> list[Path]:
        """What kill removes for a VM this driver adopted."""
        made = [config.run_dir / STATE_FILE]
        if self.use_jailer:
            made.append(self._jail_root().parent)
        else:
            made.append(config.run_dir / API_SOCKET)
        if config.agent_socket != Path():
            made.append(config.agent_socket)
        return made

    def command(self, config: VmConfig) -> list[str]:
        """The argv that starts Firecracker for ``config`` (jailed or not)."""
        vm_id = vm_id_of(config)
        if not self.use_jailer:
            argv = [str(self.binary), "--api-sock", str(config.run_dir / API_SOCKET), "--id", vm_id]
            if config.netns:  # the sandbox's network namespace, where its TAP is
                argv = ["nsenter", f"--net={netns_path(config.netns)}", "--", *argv]
            return argv
        assert self.jailer is not None
        argv = [
            str(self.jailer), "--id", vm_id, "--exec-file", str(self.binary),
            "--uid", config.extra.get("uid", str(JAIL_UID)),
            "--gid", config.extra.get("gid", str(JAIL_GID)),
            "--chroot-base-dir", str(config.run_dir / "jail"),
        ]  # fmt: skip
        if config.netns:
            argv += ["--netns", netns_path(config.netns)]
        return [*argv, "--", "--api-sock", f"/run/{API_SOCKET}"]

    async def _wait_socket(self, socket: Path) -> None:
        proc = self._proc
        assert proc is not None
        while True:
            if proc.returncode is not None:
                raise SandboxFailed(f"firecracker exited with status {proc.returncode} at start")
            if os.path.exists(socket):  # noqa: ASYNC240 (a stat, polled)
                try:
                    _, writer = await asyncio.open_unix_connection(str(socket))
                except OSError:
                    pass
                else:
                    writer.close()
                    return
            await asyncio.sleep(0.01)

    def _require_config(self) -> VmConfig:
        if self._config is None:
            raise InvalidState("the firecracker driver has not booted anything")
        return self._config

    def _api(self) -> FirecrackerApi:
        config = self._require_config()
        if self.pid == 0:
            raise InvalidState("firecracker is not running")
        socket = (
            self._jail_root() / "run" / API_SOCKET
            if self.use_jailer
            else config.run_dir / API_SOCKET
        )
        return FirecrackerApi(socket, self.api_timeout_s)

    # Under the jailer Firecracker sees only <run_dir>/jail/firecracker/<id>/root.
    def _jail_root(self) -> Path:
        config = self._require_config()
        return config.run_dir / "jail" / self.binary.name / vm_id_of(config) / "root"

    def _jail_dir(self, name: str) -> Path:
        d = self._jail_root() / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _guest_path(self, host: Path) -> str:
        """A path as Firecracker sees it (relative to its chroot when jailed)."""
        if not self.use_jailer:
            return str(host)
        if not host.is_relative_to(self._jail_root()):
            raise InvalidArgument(f"{host} is outside the jail {self._jail_root()}")
        return "/" + str(host.relative_to(self._jail_root()))

    def _expose(self, host: Path) -> str:
        """Make a host file visible to Firecracker and answer the path it knows it by."""
        if not self.use_jailer:
            return str(host)
        config = self._require_config()
        inside = self._jail_dir("files") / host.name
        inside.unlink(missing_ok=True)
        try:
            os.link(host, inside)  # same inode: a writable drive stays the same disk
        except OSError:
            shutil.copy2(host, inside)  # another filesystem
        with contextlib.suppress(OSError):
            os.chown(inside, int(config.extra.get("uid", JAIL_UID)),
                     int(config.extra.get("gid", JAIL_GID)))  # fmt: skip
        return self._guest_path(inside)

    def _vsock_path(self) -> str:
        config = self._require_config()
        if not self.use_jailer:
            return str(config.agent_socket)
        return "/" + config.agent_socket.name  # the host reaches it in the chroot

    def _log_tail(self) -> str:
        if self._config is None:
            return ""
        try:
            lines = (self._config.run_dir / "firecracker.log").read_text(errors="replace")
        except OSError:
            return ""
        tail = [line for line in lines.splitlines() if line.strip()][-3:]
        return f" (log: {' | '.join(tail)[-400:]})" if tail else ""


STATE_FILE = "firecracker.json"  # pid and config, for re-adoption after an edge restart


def save_state(config: VmConfig, pid: int, jailed: bool) -> None:
    data = {
        "pid": pid,
        "jailed": jailed,
        "config": {
            "vcpus": config.vcpus, "memory_mib": config.memory_mib, "kernel": str(config.kernel),
            "cmdline": config.cmdline, "run_dir": str(config.run_dir),
            "mem_file": str(config.mem_file), "agent_socket": str(config.agent_socket),
            "drives": [[d.drive_id, str(d.path), d.read_only] for d in config.drives],
            "net": [[n.iface_id, n.tap, n.mac] for n in config.net],
            "netns": config.netns, "cgroup": str(config.cgroup) if config.cgroup else None,
            "extra": dict(config.extra),
        },
    }  # fmt: skip
    tmp = config.run_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(config.run_dir / STATE_FILE)


def load_state(run_dir: Path) -> tuple[int, tuple[VmConfig, bool]]:
    data = json.loads((run_dir / STATE_FILE).read_text())
    c = data["config"]
    config = VmConfig(
        vcpus=int(c["vcpus"]), memory_mib=int(c["memory_mib"]), kernel=Path(c["kernel"]),
        cmdline=str(c["cmdline"]), run_dir=Path(c["run_dir"]), mem_file=Path(c["mem_file"]),
        drives=tuple(Drive(str(i), Path(p), bool(ro)) for i, p, ro in c["drives"]),
        net=tuple(NetIface(str(i), str(t), str(m)) for i, t, m in c["net"]),
        agent_socket=Path(c["agent_socket"]), netns=c["netns"],
        cgroup=Path(c["cgroup"]) if c["cgroup"] else None,
        extra={str(k): str(v) for k, v in c["extra"].items()},
    )  # fmt: skip
    return int(data["pid"]), (config, bool(data["jailed"]))


def _noop() -> None:
    pass


def _cgroups_of(config: VmConfig) -> list[Path]:
    """``cgroup`` plus ``extra["cgroups"]`` (":"-separated, one per v1 hierarchy)."""
    dirs = [Path(p) for p in config.extra.get("cgroups", "").split(":") if p]
    return [config.cgroup, *dirs] if config.cgroup is not None else dirs


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _fresh_snapshot_dir(dest: Path) -> Snapshot:
    dest.mkdir(parents=True, exist_ok=True)
    snap = Snapshot(dir=dest, mem_file=dest / MEM_NAME, state=dest / STATE_NAME)
    for f in (snap.mem_file, snap.state):
        f.unlink(missing_ok=True)
    return snap


def _collect_snapshot(written: Path, snap: Snapshot) -> None:
    """Move the files Firecracker wrote (in its chroot when jailed) to ``snap``; check them."""
    if written != snap.dir:
        for name in (MEM_NAME, STATE_NAME):
            shutil.move(written / name, snap.dir / name)
    for f in (snap.mem_file, snap.state):
        if not f.is_file():
            raise SandboxFailed(f"firecracker reported a snapshot but wrote no {f}")


def boot_args(config: VmConfig) -> str:
    """The command line plus ``dsec.disks=``, the drive ids in the order Firecracker
    attaches them (vda, vdb, ...): its disk serials come from the host file's device and
    inode, so the guest's init cannot find its disks by serial as under QEMU."""
    if not config.drives:
        return config.cmdline
    if len(config.drives) > 26:
        raise InvalidArgument(f"{len(config.drives)} drives: the guest can name 26 (vda..vdz)")
    return f"{config.cmdline} dsec.disks={','.join(d.drive_id for d in config.drives)}".strip()


def vm_id_of(config: VmConfig) -> str:
    """Firecracker's instance id (alphanumeric and dashes, at most 64 chars)."""
    raw = config.extra.get("vm_id") or config.run_dir.name
    clean = "".join(c if c.isalnum() or c == "-" else "-" for c in raw)
    return clean[:64] or "vm"
