"""Guest RAM files on tmpfs: where their holes are, and punching zero pages back to holes.

A page of a RAM file is either data or a hole (never touched: it costs no memory). Reading
a hole through a mapping allocates it (tmpfs has no shared zero page for file mappings), so
a QEMU that reads all guest RAM (a migration) fills every hole with a zero page. These
helpers give such pages back: the caller notes the holes before and punches the zero pages
there after.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from dsec.edge.backends.microvm.snapshots import PAGE, data_extents

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
CHUNK = 4 << 20
_ZERO_CHUNK = bytes(CHUNK)
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


def punch(fd: int, start: int, length: int) -> None:
    """Make ``[start, start+length)`` of the open file ``fd`` a hole (its size stays)."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, start, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE): {os.strerror(err)}")


def punch_zero_pages(path: Path, ranges: list[tuple[int, int]]) -> int:
    """Punch every allocated all-zero page of ``path`` inside ``ranges`` (holes are not
    read); returns the bytes freed."""
    freed = 0
    fd = os.open(path, os.O_RDWR)
    try:
        extents = list(data_extents(fd, os.fstat(fd).st_size))
        for start, end in _overlap(ranges, extents):
            off = start
            while off < end:
                data = os.pread(fd, min(CHUNK, end - off), off)
                if not data:
                    break
                for z0, z1 in _zero_runs(data):
                    punch(fd, off + z0, z1 - z0)
                    freed += z1 - z0
                off += len(data)
    finally:
        os.close(fd)
    return freed


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The intersection of two sorted lists of disjoint ``(start, end)`` ranges."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _zero_runs(data: bytes) -> list[tuple[int, int]]:
    """``(start, end)`` of the runs of all-zero whole pages in ``data``."""
    if data == _ZERO_CHUNK[: len(data)]:
        return [(0, len(data) - len(data) % PAGE)] if len(data) >= PAGE else []
    mv = memoryview(data)
    zero = _ZERO_CHUNK[:PAGE]
    runs: list[tuple[int, int]] = []
    run = -1
    last = len(data) - len(data) % PAGE
    for i in range(0, last, PAGE):
        if mv[i : i + PAGE] == zero:
            if run < 0:
                run = i
        elif run >= 0:
            runs.append((run, i))
            run = -1
    if run >= 0:
        runs.append((run, last))
    return runs
