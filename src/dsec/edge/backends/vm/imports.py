"""User system images for the vm backend: a bootable disk (raw or qcow2) imported by name.

``dsec image import-vm NAME FILE`` streams the disk to an edge, which checks and prepares
it here into ``<data>/vm-images/NAME/``:

* ``disk.qcow2``: the disk, read-only (mode 0444); every VM of it gets a qcow2 overlay;
* ``vmlinuz``: the image's own kernel (the newest ``/boot/vmlinuz-*`` of its root);
* ``initrd.img``: our initramfs (``guest/vmboot.c``) with the image's own virtio and
  filesystem modules, as for the built image: it mounts the root partition and executes the
  image's ``/sbin/init``, which must be systemd;
* ``meta.json``: root partition, filesystem, kernel version, OS name, source, created.

The import works on a private raw copy: it reads the partition table (``partx``), finds
the root filesystem on a loop device per partition (ext2/3/4, xfs or btrfs with
``/etc/os-release``, ``/sbin/init`` and a kernel in ``/boot``), mounts it and adds what
the built image has: the agent bundle at ``/.dsec``, the channel multiplexer
(``/usr/local/sbin/dsec-vmport``, static), the ``dsec-*`` units (enabled as
``systemctl enable`` would) and the network script. Cloud
images get ``/etc/cloud/cloud-init.disabled`` (no datasource answers in a sandbox). Then it
unmounts, detaches and writes the qcow2. Symlinks inside the image are resolved as the
guest would (absolute targets from its root), never into the host. On any failure the
loop device, the mount and the work directory go.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from dsec.core.errors import (
    AlreadyExists,
    Internal,
    InvalidArgument,
    InvalidState,
    Unavailable,
)
from dsec.edge.backends.microvm.disk_info import disk_info
from dsec.edge.backends.microvm.disks import build_vmport
from dsec.edge.backends.vm import image as vm_image

# status, done, total (bytes or steps; total 0 when unknown)
Progress = Callable[[str, int, int], None]

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
RESERVED = ("base",)  # the built image's name
FORMATS = ("raw", "qcow2")
MAX_VIRTUAL_SIZE = 2 << 40  # 2 TiB: a sparse raw copy of it is made while importing
# blkid TYPE -> the filesystem type vmboot mounts and the module it needs
ROOT_FILESYSTEMS = {
    "ext4": ("ext4", "ext4"),
    "ext3": ("ext4", "ext4"),
    "ext2": ("ext4", "ext4"),
    "xfs": ("xfs", "xfs"),
    "btrfs": ("btrfs", "btrfs"),
}
DRIVERS = ("virtio_pci", "virtio_blk", "virtio_console")  # the disk and the agent channel
OPTIONAL_MODULES = ("crc32c_generic",)  # ext4 metadata_csum; built in or absent elsewhere
TOOLS = ("qemu-img", "losetup", "partx", "blkid", "mount", "umount", "gcc")


@dataclass(frozen=True, slots=True)
class VmImport:
    name: str
    root: str  # the root device in the guest, e.g. /dev/vda1
    fstype: str
    kernel_version: str
    os_name: str
    source: str
    created: str
    size: int  # bytes the base disk takes on the host
    virtual_size: int

    def dir(self, data: Path) -> Path:
        return imports_root(data) / self.name

    def disk(self, data: Path) -> Path:
        return self.dir(data) / "disk.qcow2"

    def kernel(self, data: Path) -> Path:
        return self.dir(data) / "vmlinuz"

    def initrd(self, data: Path) -> Path:
        return self.dir(data) / "initrd.img"


def imports_root(data: Path) -> Path:
    return data / "vm-images"


def check_name(name: str) -> None:
    """Raises InvalidArgument for a name that cannot be an imported image's."""
    if not NAME_RE.fullmatch(name):
        raise InvalidArgument(
            f"VM image name {name!r}: 1-63 of a-z, 0-9, '.', '_', '-' (starting with a letter "
            "or digit)"
        )
    if name in RESERVED:
        raise AlreadyExists(f"VM image {name!r} is the built-in system image")


