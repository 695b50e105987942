"""The QEMU ``microvm`` driver of :class:`dsec.edge.backends.microvm.vmm.Vmm`.

One ``qemu-system-x86_64 -M microvm`` per guest, in its own session (so the whole process
group can be killed by the pid we started), control over QMP, the agent channel on a
virtio-serial port whose host end is a unix socket QEMU serves. Guest RAM is a
``memory-backend-file``: snapshots skip it (``x-ignore-shared``) and fork children map the
same file privately; a guest so mapped moves onto a file of its own before its next snapshot
(:meth:`QemuVmm.own_ram`), since ``x-ignore-shared`` skips shared RAM only. Under TCG the
kernel gets ``tsc_early_khz`` (it hangs at random in TSC calibration without it) and
``norandmaps`` (see TCG_KERNEL_ARGS); under KVM it gets neither.

Files in ``run_dir``: ``qmp.sock``, ``serial.sock`` (agent channel), ``console.log`` (the
guest's serial console), ``qemu.log`` (QEMU's stderr), ``qemu.pid`` (pid + start time, for
re-adoption after an edge restart). The edge binds both sockets itself and hands QEMU the
listening fds: they accept connections from the moment QEMU is started (no connect retries
while QEMU initialises), so the agent link and its HELLO are in place before a restored
guest runs.

A restore is one QEMU started with ``-incoming defer``; once the snapshot is verified, the
migration capabilities and ``migrate-incoming`` (the state file is an fd QEMU inherited) go
in one write. QEMUs run with ``migration.store-global-state=off``: a snapshot does not carry
the run state of its (stopped) source, so the restored QEMU starts the guest the moment the
state is loaded (no ``cont`` round trip); a snapshot taken by an older QEMU still says
"paused" and gets its ``cont``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from dsec.core.errors import SandboxFailed
from dsec.edge.backends.microvm import ramfile
from dsec.edge.backends.microvm.mux import SerialLink
from dsec.edge.backends.microvm.qmp import Qmp
from dsec.edge.backends.microvm.vmm import Snapshot, VmConfig, netns_path, watched

QEMU = "qemu-system-x86_64"
# Debian's qemu-system-x86 also ships a build for the microvm machine alone: KVM only (no
# TCG), 10 shared libraries where the full build links 51. It starts on ~4.5 ms of CPU
# instead of ~20 ms (``-version``, bench.qemu_start), which every restore and fork child
# pays. Used for microvm guests under KVM when installed; TCG and q35 need the full build.
QEMU_KVM_MICROVM = "qemu-system-x86_64-microvm"
NSENTER = "nsenter"  # util-linux
PANIC_MARKERS = ("Kernel panic", "end Kernel panic")
AGENT_PORT = "dsec.agent"
MIGRATION_FD = "dsec-state"  # the name QEMU knows the snapshot state file's fd by
# A migration between two QEMUs on this host is not throttled (QEMU's default is 128 MiB/s).
LOCAL_BANDWIDTH = 1 << 36
OWN_RAM_DIR = "own-ram"  # in run_dir: the QEMU taking a guest onto its own RAM file, at first
T = TypeVar("T")


@functools.cache
def installed(binary: str) -> bool:
    return shutil.which(binary) is not None


@functools.cache
def accelerator() -> str:
    """``kvm`` where a probe boot showed KVM really runs guests, else ``tcg``."""
    try:  # the probe lives beside the Firecracker driver
        kvm = importlib.import_module("dsec.edge.backends.microvm.kvm")
    except ImportError:
        return "tcg"
    ok, _ = kvm.usable()
    return "kvm" if ok else "tcg"


# QEMU's TCG keeps the host code it translated in one buffer, 1 GiB by default, that grows
# with every guest code page it runs. A systemd boot of the Debian image fills ~350 MiB of
# it, which with the guest's RAM passed the sandbox cgroup's memory limit and got QEMU
# OOM-killed mid-boot (seen as "the agent closed the connection"). Bounded, QEMU flushes
# the buffer when full and translates again, and the limit holds (VMM_OVERHEAD_MIB).
TCG_TB_MIB = 128
# QEMU 7.2's x86 TCG keys translated code by the guest's virtual address, so with ASLR in
# the guest every new process (every exec's sh, ld.so and libc) and the multiplexer beside
# aether (two Pythons at different addresses) run through the translator again: ~3,000
# translated blocks (~60 ms of CPU, ~1.5 MiB of code buffer) per exec. Without it an exec
# of a warm program is translated once per VM, and the first exec after a restore or in a
# fork child translates ~15% less. Under TCG only (no KVM here): the VM is the boundary.
TCG_KERNEL_ARGS = "norandmaps"


def host_tsc_khz() -> int | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return round(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def available() -> str | None:
    """Why QEMU cannot run microVMs here (None when it can)."""
    if shutil.which(QEMU) is None:
        return f"{QEMU} is not installed (apt-get install qemu-system-x86)"
    if shutil.which("qemu-img") is None:
        return "qemu-img is not installed (apt-get install qemu-utils)"
    return None


def console_tail(run_dir: Path, n: int = 15) -> str:
    try:
        text = (run_dir / "console.log").read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-n:])


def panicked(run_dir: Path) -> str | None:
    """The kernel's panic line from the console log, if the guest panicked."""
    try:
        text = (run_dir / "console.log").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if "Kernel panic" in line:
            return line.strip()
    return None


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class QemuVmm:
    """:class:`dsec.edge.backends.microvm.vmm.Vmm` on ``qemu-system-x86_64 -M microvm``."""

    name = "qemu"
    disk_format = "qcow2"

    def __init__(self, *, accel: str | None = None) -> None:
        self.accel = accel or accelerator()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = 0
        self._qmp: Qmp | None = None
        self.run_dir: Path | None = None
        self.mem_file: Path | None = None
        self.shared_ram = True

    @property
    def pid(self) -> int:
        return self._pid if self.alive() else 0

    def alive(self) -> bool:
        if self._pid <= 0:
            return False
        if self._proc is not None:
            return self._proc.poll() is None
        return _start_time(self._pid) is not None and self._is_ours()

    def _is_ours(self) -> bool:
        assert self.run_dir is not None
        try:
            pid_s, start = (self.run_dir / "qemu.pid").read_text().split()
        except (OSError, ValueError):
            return False
        return int(pid_s) == self._pid and _start_time(self._pid) == start

    # --- the agent channel: a virtio-serial port QEMU serves on a unix socket -----------

    def channel_socket(self, run_dir: Path) -> Path:
        return run_dir / "serial.sock"

    def link(self, config: VmConfig) -> SerialLink:
        return SerialLink(config.agent_socket)

    def cmdline(self, base: str) -> str:
        return base  # argv() adds the console, panic and TSC arguments itself

    # --- command line ------------------------------------------------------------------

    def argv(
        self,
        c: VmConfig,
        *,
        mem_path: Path,
        share: bool,
        incoming: bool,
        fds: tuple[int, int] | None = None,
        start: bool = True,
    ) -> list[str]:
        """QEMU's command line. ``fds``: listening sockets (QMP, agent channel) QEMU
        inherits, else it binds ``qmp.sock`` and ``c.agent_socket`` itself. ``start``: the
        guest runs once booted or loaded (else it waits for ``cont``)."""
        rd = c.run_dir
        if fds is None:
            qmp = f"path={rd / 'qmp.sock'}"
            agent = f"path={c.agent_socket}"
        else:
            qmp, agent = (f"fd={fd}" for fd in fds)
        cmdline = f"console=ttyS0 panic=-1 reboot=t {c.cmdline}".strip()
        if self.accel == "tcg":
            khz = host_tsc_khz()
            if khz:
                cmdline += f" tsc_early_khz={khz}"
            cmdline += f" {TCG_KERNEL_ARGS}"
        # extra["machine"] = "q35": a standard PC (SeaBIOS, virtio-pci) for full VMs
        q35 = c.extra.get("machine") == "q35"
        machine = "q35" if q35 else "microvm,x-option-roms=off,rtc=on,isa-serial=on"
        bus = "pci" if q35 else "device"
        kvm_microvm = self.accel == "kvm" and not q35 and installed(QEMU_KVM_MICROVM)
        argv = [
            QEMU_KVM_MICROVM if kvm_microvm else QEMU,
            "-M", f"{machine},memory-backend=mem",
            "-accel", f"tcg,tb-size={TCG_TB_MIB}" if self.accel == "tcg" else self.accel,
            "-cpu", "max" if self.accel == "tcg" else "host",
            "-smp", str(c.vcpus),
            "-m", f"{c.memory_mib}M",
            "-object", f"memory-backend-file,id=mem,size={c.memory_mib}M,mem-path={mem_path},"
                       f"share={'on' if share else 'off'}",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-chardev", f"file,id=con,path={rd / 'console.log'}",
            "-serial", "chardev:con",
            "-chardev", f"socket,id=qmp,{qmp},server=on,wait=off",
            "-mon", "chardev=qmp,mode=control",
            "-global", "migration.store-global-state=off",
            "-device", f"virtio-rng-{bus}",
            "-device", f"virtio-serial-{bus}",
            "-chardev", f"socket,id=agent,{agent},server=on,wait=off",
            "-device", f"virtserialport,chardev=agent,name={AGENT_PORT}",
        ]  # fmt: skip
        for i, n in enumerate(c.net):  # a TAP in c.netns, where QEMU runs (see _popen)
            argv += [
                "-netdev", f"tap,id=n{i},ifname={n.tap},script=no,downscript=no",
                "-device", f"virtio-net-{bus},netdev=n{i},mac={n.mac}",
            ]  # fmt: skip
        # A microvm restore takes its RAM from the snapshot: reading and parsing the kernel
        # (and initrd) it never boots cost ~6 ms of QEMU's CPU at start. They reach a microvm guest
        # through fw_cfg, not through RAM blocks in the migration stream; a q35 machine
        # loads them as option ROMs, which are RAM blocks, so it keeps them.
        if not incoming or q35:
            argv += ["-kernel", str(c.kernel), "-append", cmdline]
            initrd = c.extra.get("initrd")
            if initrd:
                argv += ["-initrd", initrd]
        for i, d in enumerate(c.drives):
            fmt = "qcow2" if d.path.suffix == ".qcow2" else "raw"
            ro = ",readonly=on" if d.read_only else ""
            argv += [
                "-drive", f"file={d.path},if=none,id=d{i},format={fmt},cache=unsafe{ro}",
                "-device", f"virtio-blk-{bus},drive=d{i},serial={d.drive_id}",
            ]  # fmt: skip
        if not start:
            argv.append("-S")
        if incoming:
            argv += ["-incoming", "defer"]
        return argv

    # --- lifecycle ---------------------------------------------------------------------

    async def _spawn(
        self,
        c: VmConfig,
        argv: Callable[[tuple[int, int]], list[str]],
        timeout_s: float,
        keep_fds: tuple[int, ...] = (),
    ) -> None:
        """Start QEMU with ``argv(fds)`` (the listening QMP and agent sockets' fds) and
        connect QMP. ``keep_fds`` are inherited too (under the same numbers)."""
        self.run_dir = c.run_dir
        self._proc = await asyncio.to_thread(_popen, c, argv, keep_fds)
        self._pid = self._proc.pid
        pid_line = f"{self._pid} {_start_time(self._pid)}\n"
        await asyncio.to_thread((c.run_dir / "qemu.pid").write_text, pid_line)
        try:
            self._qmp = await self._with_watchdog(
                Qmp.connect(c.run_dir / "qmp.sock", timeout_s + 5), timeout_s
            )
        except BaseException:
            await self.kill()
            raise

    async def _with_watchdog(self, aw: Awaitable[T], timeout_s: float) -> T:
        """Await ``aw`` unless QEMU exits first or ``timeout_s`` passes (then raise)."""
        return await watched(self, aw, timeout_s)

    def console(self) -> str:
        return console_tail(self.run_dir) if self.run_dir else ""

    def panicked(self) -> str | None:
        return panicked(self.run_dir) if self.run_dir else None

    def failure(self, what: str) -> SandboxFailed:
        assert self.run_dir is not None
        panic = panicked(self.run_dir)
        if panic:
            return SandboxFailed(f"the guest kernel panicked: {panic}\n{self.console()}")
        try:
            err = (self.run_dir / "qemu.log").read_text(errors="replace")[-1500:].strip()
        except OSError:
            err = ""
        code = self._proc.poll() if self._proc is not None else None
        if code is not None and code < 0:
            oom = " (the memory limit?)" if -code == signal.SIGKILL else ""
            err = f"killed by signal {-code}{oom} {err}"
        console = self.console()
        if code == 0 and not console.strip():
            err = f"the guest reset before its first console line (too little memory?) {err}"
        return SandboxFailed(f"{what}: {err.strip()}\nconsole:\n{console}")

    async def boot(self, config: VmConfig, timeout_s: float) -> None:
        self.mem_file = config.mem_file
        self.shared_ram = True
        config.mem_file.parent.mkdir(parents=True, exist_ok=True)
        await self._spawn(
            config,
            lambda fds: self.argv(
                config, mem_path=config.mem_file, share=True, incoming=False, fds=fds
            ),
            timeout_s,
        )

    async def adopt(self, run_dir: Path, mem_file: Path, shared_ram: bool) -> bool:
        """Re-attach to a QEMU an earlier edge started; False when it is gone."""
        self.run_dir = run_dir
        self.mem_file = mem_file
        self.shared_ram = shared_ram
        try:
            self._pid = int((run_dir / "qemu.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        if not self.alive():
            self._pid = 0
            return False
        with contextlib.suppress(OSError, TimeoutError):
            self._qmp = await Qmp.connect(run_dir / "qmp.sock", 2)
        return self._qmp is not None

    def _need_qmp(self) -> Qmp:
        if self._qmp is None or not self.alive():
            raise SandboxFailed("the microVM's QEMU is not running")
        return self._qmp

    async def status(self) -> str:
        st = await self._need_qmp().cmd("query-status")
        return str(st.get("status"))

    async def pause(self) -> None:
        await self._need_qmp().cmd("stop")

    async def resume(self) -> None:
        await self._need_qmp().cmd("cont")

    async def snapshot(self, dest: Path) -> Snapshot:
        qmp = self._need_qmp()
        assert self.mem_file is not None
        await asyncio.to_thread(dest.mkdir, parents=True, exist_ok=True)
        state = dest / "state"
        await qmp.cmd("stop")
        await qmp.cmd(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "x-ignore-shared", "state": self.shared_ram}]},
        )
        # The state file is handed to QEMU as an fd: no shell and no `cat` process per
        # snapshot, and no pipe the whole stream is copied through.
        fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            await qmp.cmd("getfd", {"fdname": MIGRATION_FD}, fd=fd)
        finally:
            os.close(fd)
        await qmp.cmd("migrate", {"uri": f"fd:{MIGRATION_FD}"})
        while True:
            info = await qmp.cmd("query-migrate")
            st = info.get("status")
            if st == "completed":
                break
            if st in ("failed", "cancelled"):
                raise SandboxFailed(f"snapshot failed: {info.get('error-desc', st)}")
            await asyncio.sleep(0.002)
        (dest / "qemu.json").write_text(json.dumps({"ignore_shared": self.shared_ram}))
        return Snapshot(dir=dest, mem_file=self.mem_file, state=state, ram_in_file=self.shared_ram)

    async def own_ram(self, config: VmConfig, timeout_s: float) -> dict[str, float] | None:
        """Move a guest whose RAM is mapped copy-on-write from a template (a fork child, a
        parent that forked) onto a RAM file of its own, ``config.mem_file``, mapped shared:
        its snapshots skip the RAM again (``x-ignore-shared`` skips shared RAM only) instead
        of writing all of it into the state stream, and fork children map it copy-on-write.

        A second QEMU on the new file takes the stopped guest in over a socket pair (memory
        to memory, nothing on disk); then this one quits and the new one is this driver's
        VMM, its guest still stopped. Both read every page of guest RAM, which fills the
        holes of the template (never-touched pages) and of the new file with zero pages:
        they are punched back to holes. Returns the phases (ms), or None when the RAM is
        already shared. On failure the new QEMU is gone and this one is left as it was
        (stopped)."""
        if self.shared_ram:
            return None
        old = self._need_qmp()
        assert self.mem_file is not None
        assert self.run_dir is not None
        template, rd = self.mem_file, self.run_dir
        t0 = time.perf_counter()
        await old.cmd("stop")
        # Pages never touched (holes of the template) the guest did not write since are
        # zero: after the move they are punched in both files without reading them. (An
        # edge from before ``ram_template`` was recorded re-adopts without the path.)
        holes: list[tuple[int, int]] = []
        written: set[int] = set()
        with contextlib.suppress(OSError):
            holes = await asyncio.to_thread(ramfile.holes, template)
            written = await asyncio.to_thread(ramfile.private_pages, self._pid, template, holes)
        cpu0 = _cpu_ms(self._pid)
        # beside this QEMU's sockets until it quits (a bound socket keeps working renamed)
        sub = rd / OWN_RAM_DIR
        c = replace(config, run_dir=sub, agent_socket=self.channel_socket(sub))
        nxt = QemuVmm(accel=self.accel)
        nxt.mem_file, nxt.shared_ram = config.mem_file, True
        try:  # the guest stays stopped there (start=False): own_ram leaves it so
            await nxt._spawn(
                c,
                lambda fds: nxt.argv(
                    c, mem_path=config.mem_file, share=True, incoming=True, fds=fds, start=False
                ),
                timeout_s,
            )
            await nxt._with_watchdog(self._migrate_to(nxt), timeout_s)
        except BaseException:
            await nxt.kill()
            await asyncio.to_thread(shutil.rmtree, sub, True)
            config.mem_file.unlink(missing_ok=True)
            raise
        t1 = time.perf_counter()
        cpu = _cpu_ms(self._pid) - cpu0 + _cpu_ms(nxt._pid)
        await self._quit_process()
        for name in ("qmp.sock", c.agent_socket.name, "console.log", "qemu.log", "qemu.pid"):
            await asyncio.to_thread(os.replace, sub / name, rd / name)
        await asyncio.to_thread(shutil.rmtree, sub, True)
        self._proc, self._pid, self._qmp = nxt._proc, nxt._pid, nxt._qmp
        self.mem_file, self.shared_ram = config.mem_file, True
        t2 = time.perf_counter()
        # the guest is stopped: no page of the new file changes meanwhile
        freed = await asyncio.to_thread(ramfile.punch_except, config.mem_file, holes, written)
        with contextlib.suppress(FileNotFoundError):  # dropped meanwhile: nothing to give back
            freed += await asyncio.to_thread(ramfile.punch_except, template, holes, set())
        phases = {"migrate_ms": _ms(t0, t1), "switch_ms": _ms(t1, t2), "punch_ms": _ms(t2),
                  "qemu_cpu_ms": cpu, "written_mib": round(len(written) * 4096 / 2**20, 1),
                  "freed_mib": round(freed / 2**20, 1)}  # fmt: skip
        return phases

    async def _migrate_to(self, nxt: QemuVmm) -> None:
        """Send this (stopped) guest to ``nxt``, waiting for it, over a socket pair."""
        old, new = self._need_qmp(), nxt._need_qmp()
        off = {"capabilities": [{"capability": "x-ignore-shared", "state": False}]}
        mine, theirs = socket.socketpair()
        try:
            await new.cmd("migrate-set-capabilities", off)
            await new.cmd("getfd", {"fdname": MIGRATION_FD}, fd=theirs.fileno())
            await new.cmd("migrate-incoming", {"uri": f"fd:{MIGRATION_FD}"})
            await old.cmd("migrate-set-capabilities", off)
            await old.cmd("migrate-set-parameters", {"max-bandwidth": LOCAL_BANDWIDTH})
            await old.cmd("getfd", {"fdname": MIGRATION_FD}, fd=mine.fileno())
            await old.cmd("migrate", {"uri": f"fd:{MIGRATION_FD}"})
        finally:
            mine.close()
            theirs.close()
        while True:
            info = await old.cmd("query-migrate")
            st = info.get("status")
            if st in ("failed", "cancelled"):
                raise SandboxFailed(f"moving the guest RAM failed: {info.get('error-desc', st)}")
            if st == "completed" and (await nxt.status()) != "inmigrate":
                return
            await asyncio.sleep(0.005)

    async def _quit_process(self) -> None:
        """Kill this driver's QEMU process, leaving the files in ``run_dir`` alone."""
        if self._qmp is not None:
            self._qmp.close()
            self._qmp = None
        pid = self._pid
        if pid > 0 and self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if self._proc is not None:
            await asyncio.to_thread(self._proc.wait)
            self._proc = None
        elif pid > 0:
            for _ in range(500):
                if _start_time(pid) is None:
                    break
                await asyncio.sleep(0.01)
        self._pid = 0

    def saved_snapshot(self, dest: Path, mem_file: Path) -> Snapshot:
        try:
            in_file = bool(json.loads((dest / "qemu.json").read_text()).get("ignore_shared"))
        except (OSError, ValueError):
            in_file = True
        return Snapshot(dir=dest, mem_file=mem_file, state=dest / "state", ram_in_file=in_file)

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
        """QEMU starts waiting for the state (``-incoming defer``) while ``check`` runs;
        ``on_listening`` runs before the state is loaded (the agent link connects then)."""
        try:
            state = os.open(snap.state, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if check is not None:
                await asyncio.to_thread(check)  # says what is wrong with the snapshot
            raise SandboxFailed(f"snapshot {snap.dir}: {snap.state.name}: {exc.strerror}") from None
        verify = asyncio.create_task(asyncio.to_thread(check or _noop))
        try:
            await self.start_incoming(config, snap, private=private, timeout_s=timeout_s,
                                      state_fd=state)  # fmt: skip
            await verify
            if check is not None and not _same_file(state, snap.state):
                raise SandboxFailed(f"snapshot {snap.dir}: the state file was replaced")
            if on_listening is not None:
                await on_listening()
            await self.finish_incoming(snap, timeout_s=timeout_s, state_fd=state)
        except BaseException:
            verify.cancel()
            with contextlib.suppress(BaseException):
                await verify
            await self.kill()
            raise
        finally:
            os.close(state)

    async def start_incoming(
        self,
        config: VmConfig,
        snap: Snapshot,
        *,
        private: bool,
        timeout_s: float,
        state_fd: int,
    ) -> None:
        """Start QEMU waiting for a migration stream (the caller may verify meanwhile);
        it inherits ``state_fd``, the open state file."""
        meta = json.loads((snap.dir / "qemu.json").read_text())
        self.shared_ram = not private
        if meta.get("ignore_shared"):
            self.mem_file = snap.mem_file
        else:  # RAM is in the state stream: load it into a fresh file
            self.mem_file = config.mem_file
            self.shared_ram = True
        mem, share = self.mem_file, self.shared_ram
        await self._spawn(
            config,
            lambda fds: self.argv(config, mem_path=mem, share=share, incoming=True, fds=fds),
            timeout_s,
            keep_fds=(state_fd,),
        )

    async def finish_incoming(self, snap: Snapshot, *, timeout_s: float, state_fd: int) -> None:
        """Load the state from ``state_fd`` (the number QEMU inherited it under) and run
        the guest: both commands in one write, then wait until the state is in."""
        qmp = self._need_qmp()
        meta = json.loads((snap.dir / "qemu.json").read_text())
        caps = [{"capability": "x-ignore-shared", "state": bool(meta.get("ignore_shared"))}]
        try:
            await qmp.cmds(
                ("migrate-set-capabilities", {"capabilities": caps}),
                ("migrate-incoming", {"uri": f"fd:{state_fd}"}),
            )

            async def loaded() -> str:
                while (st := await self.status()) == "inmigrate":  # noqa: ASYNC110 (QMP)
                    await asyncio.sleep(0.002)
                return st

            if await self._with_watchdog(loaded(), timeout_s) == "paused":
                await qmp.cmd("cont")  # the snapshot carried its source's "paused"
        except BaseException:
            await self.kill()
            raise

    async def kill(self) -> None:
        await self._quit_process()
        if self.run_dir is not None:
            for name in ("qmp.sock", "qemu.pid"):
                (self.run_dir / name).unlink(missing_ok=True)


def _noop() -> None:
    pass


def _same_file(fd: int, path: Path) -> bool:
    """Whether open ``fd`` is the file at ``path`` now (the one its check verified)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _cpu_ms(pid: int) -> float:
    """CPU time (user + system, all threads) process ``pid`` used so far (0 when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def _ms(t0: float, t1: float | None = None) -> float:
    return round(((time.perf_counter() if t1 is None else t1) - t0) * 1000, 1)


def _popen(
    c: VmConfig, argv: Callable[[tuple[int, int]], list[str]], keep_fds: tuple[int, ...] = ()
) -> subprocess.Popen[bytes]:
    """Start QEMU in its own session, inside the VM's cgroups (limits cap QEMU itself),
    with the QMP and agent sockets bound here and inherited listening."""
    c.run_dir.mkdir(parents=True, exist_ok=True)
    c.mem_file.parent.mkdir(parents=True, exist_ok=True)
    (c.run_dir / "console.log").unlink(missing_ok=True)
    socks = [_listening(c.run_dir / "qmp.sock"), _listening(c.agent_socket)]
    try:
        cmd = argv((socks[0].fileno(), socks[1].fileno()))
        procs = _cgroup_procs_files(c)
        if procs:  # join the cgroups before exec: limits cap QEMU itself (no preexec_fn:
            # the edge runs gRPC, whose fork handlers must not run in a forked Python child)
            joins = "".join(f'echo $$ > "{p}" && ' for p in procs)
            cmd = ["/bin/sh", "-c", joins + 'exec "$@"', "sh", *cmd]
        if c.netns:  # the sandbox's network namespace (file path): QEMU opens its TAP there
            cmd = [NSENTER, f"--net={netns_path(c.netns)}", "--", *cmd]
        with open(c.run_dir / "qemu.log", "wb") as log:
            return subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                pass_fds=(*(s.fileno() for s in socks), *keep_fds),
            )
    finally:
        for sock in socks:  # QEMU holds them now (or, when it did not start, nobody)
            sock.close()


def _listening(path: Path) -> socket.socket:
    """A unix socket listening at ``path`` (replacing what is there), owner-only."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(16)
    except BaseException:
        sock.close()
        raise
    return sock


def _cgroup_procs_files(c: VmConfig) -> list[str]:
    """The cgroups QEMU joins: ``cgroup``, plus ``extra["cgroups"]`` (":"-separated dirs,
    one per hierarchy on v1/hybrid hosts)."""
    dirs = [Path(p) for p in c.extra.get("cgroups", "").split(":") if p]
    if c.cgroup is not None:
        dirs.insert(0, c.cgroup)
    return [str(d / "cgroup.procs") for d in dirs]
