"""Copying a microVM snapshot between edges, file level: the transfer manifest, chunking,
digest checks, backing-chain rebase (real qemu-img) and that a refused copy leaves nothing."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dsec.core.errors import InvalidArgument
from dsec.edge.backends.microvm import snapshot_copy as sc
from dsec.edge.backends.microvm import snapshots
from dsec.edge.backends.microvm.vmm import Snapshot

pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")
MIB = 1 << 20


def _img(*args: str) -> None:
    subprocess.run(["qemu-img", *args], check=True, capture_output=True)


def _write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _io(disk: Path, offset: int, byte: str) -> None:
    """Write 64 KiB of ``byte`` into qcow2 ``disk`` at ``offset`` through its chain."""
    subprocess.run(["qemu-io", "-f", "qcow2", "-c", f"write -P {byte} {offset} 64k", str(disk)],
                   check=True, capture_output=True)  # fmt: skip


def _source(root: Path) -> tuple[Path, Path, Path, dict[str, Any]]:
    """A source edge's snapshot: bases, a fork template, the snapshot's own files."""
    base = root / "data"
    base.mkdir(parents=True)
    (base / "vmlinux").write_bytes(os.urandom(300_000))
    (base / "bundle.erofs").write_bytes(os.urandom(200_000))
    (base / "initrd.cpio").write_bytes(os.urandom(10_000))
    (base / "l0.erofs").write_bytes(os.urandom(500_000))
    scratch_base = base / "scratch-base.ext4"
    with open(scratch_base, "wb") as f:
        f.truncate(64 * MIB)
    _write_at(scratch_base, 1 * MIB, b"ext4 superblock-ish" * 100)
    templates = root / "edge" / "vm-templates"
    tpl = templates / "sbx-a-tpl1"
    tpl.mkdir(parents=True)
    _img("create", "-q", "-f", "qcow2", "-b", str(scratch_base), "-F", "raw",
         str(tpl / "scratch.qcow2"))  # fmt: skip
    _io(tpl / "scratch.qcow2", 4 * MIB, "0x41")
    tdir = templates / "snp-a-1"
    tdir.mkdir()
    _img("create", "-q", "-f", "qcow2", "-b", str(tpl / "scratch.qcow2"), "-F", "qcow2",
         str(tdir / "scratch.qcow2"))  # fmt: skip
    _io(tdir / "scratch.qcow2", 8 * MIB, "0x42")
    (tdir / "state").write_bytes(os.urandom(3 * MIB + 17))
    (tdir / "qemu.json").write_text(json.dumps({"ignore_shared": True}))
    (tdir / "config.img").write_bytes(b"DSECCFG\0" + b"\0" * 504)
    mem_dir = root / "shm"
    mem_dir.mkdir()
    mem = mem_dir / "tpl-snp-a-1.mem"
    with open(mem, "wb") as f:
        f.truncate(32 * MIB)
    _write_at(mem, 0, os.urandom(MIB))
    _write_at(mem, 20 * MIB, os.urandom(5000))
    snapshots.write_manifest(Snapshot(dir=tdir, mem_file=mem, state=tdir / "state"))
    meta = {"vcpus": 1, "memory_mib": 32, "kernel": str(base / "vmlinux"), "layers": 1,
            "shared": {"bundle": str(base / "bundle.erofs"), "initrd": str(base / "initrd.cpio"),
                       "scratch_base": str(scratch_base), "l0": str(base / "l0.erofs")},
            "vmm": "qemu", "net": {}, "templates": ["sbx-a-tpl1", "snp-a-1"],
            "agent_socket": "/nonexistent/a.sock"}  # fmt: skip
    (tdir / "vm.json").write_text(json.dumps(meta))
    return tdir, mem, templates, meta


def _importer(root: Path, manifest: dict[str, Any], copy_id: str = "snp-b-1") -> sc.Importer:
    templates = root / "vm-templates"
    templates.mkdir(parents=True, exist_ok=True)
    (root / "shm").mkdir(exist_ok=True)
    imp = sc.Importer(copy_id=copy_id, manifest=manifest, templates_dir=templates,
                      mem_dir=root / "shm", bases_dir=root / "vm-bases")  # fmt: skip
    imp.plan()
    return imp


def _send(exp: sc.Export, imp: sc.Importer, moved: dict[Path, Path] | None = None) -> int:
    n = 0
    for name in imp.want:
        p = exp.path(name)
        for off, data in sc.chunks((moved or {}).get(p, p), size=256 * 1024):
            imp.write(name, off, data)
            n += len(data)
    return n


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, Any]]:
    return _source(tmp_path / "a")


def test_chunks_skip_holes_and_zero_runs_and_rebuild_the_same_digest(tmp_path: Path) -> None:
    f = tmp_path / "ram"
    with open(f, "wb") as out:
        out.truncate(16 * MIB)
    _write_at(f, 3 * MIB, os.urandom(100))
    _write_at(f, 9 * MIB, bytes(2 * MIB))  # written zeros: data, but nothing to send
    parts = list(sc.chunks(f, size=MIB))
    assert [off for off, _ in parts] == [3 * MIB]
    g = tmp_path / "copy"
    with open(g, "wb") as out:
        out.truncate(16 * MIB)
        for off, data in parts:
            out.seek(off)
            out.write(data)
    assert sc.digest(g) == sc.digest(f)


def test_base_digests_are_kept_across_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f, g, cache = tmp_path / "vmlinux", tmp_path / "other", tmp_path / "vm-digests.json"
    f.write_bytes(os.urandom(10_000))
    g.write_bytes(b"x")
    want = sc.digest(f)
    sc.save_digests(cache, [f])
    monkeypatch.setattr(sc, "_digests", {})
    monkeypatch.setattr(sc, "_loaded", set())
    sc.load_digests(cache)

    def rehash(path: Path, sparse: bool) -> str:
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(snapshots, "file_digest", rehash)
    assert sc.digest(f) == want
    f.write_bytes(b"changed")  # a new stamp: hashed again
    with pytest.raises(AssertionError, match="hashed again"):
        sc.digest(f)
    sc.save_digests(cache, [g])  # the stale entry goes
    assert json.loads(cache.read_text()) == {}


def test_export_names_the_chain_by_manifest_name(source: tuple[Path, Path, Path, Any]) -> None:
    tdir, mem, templates, meta = source
    exp = sc.export_manifest(tdir, mem, templates, meta)
    files = exp.manifest["files"]
    assert files["snap/scratch.qcow2"]["backing"] == "tpl/sbx-a-tpl1/scratch.qcow2"
    assert files["tpl/sbx-a-tpl1/scratch.qcow2"]["backing"] == "base/scratch_base"
    assert files["tpl/sbx-a-tpl1/scratch.qcow2"]["backing_format"] == "raw"
    # the RAM and device state keep the digests written with the snapshot
    own = json.loads((tdir / snapshots.MANIFEST).read_text())
    assert files["ram"]["sha256"] == own["ram"]["sha256"]
    assert files["snap/state"]["sha256"] == own["files"]["state"]["sha256"]
    with pytest.raises(InvalidArgument, match="networked"):
        sc.export_manifest(tdir, mem, templates, {**meta, "net": {"tap": "t"}})


def test_copy_to_another_edge_rebases_and_reuses_what_it_has(
    source: tuple[Path, Path, Path, Any], tmp_path: Path
) -> None:
    tdir, mem, templates, meta = source
    exp = sc.export_manifest(tdir, mem, templates, meta)
    # the receiving node has none of the source's files at the source's paths
    data = Path(meta["kernel"]).parent
    elsewhere = tmp_path / "moved-data"
    data.rename(elsewhere)
    moved = {p: elsewhere / p.name for p in exp.paths.values() if p.parent == data}
    dst = tmp_path / "b"
    imp = _importer(dst, exp.manifest)
    assert set(imp.want) == set(exp.manifest["files"])  # everything
    _send(exp, imp, moved)
    copy_dir, copy_mem = imp.commit("sbx-a-src", "sbx-a-src")
    assert copy_dir == dst / "vm-templates" / "snp-b-1"
    assert not imp.staging.exists()
    assert not imp.staging_mem.exists()
    tpl = dst / "vm-templates" / "sbx-a-tpl1" / "scratch.qcow2"
    assert sc.qcow2_backing(copy_dir / "scratch.qcow2") == str(tpl)
    base = Path(sc.qcow2_backing(tpl))
    assert base.parent == dst / "vm-bases"
    # the guest sees the same disk through the new chain
    data.mkdir()
    for p, q in moved.items():
        os.symlink(q, p)
    r = subprocess.run(["qemu-img", "compare", "-f", "qcow2", "-F", "qcow2",
                        str(tdir / "scratch.qcow2"), str(copy_dir / "scratch.qcow2")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((copy_dir / "vm.json").read_text())
    assert Path(got["kernel"]).parent == dst / "vm-bases"
    assert set(got["shared"]) == set(meta["shared"])
    assert all(Path(v).parent == dst / "vm-bases" for v in got["shared"].values())
    assert got["templates"] == ["sbx-a-tpl1", "snp-b-1"]
    assert (copy_dir / "pinned").read_text() == "sbx-a-src"
    snap = Snapshot(dir=copy_dir, mem_file=copy_mem, state=copy_dir / "state")
    snapshots.verify(snap, trust_stamps=False)  # the source's own digests hold here

    # a second copy: the template and every base are here already, by digest
    again = _importer(dst, exp.manifest, "snp-b-2")
    assert sorted(again.want) == ["ram", *(f"snap/{n}" for n in sorted(sc.SNAP_FILES))]
    _send(exp, again)
    d2, _ = again.commit("sbx-a-src", "sbx-a-src")
    assert sc.qcow2_backing(d2 / "scratch.qcow2") == str(tpl)


def test_a_corrupt_or_truncated_file_is_refused_and_nothing_stays(
    source: tuple[Path, Path, Path, Any], tmp_path: Path
) -> None:
    tdir, mem, templates, meta = source
    exp = sc.export_manifest(tdir, mem, templates, meta)
    dst = tmp_path / "b"
    before = None
    for damage in ("flip", "truncate"):
        imp = _importer(dst, exp.manifest)
        before = before if before is not None else _leftovers(dst)
        for name in imp.want:
            parts = list(sc.chunks(exp.path(name), size=256 * 1024))
            if name == "ram" and damage == "flip":
                off, data = parts[0]
                parts[0] = (off, bytes([data[0] ^ 1]) + data[1:])
            if name == "snap/state" and damage == "truncate":
                parts = parts[:-1]
            for off, data in parts:
                imp.write(name, off, data)
        with pytest.raises(snapshots.SnapshotCorrupt, match="digest"):
            imp.commit("sbx-a-src", "sbx-a-src")
        imp.abort()
        assert _leftovers(dst) == before, damage
        assert not (dst / "vm-templates" / "snp-b-1").exists()


def test_the_importer_refuses_bad_input(
    source: tuple[Path, Path, Path, Any], tmp_path: Path
) -> None:
    tdir, mem, templates, meta = source
    exp = sc.export_manifest(tdir, mem, templates, meta)
    imp = _importer(tmp_path / "b", exp.manifest)
    with pytest.raises(InvalidArgument, match="not asked for"):
        imp.write("snap/../../etc/passwd", 0, b"x")
    with pytest.raises(snapshots.SnapshotCorrupt, match="past its end"):
        imp.write("snap/qemu.json", 10_000, b"x")
    bad = {**exp.manifest, "files": {**exp.manifest["files"], "../x": {"size": 1}}}
    with pytest.raises(InvalidArgument, match="bad snapshot transfer manifest entry"):
        _importer(tmp_path / "c", bad)
    files = {k: v for k, v in exp.manifest["files"].items() if k != "base/l0"}
    with pytest.raises(InvalidArgument, match="lacks base/l0"):
        _importer(tmp_path / "c", {**exp.manifest, "files": files})
    imp.abort()
    with pytest.raises(snapshots.SnapshotCorrupt, match="abandoned"):
        imp.write("ram", 0, b"x")
    assert _leftovers(tmp_path / "b") == []


# --- the edge's stream handlers (SnapshotTransfer) over in-memory streams ---------------


class _Backend:
    """The microVM backend's copy calls on plain directories (the integration test runs the
    real backend: tests/integration/test_snapshot_xedge.py)."""

    def __init__(self, root: Path, export: sc.Export | None = None) -> None:
        self.root, self.export = root, export

    def export_snapshot(self, snapshot_id: str) -> sc.Export:
        assert self.export is not None
        return self.export

    def snapshot_importer(self, copy_id: str, manifest: dict[str, Any], image: str, *,
                          source: str = "", keep: bool = True) -> sc.Importer:  # fmt: skip
        return _importer(self.root, manifest, copy_id)

    def import_commit(self, imp: sc.Importer, source_sandbox: str) -> int:
        try:
            imp.commit(source_sandbox, source_sandbox)
        except BaseException:
            imp.abort()
            raise
        return 1

    def import_abort(self, imp: sc.Importer) -> None:
        imp.abort()


class _Manager:
    def __init__(self, edge_id: str, backend: _Backend) -> None:
        self.edge_id, self._b = edge_id, backend

    def backend(self, name: str) -> _Backend:
        return self._b


def _edges(source: tuple[Path, Path, Path, Any], tmp_path: Path) -> tuple[Any, Any, Any, str]:
    from dsec.core.ids import new_snapshot_id
    from dsec.core.spec import SandboxSpec
    from dsec.edge.manager import Caller
    from dsec.edge.named_snapshots import NamedSnapshots, SnapshotRecord
    from dsec.edge.snapshot_transfer import SnapshotTransfer

    tdir, mem, templates, meta = source
    snap_id = new_snapshot_id("aaaa", bytes(13))
    rec = SnapshotRecord(
        id=snap_id, name="n", project="p", owner="o", source_sandbox="sbx-aaaa-src",
        backend="microvm", mode="full", size_bytes=1, created_at=1.0,
        spec=SandboxSpec(backend="microvm"),
    )  # fmt: skip
    exp = sc.export_manifest(tdir, mem, templates, meta)
    ma, mb = _Manager("aaaa", _Backend(tmp_path, exp)), _Manager("bbbb", _Backend(tmp_path / "b"))
    a = NamedSnapshots(ma, None, tmp_path / "recs-a")  # type: ignore[arg-type]
    a._save(rec)
    b = NamedSnapshots(mb, None, tmp_path / "recs-b")  # type: ignore[arg-type]
    caller = Caller(project="p", subject="o", admin=True)
    return SnapshotTransfer(a), SnapshotTransfer(b), caller, snap_id


async def _collect(it: Any) -> list[Any]:
    return [x async for x in it]


@pytest.mark.asyncio
async def test_stream_import_commits_only_after_end(
    source: tuple[Path, Path, Path, Any], tmp_path: Path
) -> None:
    from dsec.core.ids import new_snapshot_id
    from dsec.rpc._gen import dsec_pb2 as pb

    src, dst, caller, snap_id = _edges(source, tmp_path)
    head = await _collect(src.export(snap_id, [], caller))
    for cut in ("early-end", "cancel", None):
        copy_id = new_snapshot_id("bbbb", os.urandom(13))
        queue: asyncio.Queue[pb.SnapshotChunk | None] = asyncio.Queue()

        async def requests(q: asyncio.Queue[pb.SnapshotChunk | None]) -> Any:
            while (item := await q.get()) is not None:
                yield item

        await queue.put(pb.SnapshotChunk(manifest=head[0].manifest, snapshot_id=copy_id))
        events = dst.import_(requests(queue), caller)
        want = (await anext(events)).want
        assert "ram" in want
        body = await _collect(src.export(snap_id, list(want), caller))
        assert body[-1].end
        for chunk in body[: len(body) // 2] if cut else body:
            await queue.put(chunk)
        if cut == "early-end":
            await queue.put(None)  # the stream closes without `end`
            with pytest.raises(InvalidArgument, match="ended before all its files"):
                await anext(events)
        elif cut == "cancel":
            pending = asyncio.ensure_future(anext(events))
            await asyncio.sleep(0.2)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            await events.aclose()
        else:
            info = (await anext(events)).snapshot
            assert (info.id, info.edge_id, info.name) == (copy_id, "bbbb", "n")
            assert (tmp_path / "b" / "vm-templates" / copy_id / "pinned").exists()
            continue
        left = [p.name for p in (tmp_path / "b").rglob("*") if p.is_file()]
        assert left == [], cut
        assert not (tmp_path / "recs-b" / f"{copy_id}.json").exists()


def test_bases_taken_in_go_once_nothing_names_them(tmp_path: Path) -> None:
    from dsec.edge.backends.microvm.backend import MicrovmBackend
    from dsec.paths import Paths

    paths = Paths(home=tmp_path / "home", data=tmp_path / "data", run=tmp_path / "run")
    sandboxes = tmp_path / "edge" / "sandboxes"
    store: Any = None  # not used by what this test calls
    be = MicrovmBackend(paths, "e0", image_store=store, sandboxes_dir=sandboxes, mem_dir=tmp_path)
    bases = tmp_path / "edge" / "vm-bases"
    bases.mkdir(parents=True)
    kept, dropped = bases / ("a" * 64), bases / ("b" * 64)
    kept.write_bytes(b"k")
    dropped.write_bytes(b"d")
    snap = be.templates_dir / "snp-e0-x"
    snap.mkdir(parents=True)
    (snap / "pinned").write_text("sbx-e0-src")
    meta = {"kernel": str(kept), "shared": {}, "templates": ["snp-e0-x"]}
    (snap / "vm.json").write_text(json.dumps(meta))
    be._drop_unused_templates(["some-template"])
    assert kept.exists()
    assert not dropped.exists()
    (snap / "pinned").unlink()  # the snapshot deleted, no sandbox made from it
    be._drop_unused_templates(["snp-e0-x"])
    assert not kept.exists()
    assert not snap.exists()
