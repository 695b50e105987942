"""The full-VM system image: Debian bookworm with systemd, Debian's kernel and the agent.

Built by ``dsec setup --vm-image`` (a few minutes: mmdebstrap installs ~300 packages) into
``<data>/vm-image/``:

* ``rootfs-<key>/``: the installed system (kept, so a new agent bundle only costs a mkfs);
* ``<key>-<bundle>/``: ``disk.qcow2`` (ext4, no partition table: ``root=/dev/vda``),
  ``vmlinuz`` and ``initrd.img`` copied out of the image's own ``/boot``, ``version``;
* ``current``: a symlink to the newest ``<key>-<bundle>``.

Each VM boots ``vmlinuz`` directly (QEMU ``-kernel``/``-initrd``: no bootloader stage, no
partition table, and the command line is ours per VM) and gets a qcow2 overlay backed by
``disk.qcow2``. The initramfs is ours (``guest/vmboot.c`` plus the image's virtio and ext4
modules): it mounts the root and executes systemd in milliseconds, where Debian's
(udev coldplug) took ~35 s of guest time under TCG on a loaded host. Debian's own
``initramfs-tools`` stays installed (``MODULES=list``) so kernel updates inside work.

In the guest, systemd starts two units early (``DefaultDependencies=no``):
``dsec-aether.socket``/``.service`` (the bundle's init and aether on a socket-activated
``/.dsec/run/aether.sock``) and ``dsec-vmport.service`` (``/usr/local/sbin/dsec-vmport``,
the microVM's channel multiplexer ``guest/vmport.c`` built as a static program, on the
``dsec.agent`` virtio-serial port). The per-sandbox environment arrives as
``systemd.setenv=`` on the kernel command line.

    python -m dsec.edge.backends.vm.image [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.core.errors import DsecError, Internal, Unavailable
from dsec.edge.backends.microvm import disks as microvm_disks
from dsec.edge.images.base import SUITE, Progress, find_apt_sources, run_mmdebstrap

FORMAT = "1"
PACKAGES = (
    "systemd-sysv", "udev", "kmod", "linux-image-amd64", "initramfs-tools", "zstd",
    "python3", "procps", "ca-certificates", "iproute2",
)  # fmt: skip
INITRD_MODULES = ("virtio_pci", "virtio_blk", "virtio_console", "ext4")
# What our initramfs (guest/vmboot.c) loads: crc32c before ext4 (metadata_csum needs it and
# there is no modprobe to fetch it on demand), virtio_console so the agent port is there.
BOOT_MODULES = ("crc32c_generic", "virtio_pci", "virtio_blk", "virtio_console", "ext4")
VMBOOT_C = Path(__file__).parent / "guest" / "vmboot.c"
VMPORT_C = microvm_disks.GUEST_DIR / "vmport.c"  # the guest's multiplexer, as in every microVM
VMPORT_BIN = "/usr/local/sbin/dsec-vmport"
DISK_SIZE = "8G"  # sparse; the overlay of each VM grows with what the guest writes
# Units the image does not need (no VGA console, no apt timers, no periodic scrubbing).
MASKED = (
    "getty@tty1.service", "e2scrub_reap.service", "e2scrub_all.timer", "fstrim.timer",
    "apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer",
)  # fmt: skip
UNITS = {
    "dsec-aether.socket": """\
[Unit]
Description=OpenDsec runtime agent socket
DefaultDependencies=no
Before=sockets.target

[Socket]
ListenStream=/.dsec/run/aether.sock
SocketMode=0600
Backlog=128

[Install]
WantedBy=sockets.target
""",
    "dsec-aether.service": """\
[Unit]
Description=OpenDsec runtime agent (aether)
DefaultDependencies=no
Requires=dsec-aether.socket
After=dsec-aether.socket

[Service]
ExecStart=/.dsec/init
Sockets=dsec-aether.socket
Restart=always
RestartSec=100ms
WorkingDirectory=/root
Environment=HOME=/root LANG=C.UTF-8 TERM=xterm-256color

[Install]
WantedBy=sysinit.target
""",
    "dsec-vmport.service": f"""\
[Unit]
Description=OpenDsec agent channel (virtio-serial multiplexer)
DefaultDependencies=no
After=dsec-aether.socket

[Service]
ExecStart={VMPORT_BIN}
Restart=always
RestartSec=100ms