def find(data: Path, name: str) -> VmImport | None:
    """The imported image ``name``, or None."""
    if not NAME_RE.fullmatch(name):
        return None
    try:
        raw = json.loads((imports_root(data) / name / "meta.json").read_text())
        return VmImport(**raw)
    except (OSError, ValueError, TypeError):
        return None


def list_imports(data: Path) -> list[VmImport]:
    root = imports_root(data)
    if not root.is_dir():
        return []
    found = (find(data, d.name) for d in sorted(root.iterdir()) if not d.name.startswith("."))
    return [i for i in found if i is not None]


def users(data: Path, name: str, edge_dir: Path) -> list[str]:
    """Sandboxes and named snapshots of the edge (``edge_dir``: its ``sandboxes`` and
    ``vm-templates``) whose disks stand on the imported image ``name``."""
    imp = find(data, name)
    if imp is None:
        return []
    disk = json.dumps(str(imp.disk(data)))  # as it appears in their vm.json
    found = []
    for meta in sorted(edge_dir.glob("*/*/vm.json")):
        if meta.parent.parent.name in ("sandboxes", "vm-templates"):
            with contextlib.suppress(OSError):
                if disk in meta.read_text():
                    found.append(meta.parent.name)
    return found


def remove(data: Path, name: str, *, edge_dir: Path | None = None) -> bool:
    """Delete the imported image ``name``; False when there is none.

    Raises:
        InvalidState: sandboxes or named snapshots under ``edge_dir`` still use it (a
            paused VM or a snapshot needs its base to resume).
    """
    d = imports_root(data) / name
    with _lock(data):
        if find(data, name) is None:
            return False
        using = users(data, name, edge_dir) if edge_dir is not None else []
        if using:
            raise InvalidState(
                f"VM image {name!r} is used by {', '.join(using[:5])}"
                f"{f' and {len(using) - 5} more' if len(using) > 5 else ''}: "
                "kill those sandboxes (delete those snapshots) first"
            )
        trash = d.with_name(f".rm-{name}-{secrets.token_hex(4)}")
        d.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    return True


def missing() -> str | None:
    """Why disks cannot be imported here (None when they can)."""
    if os.geteuid() != 0:
        return "importing a VM image needs root (loop devices and mounts)"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"importing a VM image needs {tool}, which is not installed"
    return None


def upload_path(data: Path) -> Path:
    """A fresh file name for an upload on the same filesystem as the imports."""
    root = imports_root(data)
    root.mkdir(parents=True, exist_ok=True)
    return root / f".upload-{secrets.token_hex(8)}"


def import_disk(
    data: Path,
    name: str,
    src: Path,
    bundle: Path,
    *,
    source: str = "",
    progress: Progress | None = None,
    consume: bool = False,
) -> VmImport:
    """Import the disk image ``src`` as ``name``; with ``consume`` ``src`` is ours to
    change and delete (an upload), else it is only read.

    Raises:
        InvalidArgument: not a raw/qcow2 disk image, a truncated or corrupt qcow2, a qcow2
            with a backing file, no Linux root filesystem, no systemd, no kernel or no
            virtio drivers for it.
        AlreadyExists: an image of that name exists.
        Unavailable: a tool is missing (or not root).
        Internal: a step failed unexpectedly.
    """
    say = progress or (lambda _s, _d, _t: None)
    try:
        check_name(name)
        if find(data, name) is not None:
            raise AlreadyExists(f"VM image {name!r} exists: remove it first (dsec image rm)")
        why = missing()
        if why:
            raise Unavailable(why)
        root = imports_root(data)
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".import-{name}-", dir=root))
    except BaseException:
        if consume:
            src.unlink(missing_ok=True)
        raise
    try:
        fmt, vsize = _probe(src)
        raw = work / "disk.raw"
        if fmt == "raw" and consume:
            src.rename(raw)
        else:
            say("converting to raw", 0, 100)
            _convert(src, fmt, raw, "raw", lambda pct: say("converting to raw", pct, 100))
            if consume:
                src.unlink()
        meta = _prepare(raw, work, bundle, name, source or src.name, vsize, say)
        (work / "mnt").rmdir()
        say("writing the qcow2 base", 0, 100)
        _convert(raw, "raw", work / "disk.qcow2", "qcow2",
                 lambda pct: say("writing the qcow2 base", pct, 100))  # fmt: skip
        raw.unlink()
        (work / "disk.qcow2").chmod(0o444)
        size = sum(p.stat().st_blocks * 512 for p in work.iterdir())
        meta = VmImport(**{**asdict(meta), "size": size})
        (work / "meta.json").write_text(json.dumps(asdict(meta), indent=1) + "\n")
        with _lock(data):
            if find(data, name) is not None:
                raise AlreadyExists(f"VM image {name!r} exists: remove it first (dsec image rm)")
            work.rename(root / name)
        say("done", 100, 100)
        return meta
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if consume:
            src.unlink(missing_ok=True)


