"""Block images a microVM boots from: shared read-only ones, and the per-VM ones.

Shared (built once, then used by every VM, never written):

* ``<layer dir>.erofs``: one erofs image per unpacked image layer, next to the layer;
* ``<data>/vm/bundle-<stamp>.erofs``: the agent bundle;
* ``<data>/vm/initramfs-<hash>.cpio``: just ``/init`` (``guest/vminit.c`` and
  ``guest/vmport.c``, static);
* ``<data>/vm/scratch-base.ext4``: an empty sparse ext4 the writable layers start from.

Per VM: ``scratch.qcow2`` (a copy-on-write overlay on the empty base: ~20 ms to make,
and a fork child's overlay is backed by its parent's) and ``config.img`` (the raw
key=value block vminit reads: sandbox id, environment, layer count).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from dsec.core.errors import Internal, InvalidArgument

GUEST_DIR = Path(__file__).parent / "guest"
SCRATCH_SIZE = "16G"  # sparse: only what the guest writes takes space
CONFIG_MAGIC = b"DSECCFG\0"
CONFIG_MAX = 256 * 1024


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise Internal(f"{argv[0]} failed: {(r.stderr or r.stdout).strip()[-2000:]}")


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def erofs_of(src: Path, dest: Path) -> Path:
    """``dest``, an erofs image of directory ``src`` (made once; atomic; xattrs kept)."""
    if dest.exists():
        return dest
    with _lock(dest):
        if dest.exists():
            return dest
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        try:
            _run(["mkfs.erofs", "--quiet", str(tmp), str(src)])
            tmp.rename(dest)
        finally:
            tmp.unlink(missing_ok=True)
    return dest


def layer_image(layer_dir: Path) -> Path:
    return erofs_of(layer_dir, layer_dir.with_name(layer_dir.name + ".erofs"))


def bundle_image(bundle: Path, vm_dir: Path) -> Path:
    stamp = (bundle / ".stamp").read_text().strip() if (bundle / ".stamp").exists() else ""
    if not stamp:
        raise Internal(f"the agent bundle in {bundle} has no stamp: run `dsec setup`")
    return erofs_of(
        bundle, vm_dir / f"bundle-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.erofs"
    )


def initramfs(vm_dir: Path) -> Path:
    """The initramfs holding only ``/init`` (vminit with the channel multiplexer vmport
    linked in, compiled statically)."""
    srcs = [GUEST_DIR / "vminit.c", GUEST_DIR / "vmport.c"]
    key = hashlib.sha256(b"".join(s.read_bytes() for s in srcs)).hexdigest()[:16]
    dest = vm_dir / f"initramfs-{key}.cpio"
    if dest.exists():
        return dest
    with _lock(dest):
        if dest.exists():
            return dest
        with tempfile.TemporaryDirectory(dir=vm_dir) as tmp:
            dirs = [(d, 0o040755, b"") for d in ("dev", "proc", "sys", "mnt", "newroot")]
            data = newc_archive([*dirs, ("init", 0o100755, static_program(srcs))])
            part = Path(tmp) / "out.cpio"
            part.write_bytes(data)
            part.rename(dest)
    return dest


def build_vmport(dest: Path, *flags: str) -> Path:
    """``guest/vmport.c`` as a program of its own (static: it runs in any guest root):
    without arguments the guest's multiplexer (the full VM's image runs it as a systemd
    service), with ``--link-fd``/``--listen-fd`` one link for the tests."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(static_program([GUEST_DIR / "vmport.c"], "-Wall", *flags, "-DVMPORT_CLI"))
    dest.chmod(0o755)
    return dest


def static_program(srcs: list[Path], *flags: str) -> bytes:
    """``gcc -static -O2 -s`` of ``srcs``: compiled once per process for the same sources
    (by content) and flags, so every VM image import after the first reuses it."""
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in srcs)).hexdigest()
    return _compiled(tuple(srcs), digest, flags)


@functools.cache
def _compiled(srcs: tuple[Path, ...], digest: str, flags: tuple[str, ...]) -> bytes:
    with tempfile.TemporaryDirectory(prefix="dsec-gcc-") as tmp:
        out = Path(tmp) / "program"
        _run(["gcc", "-static", "-O2", "-s", *flags, "-o", str(out), *map(str, srcs)])
        return out.read_bytes()


def newc_archive(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio "newc" archive (what the kernel unpacks as initramfs) of ``entries``."""
    out = bytearray()

    def add(ino: int, name: str, mode: int, data: bytes) -> None:
        nm = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nm), 0]
        out.extend(b"070701" + b"".join(b"%08X" % v for v in fields) + nm)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(data)
        out.extend(b"\0" * (-len(out) % 4))

    for i, (name, mode, data) in enumerate(entries, start=1):
        add(i, name, mode, data)
    add(0, "TRAILER!!!", 0, b"")
    out.extend(b"\0" * (-len(out) % 512))
    return bytes(out)


def scratch_base(vm_dir: Path) -> Path:
    """The empty ext4 every writable layer starts from (sparse, made once)."""
    dest = vm_dir / "scratch-base.ext4"
    if dest.exists():
        return dest
    with _lock(dest):
        if dest.exists():
            return dest
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        try:
            with tempfile.TemporaryDirectory(dir=vm_dir) as skel:
                for sub in ("upper", "work"):
                    (Path(skel) / sub).mkdir()
                _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "root_owner=0:0",
                      "-d", skel, str(tmp), SCRATCH_SIZE])  # fmt: skip
            tmp.rename(dest)
        finally:
            tmp.unlink(missing_ok=True)
    return dest


def make_overlay(base: Path, dest: Path, base_format: str = "raw") -> Path:
    """A qcow2 at ``dest`` whose reads fall through to ``base`` (never written)."""
    _run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base.resolve()), "-F",
          base_format, str(dest)])  # fmt: skip
    return dest


def write_config(dest: Path, values: Mapping[str, str]) -> Path:
    """The raw config disk vminit reads (key=value entries, NUL-separated)."""
    out = bytearray(CONFIG_MAGIC)
    for k, v in values.items():
        entry = f"{k}={v}".encode()
        if b"\0" in entry or "=" in k or not k:
            raise InvalidArgument(f"environment entry {k!r} cannot be passed to a microVM")
        out += entry + b"\0"
    out += b"\0"
    if len(out) > CONFIG_MAX:
        raise InvalidArgument("the sandbox environment is too large for a microVM")
    out += b"\0" * (-len(out) % 512)
    dest.write_bytes(bytes(out))
    return dest


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
