"""RAM file helpers: holes found, pages a process wrote found, the rest punched unread."""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.edge.backends.microvm import ramfile, snapshots
from dsec.edge.backends.microvm.vmm import Snapshot

P = 4096


@pytest.fixture
def ram() -> Iterator[Path]:
    """A 64-page file on tmpfs (where RAM files live: holes are exact there)."""
    fd, name = tempfile.mkstemp(dir="/dev/shm", prefix="dsec-ramfile-test-")
    os.ftruncate(fd, 64 * P)
    os.close(fd)
    yield Path(name)
    Path(name).unlink(missing_ok=True)


def _write(path: Path, page: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, page * P)
    finally:
        os.close(fd)


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_holes_are_the_pages_never_written(ram: Path) -> None:
    assert ramfile.holes(ram) == [(0, 64 * P)]
    _write(ram, 3, b"x" * P)
    _write(ram, 10, b"y" * 2 * P)
    assert ramfile.holes(ram) == [(0, 3 * P), (4 * P, 10 * P), (12 * P, 64 * P)]


def test_private_pages_are_the_copies_a_process_wrote(ram: Path) -> None:
    """This process maps the file copy-on-write (as a fork child's QEMU does), reads some
    pages (they stay the file's) and writes others (its own copies)."""
    _write(ram, 1, b"t" * P)
    with open(ram, "r+b") as f:
        m = mmap.mmap(f.fileno(), 64 * P, flags=mmap.MAP_PRIVATE)
    try:
        assert m[1 * P] == ord("t")
        assert m[20 * P] == 0  # a read of a hole: the file's (zero) page
        m[5 * P] = 1
        m[6 * P + 100] = 2
        m[1 * P] = 3  # a template page written: a copy too
        written = ramfile.private_pages(os.getpid(), ram, [(0, 64 * P)])
        assert written == {1 * P, 5 * P, 6 * P}
        assert ramfile.private_pages(os.getpid(), ram, [(10 * P, 30 * P)]) == set()
    finally:
        m.close()
    with pytest.raises(OSError, match="does not map"):
        ramfile.private_pages(os.getpid(), ram, [(0, P)])


def test_punch_except_keeps_the_pages_named(ram: Path) -> None:
    _write(ram, 0, bytes(20 * P))  # allocated zero pages (what a migration leaves)
    _write(ram, 5, b"a" * P)
    _write(ram, 30, b"b" * P)  # outside the ranges below
    before = _allocated(ram)
    freed = ramfile.punch_except(ram, [(0, 20 * P)], keep={5 * P})
    assert freed == 19 * P
    assert _allocated(ram) == before - 19 * P
    assert ramfile.holes(ram)[:2] == [(0, 5 * P), (6 * P, 30 * P)]
    data = ram.read_bytes()
    assert data[5 * P : 6 * P] == b"a" * P
    assert data[30 * P : 31 * P] == b"b" * P


def test_punched_named_snapshot_ram_is_restamped_and_still_verifies(
    ram: Path, tmp_path: Path
) -> None:
    _write(ram, 2, b"r" * P)
    _write(ram, 7, bytes(P))  # a zero page a migration filled in
    (tmp_path / "state").write_bytes(b"s")
    (tmp_path / "qemu.json").write_text("{}")
    snap = Snapshot(dir=tmp_path, mem_file=ram, state=tmp_path / "state")
    snapshots.write_manifest(snap)
    assert snapshots.ram_unchanged(snap)
    assert ramfile.punch_except(ram, [(7 * P, 8 * P)], set()) == P
    assert not snapshots.ram_unchanged(snap)
    snapshots.restamp_ram(snap)
    assert snapshots.ram_unchanged(snap)
    snapshots.verify(snap, trust_stamps=False)  # the digest ignores zero pages
