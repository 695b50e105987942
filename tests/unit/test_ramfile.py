"""RAM file helpers: holes found, zero pages punched back to holes (data kept)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.edge.backends.microvm import ramfile

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


def test_zero_pages_inside_the_ranges_are_punched_and_data_stays(ram: Path) -> None:
    _write(ram, 0, bytes(20 * P))  # zero pages, allocated (what a migration leaves)
    _write(ram, 5, b"a" * P)
    _write(ram, 30, bytes(4 * P))  # zero, outside the ranges below: stays allocated
    before = _allocated(ram)
    freed = ramfile.punch_zero_pages(ram, [(0, 20 * P)])
    assert freed == 19 * P
    assert _allocated(ram) == before - 19 * P
    assert ramfile.holes(ram)[:2] == [(0, 5 * P), (6 * P, 30 * P)]
    data = ram.read_bytes()
    assert data[5 * P : 6 * P] == b"a" * P
    assert data.count(0) == len(data) - P
    assert ramfile.punch_zero_pages(ram, [(0, 20 * P)]) == 0  # holes read as zero: no-op


def test_zero_runs_split_at_data() -> None:
    data = bytes(P) + b"z" + bytes(P - 1) + bytes(3 * P)
    assert ramfile._zero_runs(data) == [(0, P), (2 * P, 5 * P)]
    assert ramfile._zero_runs(bytes(2 * P + 10)) == [(0, 2 * P)]


def test_overlap_of_range_lists() -> None:
    a = [(0, 10), (20, 30), (40, 50)]
    b = [(5, 25), (28, 45)]
    assert ramfile._overlap(a, b) == [(5, 10), (20, 25), (28, 30), (40, 45)]
    assert ramfile._overlap(a, []) == []


def test_punched_named_snapshot_ram_is_restamped_and_still_verifies(
    ram: Path, tmp_path: Path
) -> None:
    from dsec.edge.backends.microvm import snapshots
    from dsec.edge.backends.microvm.vmm import Snapshot

    _write(ram, 2, b"r" * P)
    _write(ram, 7, bytes(P))  # a zero page a migration filled in
    (tmp_path / "state").write_bytes(b"s")
    (tmp_path / "qemu.json").write_text("{}")
    snap = Snapshot(dir=tmp_path, mem_file=ram, state=tmp_path / "state")
    snapshots.write_manifest(snap)
    assert snapshots.ram_unchanged(snap)
    assert ramfile.punch_zero_pages(ram, [(0, 64 * P)]) == P
    assert not snapshots.ram_unchanged(snap)
    snapshots.restamp_ram(snap)
    assert snapshots.ram_unchanged(snap)
    snapshots.verify(snap, trust_stamps=False)  # the digest ignores zero pages
