"""Small fake Linux disks for the VM image import tests: a root tree that looks like
Debian's (os-release, /sbin/init as an absolute symlink, a kernel and its modules, ext4
built in, virtio_blk xz-compressed), as an ext4 filesystem, optionally inside an MBR."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

VERSION = "6.1.0-99-amd64"
MODULES = {
    "kernel/drivers/virtio/virtio_pci_modern_dev.ko": [],
    "kernel/drivers/virtio/virtio_pci.ko": ["kernel/drivers/virtio/virtio_pci_modern_dev.ko"],
    "kernel/drivers/block/virtio_blk.ko.xz": [],
    "kernel/drivers/char/virtio_console.ko": [],
}


def rootfs(d: Path, *, init: str = "/lib/systemd/systemd", kernel: bool = True) -> Path:
    """A tiny tree that looks like a Debian root: os-release, /sbin/init (an absolute
    symlink, as Debian's is), a kernel and its modules (ext4 built in, virtio_blk xz)."""
    import lzma

    (d / "etc").mkdir(parents=True)
    (d / "etc" / "os-release").write_text('PRETTY_NAME="Testian 1"\nID=testian\n')
    (d / "usr" / "lib" / "systemd").mkdir(parents=True)
    (d / "usr" / "lib" / "systemd" / "systemd").write_text("#!/bin/false\n")
    (d / "usr" / "sbin").mkdir(parents=True)
    (d / "usr" / "bin").mkdir(parents=True)
    (d / "usr" / "bin" / "other-init").write_text("#!/bin/false\n")
    (d / "lib").symlink_to("usr/lib")
    (d / "sbin").symlink_to("usr/sbin")
    (d / "usr" / "sbin" / "init").symlink_to(init)
    (d / "boot").mkdir()
    if kernel:
        (d / "boot" / f"vmlinuz-{VERSION}").write_bytes(b"kernel")
        (d / "boot" / "vmlinuz-5.10.0-1-amd64").write_bytes(b"old kernel, no modules")
        moddir = d / "usr" / "lib" / "modules" / VERSION
        for rel in MODULES:
            (moddir / rel).parent.mkdir(parents=True, exist_ok=True)
            blob = b"module " + rel.encode()
            (moddir / rel).write_bytes(lzma.compress(blob) if rel.endswith(".xz") else blob)
        dep = "".join(f"{rel}: {' '.join(deps)}\n" for rel, deps in MODULES.items())
        (moddir / "modules.dep").write_text(dep)
        (moddir / "modules.builtin").write_text("kernel/fs/ext4/ext4.ko\n")
    # A hostile link: writing through it must stay inside the image.
    (d / "etc" / "systemd").mkdir()
    (d / "etc" / "systemd" / "system").symlink_to("/../../../../tmp/../etc/systemd-in-guest")
    return d


def ext4(tree: Path, out: Path, size_mib: int = 64) -> Path:
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), str(out), f"{size_mib}M"],
                   check=True, capture_output=True)  # fmt: skip
    return out


def mbr(fs: Path, out: Path) -> Path:
    """``fs`` as partition 2 of an MBR disk (partition 1: 1 MiB of zeros, no filesystem)."""
    size = fs.stat().st_size
    first, start = 2048, 4096
    with out.open("wb") as f:
        f.truncate((start * 512) + size + (1 << 20))
        mbr = bytearray(512)
        for i, (lba, count, kind) in enumerate([(first, 2048, 0x83), (start, size // 512, 0x83)]):
            e = 446 + 16 * i
            mbr[e + 4] = kind
            mbr[e + 8 : e + 12] = lba.to_bytes(4, "little")
            mbr[e + 12 : e + 16] = count.to_bytes(4, "little")
        mbr[510:512] = b"\x55\xaa"
        f.write(mbr)
        f.seek(start * 512)
        with fs.open("rb") as src:
            shutil.copyfileobj(src, f)
    return out


def bundle(d: Path) -> Path:
    d.mkdir()
    (d / "init").write_text("agent\n")
    return d


LINUX_FS = "0fc63daf-8483-4772-8e79-3d69d8477de4"
EFI_SYSTEM = "c12a7328-f81f-11d2-ba4b-00a0c93ec93b"


GPT_ROOT_OFFSET = 4096 * 512


def gpt(fs: Path, out: Path, *, fill: bool = True) -> Path:
    """``fs`` as partition 1 of a GPT disk with an empty EFI system partition 15, the
    layout of Debian's and Ubuntu's cloud images (primary and backup tables, CRCs); without
    ``fill`` only the tables are written (the caller copies ``fs`` to GPT_ROOT_OFFSET)."""
    import struct
    import uuid
    import zlib

    size = fs.stat().st_size
    esp_start, esp_count, root_start = 2048, 2048, 4096
    total = root_start + size // 512 + 2048
    last = total - 1
    entries = bytearray(128 * 128)
    for nr, kind, start, count, name in (
        (1, LINUX_FS, root_start, size // 512, "root"),
        (15, EFI_SYSTEM, esp_start, esp_count, "esp"),
    ):
        e = struct.pack("<16s16sQQQ72s", uuid.UUID(kind).bytes_le, uuid.uuid4().bytes_le,
                        start, start + count - 1, 0, name.encode("utf-16-le"))  # fmt: skip
        entries[(nr - 1) * 128 : nr * 128] = e
    crc_entries = zlib.crc32(entries)
    disk_guid = uuid.uuid4().bytes_le

    def header(current: int, backup: int, table: int) -> bytes:
        fields = [b"EFI PART", 0x00010000, 92, 0, 0, current, backup, 34, last - 33,
                  disk_guid, table, 128, 128, crc_entries]  # fmt: skip
        fmt = "<8sIIIIQQQQ16sQIII"
        crc = zlib.crc32(struct.pack(fmt, *fields))
        fields[3] = crc
        return struct.pack(fmt, *fields).ljust(512, b"\0")

    mbr = bytearray(512)
    mbr[446 + 4] = 0xEE
    mbr[446 + 8 : 446 + 12] = (1).to_bytes(4, "little")
    mbr[446 + 12 : 446 + 16] = min(total - 1, 0xFFFFFFFF).to_bytes(4, "little")
    mbr[510:512] = b"\x55\xaa"
    with out.open("wb") as f:
        f.truncate(total * 512)
        f.write(mbr + header(1, last, 2) + entries)
        f.seek((last - 32) * 512)
        f.write(entries + header(last, 1, last - 32))
        if fill:
            f.seek(root_start * 512)
            with fs.open("rb") as src:
                shutil.copyfileobj(src, f)
    return out