def _probe(src: Path) -> tuple[str, int]:
    """The disk's format and virtual size, after checking a qcow2 whole."""
    info = disk_info(src, InvalidArgument, "not a disk image")
    fmt = info.format
    if fmt not in FORMATS:
        raise InvalidArgument(
            f"disk format {fmt!r}: import raw or qcow2 (qemu-img convert -O qcow2 converts)"
        )
    if info.backing:
        raise InvalidArgument("the qcow2 has a backing file: flatten it first (qemu-img convert)")
    vsize = info.virtual_size
    if vsize < 1 << 20 or vsize % 512:
        raise InvalidArgument(f"not a disk image: {vsize} bytes (at least 1 MiB of sectors)")
    if vsize > MAX_VIRTUAL_SIZE:
        raise InvalidArgument(f"the disk is {vsize >> 30} GiB; at most {MAX_VIRTUAL_SIZE >> 30}")
    if fmt == "qcow2":
        # 0 clean, 3 only leaked clusters; 1 (not checked), 2 (corrupt) and others refuse.
        r = subprocess.run(["qemu-img", "check", "-f", "qcow2", str(src)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode not in (0, 3):
            raise InvalidArgument(
                f"the qcow2 is truncated or corrupt: {_tail(r.stderr or r.stdout)}"
            )
    return fmt, vsize


def _convert(src: Path, fmt: str, dest: Path, out: str, pct: Callable[[int], None]) -> None:
    proc = subprocess.Popen(
        ["qemu-img", "convert", "-p", "-f", fmt, "-O", out, str(src), str(dest)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    buf = b""
    last = -1
    while chunk := os.read(proc.stdout.fileno(), 4096):
        buf = (buf + chunk)[-64:]
        m = re.findall(rb"\((\d+)\.\d+/100%\)", buf)
        if m and int(m[-1]) != last:
            last = int(m[-1])
            pct(last)
    err = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0:
        dest.unlink(missing_ok=True)
        if "No space left" in err:
            raise Unavailable(f"no space left for the import under {dest.parent}: {_tail(err)}")
        raise InvalidArgument(f"reading the disk image failed (truncated?): {_tail(err)}")


def _prepare(
    raw: Path, work: Path, bundle: Path, name: str, source: str, vsize: int, say: Progress
) -> VmImport:
    """Find the root, copy its kernel, build the initramfs, add the agent; on the raw copy."""
    mnt = work / "mnt"
    mnt.mkdir()
    say("looking for the root filesystem", 0, 0)
    parts = _partitions(raw) or [(0, 0, 0)]  # no table: the whole disk
    seen: list[str] = []
    for index, offset, size in parts:
        with _loop(raw, offset, size) as dev:
            fstype = _blkid(dev)
            seen.append(f"{f'partition {index}' if index else 'whole disk'}: {fstype or '?'}")
            if fstype not in ROOT_FILESYSTEMS:
                continue
            with _mounted(dev, mnt, fstype, ro=True):
                if not _is_root(mnt):
                    continue
                init = _guest_path(mnt, "/sbin/init")
                if not init.exists() or init.name != "systemd":
                    what = "missing" if not init.exists() else f"{init.relative_to(mnt)}"
                    raise InvalidArgument(
                        f"no systemd: /sbin/init is {what}; the vm backend runs its agent as "
                        "a systemd service"
                    )
                version, kernel = _kernel(mnt)
                moddir = _guest_path(mnt, f"/lib/modules/{version}")
                say("building the initramfs from the image's modules", 0, 0)
                order = _boot_modules(moddir, ROOT_FILESYSTEMS[fstype][1], version)
                vm_image.write_initramfs(moddir, order, work / "initrd.img")
                shutil.copyfile(kernel, work / "vmlinuz")
                os_name = _os_name(mnt)
                _remount_rw(mnt)
                say("installing the agent", 0, 0)
                _inject(mnt, bundle)
        return VmImport(
            name=name,
            root=f"/dev/vda{index}" if index else "/dev/vda",
            fstype=ROOT_FILESYSTEMS[fstype][0],
            kernel_version=version,
            os_name=os_name,
            source=source,
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            size=0,
            virtual_size=vsize,
        )
    if seen == ["whole disk: ?"]:
        raise InvalidArgument("not a disk image: no partition table and no filesystem found")
    raise InvalidArgument(f"no Linux root filesystem found ({'; '.join(seen)})")


def _is_root(mnt: Path) -> bool:
    return any(_guest_path(mnt, p).is_file() for p in ("/etc/os-release", "/usr/lib/os-release"))


def _kernel(mnt: Path) -> tuple[str, Path]:
    """The newest ``/boot/vmlinuz-VERSION`` that has ``/lib/modules/VERSION``."""
    boot = _guest_path(mnt, "/boot")
    found = []
    for k in boot.glob("vmlinuz-*") if boot.is_dir() else ():
        version = k.name.removeprefix("vmlinuz-")
        path = _guest_path(mnt, f"/boot/{k.name}")
        if (
            path.is_file()
            and (_guest_path(mnt, f"/lib/modules/{version}") / "modules.dep").exists()
        ):
            found.append((_version_key(version), version, path))
    if not found:
        raise InvalidArgument(
            "no kernel: the root filesystem has no /boot/vmlinuz-VERSION with "
            "/lib/modules/VERSION (a separate /boot partition is not supported)"
        )
    _, version, path = max(found)
    return version, path


def _version_key(version: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"[.\-+~]", version))


def _boot_modules(moddir: Path, fs_module: str, version: str) -> list[str]:
    builtin = {
        vm_image.module_name(line)
        for line in _read(moddir / "modules.builtin").splitlines()
        if line.strip()
    }
    dep = _read(moddir / "modules.dep")
    have = {vm_image.module_name(line.partition(":")[0]) for line in dep.splitlines()}
    wanted = [m for m in OPTIONAL_MODULES if m in have]
    for m in (*DRIVERS, fs_module):
        if m not in have and m not in builtin:
            raise InvalidArgument(f"kernel {version} has no {m} driver (needed to boot on QEMU)")
        wanted.append(m)
    try:
        return vm_image.module_order(dep, wanted, builtin=tuple(builtin))
    except Internal as exc:
        raise InvalidArgument(f"kernel {version}: {exc.message}") from None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _os_name(mnt: Path) -> str:
    for p in ("/etc/os-release", "/usr/lib/os-release"):
        for line in _read(_guest_path(mnt, p)).splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.partition("=")[2].strip().strip("\"'")
    return "Linux"


def _inject(mnt: Path, bundle: Path) -> None:
    """The agent bundle at /.dsec, the channel multiplexer, the units (enabled) and the
    network script."""
    agent = _guest_path(mnt, "/.dsec", follow_last=False)
    _clear(agent)
    shutil.copytree(bundle, agent, symlinks=True)
    (agent / "run").mkdir(mode=0o755, exist_ok=True)
    _guest_path(mnt, "/root").mkdir(mode=0o700, exist_ok=True)
    _put(mnt, "/usr/local/sbin/dsec-net", vm_image.NET_SCRIPT, 0o755)
    with tempfile.TemporaryDirectory(prefix="dsec-vmport-") as tmp:
        program = build_vmport(Path(tmp) / "dsec-vmport").read_bytes()
    _put(mnt, vm_image.VMPORT_BIN, program, 0o755)
    for unit, text in vm_image.UNITS.items():
        _put(mnt, f"/etc/systemd/system/{unit}", text, 0o644)
        wanted_by = re.search(r"^WantedBy=(\S+)", text, re.M)
        if wanted_by:
            wants = _guest_path(mnt, f"/etc/systemd/system/{wanted_by.group(1)}.wants")
            wants.mkdir(parents=True, exist_ok=True)
            _clear(wants / unit)
            (wants / unit).symlink_to(f"/etc/systemd/system/{unit}")
    if _guest_path(mnt, "/etc/cloud").is_dir():
        _put(mnt, "/etc/cloud/cloud-init.disabled", "disabled by dsec image import-vm\n", 0o644)


def _put(mnt: Path, path: str, content: str | bytes, mode: int) -> None:
    parent = _guest_path(mnt, os.path.dirname(path))
    parent.mkdir(parents=True, exist_ok=True)
    dest = parent / os.path.basename(path)
    _clear(dest)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)
    os.chmod(dest, mode)


def _clear(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _guest_path(mnt: Path, path: str, *, follow_last: bool = True) -> Path:
    """``path`` of the guest whose root is mounted at ``mnt``, as a host path: symlinks
    resolved the way the guest would (absolute targets from its root, ``..`` stops at
    it), so nothing in the image can point the importer at a host file."""
    todo = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        host = mnt.joinpath(*done, part)
        if (todo or follow_last) and host.is_symlink():
            hops += 1
            if hops > 40:
                raise InvalidArgument(f"too many symlinks resolving {path} in the image")
            target = os.readlink(host)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p not in ("", ".")] + todo
            continue
        done.append(part)
    return mnt.joinpath(*done)


@contextlib.contextmanager
def _loop(raw: Path, offset: int = 0, size: int = 0) -> Iterator[str]:
    """A loop device on ``raw`` (a byte range of it with ``size``); detached after."""
    argv = ["losetup", "--find", "--show"]
    if size:
        argv += ["--offset", str(offset), "--sizelimit", str(size)]
    r = subprocess.run([*argv, str(raw)], capture_output=True, text=True)
    if r.returncode != 0:
        raise Internal(f"losetup failed: {_tail(r.stderr)}")
    dev = r.stdout.strip()
    try:
        yield dev
    finally:
        for _ in range(20):
            d = subprocess.run(["losetup", "-d", dev], capture_output=True, text=True)
            if d.returncode == 0 or not _attached(dev, raw):
                break
            time.sleep(0.25)


def _attached(dev: str, raw: Path) -> bool:
    r = subprocess.run(["losetup", "-n", "-O", "BACK-FILE", dev], capture_output=True, text=True)
    return r.returncode == 0 and str(raw) in r.stdout


def _partitions(raw: Path) -> list[tuple[int, int, int]]:
    """(number, byte offset, byte size) of each partition of the disk; [] when it has no
    partition table. Read with ``partx`` rather than ``losetup --partscan``: partition
    devices of loop devices do not appear on every kernel (nor in every container)."""
    r = subprocess.run(["partx", "-g", "-b", "-o", "NR,START,SECTORS", str(raw)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        return []
    parts = []
    for line in r.stdout.splitlines():
        nr, start, sectors = (int(x) for x in line.split())
        if sectors > 0:
            parts.append((nr, start * 512, sectors * 512))
    return parts


def _blkid(dev: str) -> str:
    r = subprocess.run(["blkid", "-p", "-o", "value", "-s", "TYPE", dev],
                       capture_output=True, text=True)  # fmt: skip
    return r.stdout.strip() if r.returncode == 0 else ""


@contextlib.contextmanager
def _mounted(dev: str, mnt: Path, fstype: str, *, ro: bool) -> Iterator[None]:
    opts = "ro" if ro else "rw"
    r = subprocess.run(["mount", "-t", fstype, "-o", f"{opts},nodev,nosuid", dev, str(mnt)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise InvalidArgument(
            f"cannot mount the {fstype} filesystem of the image: {_tail(r.stderr)}"
        )
    try:
        yield
    finally:
        u = subprocess.run(["umount", str(mnt)], capture_output=True, text=True)
        if u.returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _remount_rw(mnt: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,rw", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        raise InvalidArgument(f"cannot write to the image's root filesystem: {_tail(r.stderr)}")


@contextlib.contextmanager
def _lock(data: Path) -> Iterator[None]:
    root = imports_root(data)
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _tail(text: str) -> str:
    return text.strip()[-500:]
