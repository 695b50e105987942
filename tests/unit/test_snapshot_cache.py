"""Snapshot copies kept on the target by digest (a second copy sends nothing but the
manifest), the export of a paused sandbox's pause snapshot, and the one ``qemu-img info``
helper; real qemu-img, files only."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from dsec.core.errors import InvalidArgument
from dsec.edge.backends.microvm import snapshot_copy as sc
from dsec.edge.backends.microvm import snapshots
from dsec.edge.backends.microvm.disk_info import disk_info
from dsec.edge.backends.microvm.snapshot_cache import SnapshotCache
from dsec.edge.backends.microvm.snapshots import SnapshotCorrupt
from dsec.edge.backends.microvm.vmm import Snapshot
from tests.unit.test_snapshot_copy import MIB, _img, _send, _source

pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")


def _importer(root: Path, manifest: dict[str, Any], copy_id: str, *, max_bytes: int = 1 << 30,
              keep: bool = True) -> sc.Importer:  # fmt: skip
    templates = root / "vm-templates"
    templates.mkdir(parents=True, exist_ok=True)
    (root / "shm").mkdir(exist_ok=True)
    cache = SnapshotCache(root / "vm-cache", root / "shm", max_bytes)
    imp = sc.Importer(copy_id=copy_id, manifest=manifest, templates_dir=templates,
                      mem_dir=root / "shm", bases_dir=root / "vm-bases", cache=cache,
                      keep=keep, source="snp-a-1")  # fmt: skip
    imp.plan()
    return imp


def _verified(copy_dir: Path, copy_mem: Path) -> None:
    snap = Snapshot(dir=copy_dir, mem_file=copy_mem, state=copy_dir / "state")
    snapshots.verify(snap, trust_stamps=False)


def test_a_second_copy_sends_nothing_and_the_cache_goes_with_its_snapshot(
    tmp_path: Path,
) -> None:
    tdir, mem, templates, meta = _source(tmp_path / "a")
    exp = sc.export_manifest(tdir, mem, templates, meta)
    dst = tmp_path / "b"
    first = _importer(dst, exp.manifest, "snp-b-1")
    assert {"ram", "snap/state", "tpl/sbx-a-tpl1/scratch.qcow2"} <= set(first.want)
    assert _send(exp, first) > MIB
    d1, m1 = first.commit("sbx-a-src", "sbx-a-src")
    _verified(d1, m1)
    cache = first.cache
    assert cache is not None
    assert (dst / "shm" / f"cache-{exp.manifest['files']['ram']['sha256']}.mem").exists()
    assert cache.total_bytes() > MIB

    second = _importer(dst, exp.manifest, "snp-b-2")
    assert second.want == []  # only the manifest went over
    assert sorted(second.cached) == ["ram", *(f"snap/{n}" for n in sorted(sc.SNAP_FILES))]
    assert _send(exp, second) == 0
    d2, m2 = second.commit("sbx-a-src", "sbx-a-src")
    _verified(d2, m2)
    assert os.path.samefile(m1, m2)  # the RAM is one file, linked
    assert not os.path.samefile(d1 / "scratch.qcow2", d2 / "scratch.qcow2")  # rebased apart
    assert sc.qcow2_backing(d2 / "scratch.qcow2") == sc.qcow2_backing(d1 / "scratch.qcow2")
    assert not second.staging.exists()
    assert not second.staging_mem.exists()

    # the source snapshot is deleted: its cached files go (the copies keep their links)
    assert cache.drop_source("snp-a-1") == 5
    assert cache.total_bytes() == 0
    assert [p.name for p in (dst / "shm").glob("cache-*")] == []
    assert [p.name for p in (dst / "vm-cache").iterdir()] == ["index.json"]
    _verified(d2, m2)
    third = _importer(dst, exp.manifest, "snp-b-3")
    assert "ram" in third.want


def test_the_cache_stays_within_its_bound_and_a_moved_sandbox_is_not_kept(
    tmp_path: Path,
) -> None:
    tdir, mem, templates, meta = _source(tmp_path / "a")
    exp = sc.export_manifest(tdir, mem, templates, meta)
    dst = tmp_path / "b"
    moved = _importer(dst, exp.manifest, "snp-b-1", keep=False)
    _send(exp, moved)
    moved.commit("sbx-a-src", "sbx-a-src")
    assert not list((dst / "shm").glob("cache-*"))
    kept = _importer(dst, exp.manifest, "snp-b-2")
    _send(exp, kept)
    kept.commit("sbx-a-src", "sbx-a-src")
    assert kept.cache is not None
    total = kept.cache.total_bytes()
    # one byte under: the least recently used file (the RAM, kept first) goes, alone
    small = SnapshotCache(kept.cache.dir, kept.cache.mem_dir, total - 1)
    assert small.trim() == 1
    assert not list((dst / "shm").glob("cache-*"))
    assert 0 < small.total_bytes() < total
    off = _importer(dst, exp.manifest, "snp-b-3", max_bytes=0)
    assert "ram" in off.want
    assert off.cached == {}


def test_a_paused_sandbox_is_exported_from_its_own_disks(tmp_path: Path) -> None:
    """The pause snapshot (state, qemu.json, manifest) sits in ``snapshots/current``; the
    config disk and disk layer are the sandbox's own."""
    tdir, mem, templates, meta = _source(tmp_path / "a")
    sd = tmp_path / "a" / "edge" / "sandboxes" / "sbx-a-paused"
    cur = sd / "snapshots" / "current"
    cur.mkdir(parents=True)
    for name in ("state", "qemu.json", snapshots.MANIFEST):
        shutil.move(tdir / name, cur / name)
    for name in ("config.img", "scratch.qcow2"):
        shutil.move(tdir / name, sd / name)
    exp = sc.export_manifest(cur, mem, templates, {**meta, "paused": True}, disk_dir=sd)
    assert exp.path("snap/scratch.qcow2") == sd / "scratch.qcow2"
    assert exp.path("snap/state") == cur / "state"
    assert exp.manifest["files"]["snap/scratch.qcow2"]["backing"] == "tpl/sbx-a-tpl1/scratch.qcow2"
    dst = tmp_path / "b"
    imp = _importer(dst, exp.manifest, "snp-b-1", keep=False)
    _send(exp, imp)
    d, m = imp.commit("sbx-a-paused", "sbx-a-paused")
    _verified(d, m)
    assert json.loads((d / "vm.json").read_text())["paused"] is False


def test_disk_info_reads_format_size_and_backing_or_raises_the_callers_error(
    tmp_path: Path,
) -> None:
    base = tmp_path / "base.raw"
    with open(base, "wb") as f:
        f.truncate(2 * MIB)
    top = tmp_path / "top.qcow2"
    _img("create", "-q", "-f", "qcow2", "-b", str(base), "-F", "raw", str(top))
    info = disk_info(top, SnapshotCorrupt, "cannot read disk", shared=True)
    assert (info.format, info.virtual_size, info.backing) == ("qcow2", 2 * MIB, str(base))
    assert disk_info(base, InvalidArgument, "x").backing == ""
    with pytest.raises(InvalidArgument, match=r"^not a disk image: "):
        disk_info(tmp_path / "missing", InvalidArgument, "not a disk image")
    with pytest.raises(SnapshotCorrupt, match="cannot read disk"):
        disk_info(tmp_path / "missing", SnapshotCorrupt, "cannot read disk")