[Install]
WantedBy=sysinit.target
""",
    # A networked VM's eth0 (net.ifnames=0) from ip= on the kernel command line: Debian's
    # kernel has no IP_PNP and virtio_net is a module, so a script loads it and applies
    # ip=. Part of the boot transaction (WantedBy=sysinit.target), not ordered before
    # anything: `systemctl is-system-running --wait` (the backend's boot check) waits for
    # it. No device dependency: under TCG on a busy host udev can take longer than a
    # device unit's 90 s timeout, and the script waits for eth0 itself.
    "dsec-net.service": """\
[Unit]
Description=OpenDsec sandbox network (eth0 from ip= on the kernel command line)
DefaultDependencies=no
ConditionKernelCommandLine=ip
Before=network.target

[Service]
Type=oneshot
RemainAfterExit=yes
TimeoutStartSec=15min
ExecStart=/usr/local/sbin/dsec-net

[Install]
WantedBy=sysinit.target
""",
}
# ip=ADDR::GATEWAY:NETMASK::DEVICE:off:DNS, the kernel's syntax (SandboxNet.kernel_ip_arg)
NET_SCRIPT = """\
#!/bin/sh
set -eu
spec=
for arg in $(cat /proc/cmdline); do
  case "$arg" in ip=*) spec=${arg#ip=} ;; esac
done
IFS=: read -r addr _peer gw mask _host dev _auto dns <<END
$spec
END
modprobe -q virtio_net || true
while [ ! -e "/sys/class/net/$dev" ]; do sleep 0.2; done
ip link set "$dev" up
ip addr add "$addr/$mask" dev "$dev"
ip route add default via "$gw"
echo "nameserver $dns" > /etc/resolv.conf
"""
# Before the packages: initramfs-tools reads these when linux-image's postinst runs it.
_SETUP = (
    'mkdir -p "$1"/etc/initramfs-tools/conf.d "$1"/usr/share/initramfs-tools/modules.d',
    'echo MODULES=list > "$1"/etc/initramfs-tools/conf.d/dsec.conf',
    f'printf "%s\\n" {" ".join(INITRD_MODULES)} > "$1"/usr/share/initramfs-tools/modules.d/dsec',
)
_CUSTOMIZE = (
    'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb',
    'echo dsec > "$1"/etc/hostname',
    ': > "$1"/etc/resolv.conf',
    'printf "127.0.0.1\\tlocalhost\\n::1\\tlocalhost ip6-localhost\\n" > "$1"/etc/hosts',
    ': > "$1"/etc/machine-id',
    'mkdir -p "$1"/root',
    f"cat > \"$1\"/usr/local/sbin/dsec-net <<'EOF'\n{NET_SCRIPT}EOF",
    'chmod 0755 "$1"/usr/local/sbin/dsec-net',
)


@dataclass(frozen=True, slots=True)
class VmImage:
    dir: Path
    disk: Path  # qcow2 base: every VM gets an overlay on it
    kernel: Path
    initrd: Path
    kernel_version: str


def image_root(data: Path) -> Path:
    return data / "vm-image"


def rootfs_key() -> str:
    """A hash of everything the installed system is made from."""
    h = hashlib.sha256(FORMAT.encode())
    for part in (SUITE, *PACKAGES, *INITRD_MODULES, *MASKED, *_SETUP, *_CUSTOMIZE):
        h.update(part.encode() + b"\0")
    for name, text in sorted(UNITS.items()):
        h.update(name.encode() + b"\0" + text.encode())
    return h.hexdigest()[:16]


def build_name(key: str, bundle_key: str) -> str:
    """The directory of one disk build: the installed system, the agent bundle, and what
    is compiled at disk time (``vmboot.c`` with its modules, ``vmport.c``), so a change to
    those rebuilds the disk, not the installed system."""
    guest = hashlib.sha256(
        VMBOOT_C.read_bytes() + " ".join(BOOT_MODULES).encode() + VMPORT_C.read_bytes()
    )
    return f"{key}-{bundle_key}-{guest.hexdigest()[:8]}"


def current_image(data: Path) -> VmImage | None:
    """The image ``dsec setup --vm-image`` built last, or None."""
    link = image_root(data) / "current"
    if not link.exists():
        return None
    return _image_in(link.resolve())


def _image_in(d: Path) -> VmImage | None:
    try:
        version = (d / "version").read_text().strip()
    except OSError:
        return None
    img = VmImage(d, d / "disk.qcow2", d / "vmlinuz", d / "initrd.img", version)
    if not all(p.exists() for p in (img.disk, img.kernel, img.initrd)):
        return None
    return img


def built_before(data: Path) -> bool:
    """Whether this node has (had) a VM image, so setup should keep it current."""
    return (image_root(data) / "current").is_symlink()


def missing() -> str | None:
    """Why the image cannot be built here (None when it can)."""
    if os.geteuid() != 0:
        return "building the VM image needs root (mmdebstrap --mode=root)"
    for tool in ("mmdebstrap", "mkfs.ext4", "qemu-img", "gcc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not find_apt_sources():
        return f"no apt sources file under /etc/apt mentions {SUITE}"
    return None


def mmdebstrap_command(target: Path, sources: Sequence[Path]) -> list[str]:
    hooks = [
        *(f"--setup-hook={h}" for h in _SETUP),
        *(f"--customize-hook={h}" for h in _CUSTOMIZE),
        *(
            f"--customize-hook=cat > \"$1\"/etc/systemd/system/{name} <<'EOF'\n{text}EOF"
            for name, text in UNITS.items()
        ),
        f'--customize-hook=chroot "$1" systemctl enable {" ".join(UNITS)}',
        f'--customize-hook=chroot "$1" systemctl mask {" ".join(MASKED)}',
    ]
    return [
        "mmdebstrap",
        "--variant=minbase",
        "--mode=root",
        "--format=directory",
        f"--include={','.join(PACKAGES)}",
        *hooks,
        SUITE,
        str(target),
        *(str(s) for s in sources),
    ]


@contextlib.contextmanager
def _lock(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def build_image(
    data: Path, bundle: Path, *, progress: Progress | None = None, force: bool = False
) -> VmImage:
    """Build (or find) the VM image for the current package set and agent bundle.

    Raises:
        Unavailable: a tool or the apt sources are missing.
        Internal: a build step failed (its last output lines are in the message).
    """
    say = progress or (lambda _line: None)
    from dsec.agent.bundle import STAMP

    root = image_root(data)
    key = rootfs_key()
    try:
        bundle_key = (bundle / STAMP).read_text().strip()[:12]
    except OSError:
        raise Unavailable(f"no agent bundle at {bundle}: build it first (`dsec setup`)") from None
    dest = root / build_name(key, bundle_key)
    if not force and (img := _image_in(dest)) is not None:
        _point_current(root, dest)
        return img
    why = missing()
    if why:
        raise Unavailable(why)
    with _lock(root):
        if not force and (img := _image_in(dest)) is not None:
            _point_current(root, dest)
            return img
        start = time.monotonic()
        rootfs = root / f"rootfs-{key}"
        if force or not (rootfs / ".complete").exists():
            _build_rootfs(rootfs, say)
        img = _build_disk(rootfs, bundle, dest, say)
        _point_current(root, dest)
        _remove_stale(root, keep={rootfs.name, dest.name}, say=say)
        say(f"VM image ready in {time.monotonic() - start:.1f} s: {img.disk}")
        return img


def _build_rootfs(rootfs: Path, say: Progress) -> None:
    shutil.rmtree(rootfs, ignore_errors=True)
    cmd = mmdebstrap_command(rootfs, find_apt_sources())
    say(f"VM image: installing Debian {SUITE} with systemd and linux-image-amd64 (minutes)")
    run_mmdebstrap(cmd, say)
    (rootfs / ".complete").touch()


def _build_disk(rootfs: Path, bundle: Path, dest: Path, say: Progress) -> VmImage:
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        kernels = sorted((rootfs / "boot").glob("vmlinuz-*"))
        if not kernels:
            raise Internal(f"no kernel in {rootfs}/boot")
        version = kernels[-1].name.removeprefix("vmlinuz-")
        shutil.copyfile(kernels[-1], tmp / "vmlinuz")
        say("VM image: initramfs (vmboot + the boot modules)")
        _build_initramfs(rootfs, version, tmp / "initrd.img")
        say("VM image: installing the agent bundle at /.dsec")
        agent = rootfs / ".dsec"
        shutil.rmtree(agent, ignore_errors=True)
        shutil.copytree(bundle, agent, symlinks=True)
        (agent / "run").mkdir(mode=0o755, exist_ok=True)
        say(f"VM image: the channel multiplexer at {VMPORT_BIN} (gcc)")
        microvm_disks.build_vmport(rootfs / VMPORT_BIN.lstrip("/"))
        raw = tmp / "disk.raw"
        say(f"VM image: mkfs.ext4 -d ({DISK_SIZE} sparse) and qcow2")
        _run(["mkfs.ext4", "-q", "-F", "-L", "dsec-root", "-d", str(rootfs), str(raw), DISK_SIZE])
        _run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(tmp / "disk.qcow2")])
        raw.unlink()
        (tmp / "version").write_text(version + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    img = _image_in(dest)
    assert img is not None
    return img


_COMPRESSED = (".xz", ".gz", ".zst")


def module_name(path: str) -> str:
    """``kernel/fs/ext4/ext4.ko.xz`` -> ``ext4`` (the name modprobe knows, ``_`` for ``-``)."""
    name = Path(path).name
    for suffix in _COMPRESSED:
        name = name.removesuffix(suffix)
    return name.removesuffix(".ko").replace("-", "_")


def module_order(modules_dep: str, wanted: Sequence[str], builtin: Sequence[str] = ()) -> list[str]:
    """Module paths (relative to the modules dir) to load for ``wanted``, deps first;
    modules in ``builtin`` (the kernel's own) are skipped."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in modules_dep.splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        by_name[module_name(path)] = path
    order: list[str] = []

    def visit(path: str) -> None:
        for d in reversed(deps.get(path, [])):
            visit(d)
        if path not in order:
            order.append(path)

    for name in wanted:
        if name in builtin:
            continue
        if name not in by_name:
            raise Internal(f"kernel module {name} not found in modules.dep")
        visit(by_name[name])
    return order


def _module_bytes(path: Path) -> bytes:
    """A module file, decompressed (``finit_module`` of a compressed one needs a flag)."""
    data = path.read_bytes()
    if path.suffix == ".xz":
        import lzma

        return lzma.decompress(data)
    if path.suffix == ".gz":
        import gzip

        return gzip.decompress(data)
    if path.suffix == ".zst":
        r = subprocess.run(["zstd", "-dc"], input=data, capture_output=True)
        if r.returncode != 0:
            raise Internal(f"zstd -d {path.name}: {r.stderr.decode(errors='replace').strip()}")
        return r.stdout
    return data


def _build_initramfs(rootfs: Path, version: str, dest: Path) -> None:
    moddir = rootfs / "usr" / "lib" / "modules" / version
    order = module_order((moddir / "modules.dep").read_text(), BOOT_MODULES)
    write_initramfs(moddir, order, dest)


def write_initramfs(moddir: Path, order: Sequence[str], dest: Path) -> None:
    """Our initramfs (``guest/vmboot.c``) loading the modules ``order`` of ``moddir``."""
    entries = [("m", 0o040755, b"")]
    names = []
    for i, rel in enumerate(order):
        name = f"m/{i:02d}-{module_name(rel)}.ko"
        entries.append((name, 0o100644, _module_bytes(moddir / rel)))
        names.append("/" + name)
    entries.append(("modules", 0o100644, ("\n".join(names) + "\n").encode()))
    entries.append(("init", 0o100755, microvm_disks.static_program([VMBOOT_C])))
    dest.write_bytes(microvm_disks.newc_archive(entries))


def _point_current(root: Path, dest: Path) -> None:
    link = root / "current"
    with contextlib.suppress(OSError):
        if os.readlink(link) == dest.name:
            return
    tmp = root / ".current.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(dest.name)
    tmp.rename(link)


def _remove_stale(root: Path, keep: set[str], say: Progress) -> None:
    """Drop older builds. A running VM's overlay still reads its base: QEMU holds it open,
    so the unlinked file lives on until that VM ends."""
    for d in root.iterdir():
        if d.is_dir() and not d.is_symlink() and not d.name.startswith(".") and d.name not in keep:
            say(f"VM image: removing the old build {d.name}")
            shutil.rmtree(d, ignore_errors=True)


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise Internal(f"{argv[0]} failed: {(r.stderr or r.stdout).strip()[-2000:]}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dsec.edge.backends.vm.image``."""
    from dsec.agent.bundle import build_bundle
    from dsec.paths import Paths

    ap = argparse.ArgumentParser(prog="python -m dsec.edge.backends.vm.image")
    ap.add_argument("--force", action="store_true", help="reinstall the system too")
    args = ap.parse_args(argv)
    paths = Paths.from_env()
    try:
        build_bundle(paths.agent_bundle, progress=print)
        img = build_image(paths.data, paths.agent_bundle, progress=print, force=args.force)
    except DsecError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    print(f"kernel {img.kernel_version}, disk {img.disk}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
