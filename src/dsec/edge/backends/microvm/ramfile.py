"""Guest RAM files on tmpfs: their holes, the pages a VMM wrote over them, punching.

A page of a RAM file is either data or a hole (never touched: it costs no memory). Reading
a hole through a mapping allocates it (tmpfs has no shared zero page for file mappings), so
a QEMU that reads all guest RAM (a migration) fills every hole with a zero page. These
helpers give such pages back without reading them: the caller notes the holes, and which of
those pages the VMM wrote (``/proc/<pid>/pagemap``), before, and punches the rest after.
"""

from __future__ import annotations

import bisect
import ctypes
import os
from pathlib import Path

from dsec.edge.backends.microvm.snapshots import PAGE, data_extents

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def holes(path: Path) -> list[tuple[int, int]]:
    """``(start, end)`` of every hole of ``path`` (page-aligned on tmpfs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        out: list[tuple[int, int]] = []
        pos = 0
        for start, end in data_extents(fd, size):
            if start > pos:
                out.append((pos, start))
            pos = end
        if pos < size:
            out.append((pos, size))
        return out
    finally:
        os.close(fd)


def private_pages(pid: int, path: Path, ranges: list[tuple[int, int]]) -> set[int]:
    """Offsets (in ``path``) of the pages in ``ranges`` that process ``pid``, which maps
    ``path`` copy-on-write, has written (its own anonymous copies, present or swapped),
    from ``/proc/<pid>/pagemap``: the pages it has not written read as ``path`` does."""
    base = _mapping_start(pid, path)
    out: set[int] = set()
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pm:
        for start, end in ranges:
            first = start // PAGE
            raw = os.pread(pm.fileno(), (end - start) // PAGE * 8, (base // PAGE + first) * 8)
            for i, e in enumerate(memoryview(raw).cast("Q")):
                # bit 63 present, 62 swapped, 61 a file page (the template's, not a copy)
                if e >> 62 and not e >> 61 & 1:
                    out.add((first + i) * PAGE)
    return out


def _mapping_start(pid: int, path: Path) -> int:
    """The address where ``pid`` maps ``path`` from offset 0."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == str(path) and int(parts[2], 16) == 0:
                return int(parts[0].split("-")[0], 16)
    raise OSError(f"process {pid} does not map {path}")


def punch_except(path: Path, ranges: list[tuple[int, int]], keep: set[int]) -> int:
    """Punch ``ranges`` of ``path`` except the pages at offsets ``keep`` (no page is
    read); returns the bytes punched."""
    freed = 0
    kept = sorted(keep)
    fd = os.open(path, os.O_RDWR)
    try:
        for start, end in ranges:
            run = start
            for off in kept[bisect.bisect_left(kept, start) : bisect.bisect_left(kept, end)]:
                if off > run:
                    punch(fd, run, off - run)
                    freed += off - run
                run = off + PAGE
            if end > run:
                punch(fd, run, end - run)
                freed += end - run
    finally:
        os.close(fd)
    return freed


def punch(fd: int, start: int, length: int) -> None:
    """Make ``[start, start+length)`` of the open file ``fd`` a hole (its size stays)."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, start, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE): {os.strerror(err)}")
