"""The full-VM backend: a QEMU ``q35`` PC booting the Debian system image with systemd.

It is the microVM backend with a different machine and disk: the same QEMU driver
(``extra["machine"] = "q35"``: SeaBIOS, virtio-pci devices), the same agent channel mux,
keeper process, cgroups, snapshots (pause = snapshot to a file + quit QEMU, resume =
restore), fork and destroy. What differs:

* the guest boots the image's own kernel and initramfs (``image.VmImage``), with
  ``root=/dev/vda``: one qcow2 overlay per VM on the shared base disk (copy-on-write);
* systemd is PID 1; aether and the channel multiplexer are systemd services of the image;
* the sandbox's environment and hostname travel on the kernel command line
  (``systemd.setenv=``, ``systemd.hostname=``), so there is no config disk to read;
* boots take seconds (systemd), so the boot watchdog allows more;
* with sandbox networking the NIC is the microVM's (TAP in the sandbox's namespace,
  ``virtio-net-pci``, the same ``ip=``), but the image's ``dsec-net.service`` applies
  ``ip=`` (Debian's kernel has no ``IP_PNP``) once udev has loaded ``virtio_net``.

``spec.image`` names the system image: ``base`` (Debian bookworm, built by ``dsec setup
--vm-image``) or one a user imported (``dsec image import-vm``, :mod:`.imports`): that one
boots its own kernel and systemd from its root partition (``root=/dev/vdaN``) with our
initramfs built from its modules, and the same agent units, added at import.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from dsec.core.errors import (
    BackendUnavailable,
    DsecError,
    ImageNotFound,
    InvalidArgument,
    SandboxFailed,
)
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.api import Availability, Capabilities, SandboxPaths, Started
from dsec.edge.backends.microvm import disks, qemu
from dsec.edge.backends.microvm.backend import MicrovmBackend, _save_meta, _with_net
from dsec.edge.backends.microvm.vmm import Drive, VmConfig
from dsec.edge.backends.vm import image as vm_image
from dsec.edge.backends.vm import imports as vm_imports
from dsec.edge.images.store import Image, ImageConfig
from dsec.obs import log

_log = logging.getLogger(__name__)
IMAGES = ("base",)
VM_BOOT_TIMEOUT_S = 480.0  # systemd under TCG: ~10 s idle, minutes on a 2-core host at load 8
# Debian's kernel and initramfs do not boot in 64 MiB (the guest resets before its first
# console line); in 128 MiB the boot to a running system took 100-260 s under TCG, mostly
# waiting (the guest rereads its disk), against ~40 s in 256 MiB.
MIN_MEMORY_MB = 256
# Advertised hints (Capabilities): systemd's boot at a quarter core took ~190 s under TCG,
# with a whole one ~40 s (create -> first exec p50 39.9 s, idle 2-core host, bench.backends).
MIN_VCPUS = 1.0
CREATE_SECONDS = 40.0
CMDLINE_MAX = 2000  # x86 COMMAND_LINE_SIZE is 2048; the driver adds console/tsc arguments
_UNQUOTABLE = ('"', "\n", "\\")


class VmBackend(MicrovmBackend):
    """:class:`dsec.edge.backends.api.Backend` on QEMU q35 + the Debian system image."""

    name = "vm"
    boot_timeout_s = VM_BOOT_TIMEOUT_S
    fixed_vmm = "qemu"  # a q35 PC: Firecracker has no such machine
    # The Debian kernel has no IP_PNP: the image's dsec-net.service reads the same ip=
    # once udev loaded virtio_net (image.NET_SCRIPT).
    guest_network = True

    def availability(self) -> Availability:
        if os.geteuid() != 0:
            return Availability(False, "the vm backend needs root")
        why = qemu.available()
        if why:
            return Availability(False, why)
        img = self.system_image()
        imported = vm_imports.list_imports(self.paths.data)
        if img is None and not imported:
            return Availability(False, "no VM system image: run `dsec setup --vm-image`")
        kernel = f"Debian kernel {img.kernel_version}" if img else "imported images only"
        more = f", {len(imported)} imported image(s)" if imported else ""
        return Availability(True, f"QEMU q35, accel {qemu.accelerator()}, {kernel}{more}")

    def capabilities(self) -> Capabilities:
        """A full OS (systemd, its own kernel and modules); otherwise as the microVM."""
        caps = super().capabilities()
        return replace(
            caps,
            min_memory_mb=MIN_MEMORY_MB,
            min_vcpus=MIN_VCPUS,
            create_seconds=CREATE_SECONDS,
            notes=(
                f"QEMU q35 + Debian with systemd, accel {qemu.accelerator()}; images: base "
                "and imported ones (dsec image import-vm)"
            ),
        )

    async def create(self, sandbox_id: str, spec: SandboxSpec, paths: SandboxPaths) -> Started:
        """Boot the VM, then wait until systemd finished booting (within the boot watchdog).

        The agent answers early in the boot (its units have no default dependencies), while
        systemd still starts the rest, cleans ``/tmp`` (``systemd-tmpfiles --remove``) and
        keeps the one vCPU busy (chronus's start then missed its 10 s under TCG). Running
        means booted: ``systemctl is-system-running --wait`` (``degraded`` counts).
        """
        if spec.memory_mb < MIN_MEMORY_MB:
            raise InvalidArgument(
                f"the vm backend needs memory_mb >= {MIN_MEMORY_MB}: a Debian system with "
                f"systemd does not boot in {spec.memory_mb} MiB"
            )
        t0 = time.monotonic()
        started = await super().create(sandbox_id, spec, paths)
        left = max(5.0, self.boot_timeout_s - (time.monotonic() - t0))
        try:
            res = await agent_client.call(
                paths.agent_socket,
                {"op": "exec", "cmd": "systemctl is-system-running --wait"},
                timeout=left,
            )
        except BaseException as exc:
            await asyncio.shield(self.destroy(sandbox_id, paths))
            if isinstance(exc, DsecError | asyncio.CancelledError):
                raise
            raise SandboxFailed(f"vm {sandbox_id}: waiting for systemd failed: {exc}") from exc
        log(_log, "vm booted", sandbox_id=sandbox_id, state=res.stdout.decode().strip(),
            boot_s=round(time.monotonic() - t0, 1))  # fmt: skip
        return started

    def system_image(self) -> vm_image.VmImage | None:
        return vm_image.current_image(self.paths.data)

    def kernel(self) -> Path | None:
        """The built image's kernel (an imported image brings its own: ``_boot_files``)."""
        img = self.system_image()
        if img is not None:
            return img.kernel
        imported = vm_imports.list_imports(self.paths.data)
        return imported[0].kernel(self.paths.data) if imported else None

    def _image(self, spec: SandboxSpec) -> Image:
        if spec.image not in IMAGES and vm_imports.find(self.paths.data, spec.image) is None:
            names = [*IMAGES, *(i.name for i in vm_imports.list_imports(self.paths.data))]
            raise ImageNotFound(
                f"the vm backend boots a system image ({', '.join(names)}), not "
                f"{spec.image!r}: import one with `dsec image import-vm`; container images "
                "need backend container or microvm"
            )
        return Image(name=spec.image, diff_ids=(), layer_dirs=(), config=ImageConfig(), created="")

    def _shared_images(self, layer_dirs: tuple[Path, ...]) -> dict[str, str]:
        return {}  # per image: _boot_files

    def _boot_files(self, image: str) -> dict[str, str]:
        """Disk, kernel, initramfs, root device and filesystem of the system image."""
        if image in IMAGES:
            img = self.system_image()
            if img is None:
                raise BackendUnavailable(
                    "no VM system image on this node: run `dsec setup --vm-image`"
                )
            return {"disk": str(img.disk), "initrd": str(img.initrd), "kernel": str(img.kernel),
                    "root": "/dev/vda", "fstype": ""}  # fmt: skip
        imp = vm_imports.find(self.paths.data, image)
        if imp is None:
            raise ImageNotFound(f"VM image {image!r} was removed")
        data = self.paths.data
        return {
            "disk": str(imp.disk(data)),
            "initrd": str(imp.initrd(data)),
            "kernel": str(imp.kernel(data)),
            "root": imp.root,
            "fstype": imp.fstype,
        }

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
        shared = self._boot_files(spec.image)
        cmdline = guest_cmdline(sandbox_id, env, root=shared["root"], fstype=shared["fstype"])
        if net:  # the NIC is eth0, which dsec-net.service waits for; ip= comes in _config
            cmdline += " net.ifnames=0"
        sd = paths.state_dir
        sd.mkdir(parents=True, exist_ok=True)
        # The VM's disk is named like the microVM's writable disk, so fork (which freezes
        # and re-overlays "scratch.qcow2") works unchanged; config.img is empty here.
        disks.make_overlay(Path(shared["disk"]), sd / "scratch.qcow2", "qcow2")
        disks.write_config(sd / "config.img", {})
        meta: dict[str, Any] = {
            "vcpus": max(1, round(spec.cpu)),
            "memory_mib": spec.memory_mb,
            "kernel": shared["kernel"],
            "shared": shared,
            "layers": 0,
            "cmdline": cmdline,
            "agent_socket": str(paths.agent_socket),
            "mem_gen": "",
            "shared_ram": True,
            "net": net,
        }
        _save_meta(sd, meta)

    def _config(self, sandbox_id: str, paths: SandboxPaths, meta: dict[str, Any]) -> VmConfig:
        run = self.run_dir(sandbox_id)
        config = VmConfig(
            vcpus=meta["vcpus"],
            memory_mib=meta["memory_mib"],
            kernel=Path(meta["kernel"]),
            cmdline=meta["cmdline"],
            run_dir=run,
            mem_file=self.mem_file(sandbox_id, meta.get("mem_gen", "")),
            drives=(Drive("root", paths.state_dir / "scratch.qcow2", read_only=False),),
            agent_socket=run / "serial.sock",
            extra={
                "machine": "q35",
                "initrd": meta["shared"]["initrd"],
                "cgroups": ":".join(self._cgroup_dirs(sandbox_id)),
            },
        )
        return _with_net(config, meta.get("net") or {})


def guest_cmdline(
    sandbox_id: str, env: dict[str, str], *, root: str = "/dev/vda", fstype: str = ""
) -> str:
    """The kernel command line: root disk, quiet systemd, hostname and environment.

    Raises:
        InvalidArgument: a value systemd cannot take from the command line (quotes,
            newlines, backslashes) or an environment too large for it.
    """
    parts = [
        f"root={root}",
        *([f"rootfstype={fstype}"] if fstype else []),
        "rw",
        "quiet",
        "loglevel=3",
        "systemd.show_status=false",
        f"systemd.hostname={sandbox_id}",
    ]
    for key, value in env.items():
        if any(ch in value for ch in _UNQUOTABLE):
            raise InvalidArgument(
                f"env {key}: the vm backend cannot pass quotes, backslashes or newlines"
            )
        item = f"systemd.setenv={key}={value}"
        parts.append(f'"{item}"' if (" " in item or "\t" in item) else item)
    line = " ".join(parts)
    if len(line) > CMDLINE_MAX:
        raise InvalidArgument(
            f"the environment is too large for the vm backend ({len(line)} > {CMDLINE_MAX} "
            "bytes on the kernel command line)"
        )
    return line
