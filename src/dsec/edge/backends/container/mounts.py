"""mount(2) and umount2(2) through ctypes, and a parser for ``/proc/self/mountinfo``.

The container backend mounts overlays and bind mounts itself instead of running the
``mount`` binaries: a syscall costs microseconds, a subprocess milliseconds, and errors come
back as an errno instead of a message to parse.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20

MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mount.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_char_p,
        ]
        lib.mount.restype = ctypes.c_int
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.umount2.restype = ctypes.c_int
        _libc = lib
    return _libc


def _b(value: str | os.PathLike[str] | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def mount(
    source: str | os.PathLike[str] | None,
    target: str | os.PathLike[str],
    fstype: str | None,
    flags: int = 0,
    data: str | None = None,
) -> None:
    """Call mount(2).

    Raises:
        OSError: with the errno the kernel returned.
    """
    rc = _lib().mount(_b(source), _b(target), _b(fstype), flags, _b(data))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}", os.fspath(target))


def umount(target: str | os.PathLike[str], flags: int = 0) -> None:
    """Call umount2(2).

    Raises:
        OSError: with the errno the kernel returned (EINVAL: not a mount point).
    """
    rc = _lib().umount2(_b(target), flags | UMOUNT_NOFOLLOW)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}", os.fspath(target))


def umount_all(target: Path) -> bool:
    """Unmount every mount stacked on ``target``; lazily if one is busy.

    Returns:
        True if something was unmounted. A path that is not a mount point (or does not
        exist) is not an error, which makes this safe to repeat.
    """
    did = False
    for _ in range(16):  # a path can carry a few stacked mounts; never loop forever
        try:
            umount(target)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOENT):
                return did
            if exc.errno != errno.EBUSY:
                raise
            umount(target, MNT_DETACH)
        did = True
    return did


@dataclass(frozen=True, slots=True)
class MountEntry:
    """One line of mountinfo."""

    mount_id: int
    parent_id: int
    root: str
    mount_point: str
    options: str
    propagation: tuple[str, ...]  # e.g. ("shared:3",) or ("master:1",); empty if private
    fstype: str
    source: str

    @property
    def shared_group(self) -> int | None:
        return _tag(self.propagation, "shared:")

    @property
    def master_group(self) -> int | None:
        return _tag(self.propagation, "master:")


def _tag(tags: tuple[str, ...], prefix: str) -> int | None:
    for t in tags:
        if t.startswith(prefix):
            return int(t[len(prefix) :])
    return None


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    if "\\" not in field:
        return field
    out = bytearray()
    raw = field.encode()
    i = 0
    while i < len(raw):
        if raw[i] == 0x5C and i + 3 < len(raw) and raw[i + 1 : i + 4].isdigit():
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode(errors="surrogateescape")


def parse_mountinfo(text: str) -> list[MountEntry]:
    """Parse the text of a mountinfo file (see proc(5))."""
    out: list[MountEntry] = []
    for line in text.splitlines():
        parts = line.split(" ")
        if len(parts) < 10 or "-" not in parts[6:]:
            continue
        sep = parts.index("-", 6)
        out.append(
            MountEntry(
                mount_id=int(parts[0]),
                parent_id=int(parts[1]),
                root=_unescape(parts[3]),
                mount_point=_unescape(parts[4]),
                options=parts[5],
                propagation=tuple(parts[6:sep]),
                fstype=parts[sep + 1],
                source=_unescape(parts[sep + 2]),
            )
        )
    return out


def read_mountinfo(path: Path = Path("/proc/self/mountinfo")) -> list[MountEntry]:
    """Return the mounts of this process's mount namespace."""
    return parse_mountinfo(path.read_text())


def mounts_at(target: Path, entries: list[MountEntry] | None = None) -> list[MountEntry]:
    """Return the mounts whose mount point is exactly ``target``, bottom first."""
    entries = read_mountinfo() if entries is None else entries
    t = os.fspath(target)
    return [e for e in entries if e.mount_point == t]


def mounts_under(target: Path, entries: list[MountEntry] | None = None) -> list[MountEntry]:
    """Return the mounts at ``target`` or below it."""
    entries = read_mountinfo() if entries is None else entries
    t = os.fspath(target).rstrip("/")
    return [e for e in entries if e.mount_point == t or e.mount_point.startswith(t + "/")]


def containing_mount(path: Path, entries: list[MountEntry] | None = None) -> MountEntry | None:
    """Return the (top-most) mount that ``path`` lives on."""
    entries = read_mountinfo() if entries is None else entries
    p = os.fspath(path)
    best: MountEntry | None = None
    for e in entries:
        mp = e.mount_point
        if (p == mp or p.startswith(mp.rstrip("/") + "/")) and (
            best is None or len(mp) >= len(best.mount_point)
        ):
            best = e
    return best
