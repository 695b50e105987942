"""Named snapshot pieces without a platform: ids, records, names, and the RAM copy that
keeps holes (the end-to-end tests run the real thing: tests/e2e/test_snapshots.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.core import ids
from dsec.core.errors import InvalidArgument, SnapshotNotFound
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.microvm.backend import _copy_extents
from dsec.edge.named_snapshots import SnapshotRecord, validate_name


def test_snapshot_ids_name_their_edge_and_are_not_sandbox_ids() -> None:
    sid = ids.new_snapshot_id("e0a1", bytes(range(13)))
    assert sid.startswith("snp-e0a1-")
    assert len(sid) == 29
    assert ids.snapshot_edge_of(sid) == "e0a1"
    assert ids.is_snapshot_id(sid)
    assert not ids.is_sandbox_id(sid)
    assert not ids.is_snapshot_id(ids.new_sandbox_id("e0a1", bytes(range(13))))
    for bad in ("", "snp-e0a1", "sbx-e0a1-aaaaaaaaaaaaaaaaaaaa", "snp-e0a1-AAAAAAAAAAAAAAAAAAAA"):
        with pytest.raises(SnapshotNotFound):
            ids.snapshot_edge_of(bad)


def test_record_round_trips_through_json() -> None:
    rec = SnapshotRecord(
        id="snp-e0a1-aaaaaaaaaaaaaaaaaaaa", name="warm", project="acme/rl", owner="alice",
        source_sandbox="sbx-e0a1-bbbbbbbbbbbbbbbbbbbb", backend="microvm", mode="full",
        size_bytes=123, created_at=1.5, spec=SandboxSpec(backend="microvm", memory_mb=256),
    )  # fmt: skip
    assert SnapshotRecord.from_json(rec.to_json()) == rec


def test_names() -> None:
    assert validate_name("") == ""
    assert validate_name("team/my-snap:v1") == "team/my-snap:v1"
    for bad in ("-x", "a b", "x" * 129, "../x\n"):
        with pytest.raises(InvalidArgument):
            validate_name(bad)


def test_ram_copy_keeps_data_and_holes(tmp_path: Path) -> None:
    src = tmp_path / "ram"
    with open(src, "wb") as f:
        f.truncate(64 << 20)
        f.seek(1 << 20)
        f.write(b"a" * 4096)
        f.seek(40 << 20)
        f.write(os.urandom(8192))
    dst = tmp_path / "copy"
    with open(dst, "wb") as f:
        _copy_extents(src, f.fileno())
    assert dst.read_bytes() == src.read_bytes()
    assert dst.stat().st_blocks * 512 < 1 << 20  # the holes stayed holes
