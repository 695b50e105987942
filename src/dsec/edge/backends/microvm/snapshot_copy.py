"""Copying a named microVM snapshot to another edge: what to send, and taking it in.

The source edge describes the snapshot as a *transfer manifest* (:func:`export_manifest`):
every file a sandbox made from it needs, by name, with its size and digest:

* ``snap/state``, ``snap/qemu.json``, ``snap/config.img``, ``snap/scratch.qcow2`` and
  ``ram``: the snapshot itself (the RAM file and device state keep the digests written when
  the snapshot was taken, so a file changed on the source since is refused too);
* ``tpl/<template>/scratch.qcow2``: the fork templates the snapshot's disk stands on (its
  qcow2 backing chain);
* ``base/<role>``: the shared read-only files (guest kernel, initramfs, agent bundle, image
  layers, the empty scratch base) its settings name.

Each qcow2 names its backing file by manifest name, not by the source's path. The receiving
edge (:class:`Importer`) asks only for what it lacks: a base whose digest matches one of its
own files (the same path, or the file it would use itself) or one it took in before
(``vm-bases/<digest>``), and a template it already holds with that digest, are not sent.
Everything received goes to a staging directory (the RAM to a staging file beside the RAM
files); :meth:`Importer.commit` checks every size and digest, points each qcow2 at its
backing file on this edge (``qemu-img rebase -u``), rewrites the settings' paths, and only
then moves the files in. Any failure or an unfinished transfer removes the staging files
(:meth:`Importer.abort`), so nothing half-received is ever restored.

Digests: ``sparse`` files use :func:`snapshots.sparse_digest` (holes and zero pages are the
same content, so a file is sent as its data runs only); the others a plain sha256.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.core.errors import InvalidArgument
from dsec.edge.backends.microvm import snapshots
from dsec.edge.backends.microvm.disk_info import disk_info
from dsec.edge.backends.microvm.snapshot_cache import SnapshotCache
from dsec.edge.backends.microvm.snapshots import SnapshotCorrupt

FORMAT = 1
CHUNK = 1 << 20  # bytes of file data per message
SNAP_FILES = ("state", "qemu.json", "config.img", "scratch.qcow2")
_NAME_RE = re.compile(
    r"^(ram|snap/(state|qemu\.json|config\.img|scratch\.qcow2)"
    r"|tpl/[A-Za-z0-9][A-Za-z0-9._-]{0,127}/scratch\.qcow2|base/[a-z0-9_]{1,32})$"
)
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")

_digests: dict[str, str] = {}
_loaded: set[Path] = set()


def digest(path: Path, sparse: bool = True) -> str:
    """sha256 of ``path`` (``sparse``: of its non-zero pages and their offsets), cached while
    the file's stamp is unchanged (see :func:`load_digests`)."""
    key = json.dumps([str(path), snapshots.stamp(path), sparse])
    hit = _digests.get(key)
    if hit is None:
        hit = snapshots.file_digest(path, sparse)
        _digests[key] = hit
    return hit


def load_digests(cache: Path) -> None:
    """Take in the digests an earlier process of this edge saved (:func:`save_digests`), so
    the shared base files are hashed once per edge, not once per process. Entries are keyed
    by path and stamp: a changed or replaced file is hashed again."""
    if cache in _loaded:
        return
    _loaded.add(cache)
    saved = _read_json(cache)
    _digests.update({k: v for k, v in saved.items() if isinstance(v, str)})


def save_digests(cache: Path, paths: list[Path]) -> None:
    """Keep the digests of ``paths`` (files that stay: the bases) in ``cache``."""
    keep = {str(p) for p in paths}
    saved = _read_json(cache)
    out = {k: v for k, v in saved.items() if _current(k)}
    out.update({k: v for k, v in _digests.items() if json.loads(k)[0] in keep and _current(k)})
    if out != saved:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out))
        tmp.rename(cache)


def qcow2_backing(path: Path) -> str:
    """The backing file ``path`` names ("" when it has none)."""
    return disk_info(path, SnapshotCorrupt, f"cannot read disk {path.name}", shared=True).backing


def rebase(path: Path, backing: Path, backing_format: str) -> None:
    """Point qcow2 ``path`` at ``backing`` without touching its data (``rebase -u``)."""
    r = subprocess.run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-b", str(backing), "-F",
                        backing_format, str(path)], capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise SnapshotCorrupt(f"cannot rebase disk {path.name}: {r.stderr.strip()[-500:]}")


def chunks(path: Path, size: int = CHUNK) -> Iterator[tuple[int, bytes]]:
    """``(offset, data)`` of ``path``'s data runs, up to ``size`` bytes each; holes and
    all-zero chunks are skipped (the receiver's file is sparse there)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        total = os.fstat(fd).st_size
        for start, end in snapshots.data_extents(fd, total):
            off = start
            while off < end:
                data = os.pread(fd, min(size, end - off), off)
                if not data:
                    break
                if data.count(0) != len(data):
                    yield off, data
                off += len(data)
    finally:
        os.close(fd)


def entry(path: Path, sparse: bool, sha256: str = "", **extra: Any) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sparse": sparse,
            "sha256": sha256 or digest(path, sparse), **extra}  # fmt: skip


# --- the sending edge ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Export:
    """A snapshot as the source edge sends it: the manifest and each named file's path."""

    manifest: dict[str, Any]
    paths: dict[str, Path]

    def path(self, name: str) -> Path:
        p = self.paths.get(name)
        if p is None:
            raise InvalidArgument(f"snapshot file {name!r} is not part of this snapshot")
        return p


def export_manifest(
    tdir: Path, mem_file: Path, templates_dir: Path, meta: dict[str, Any], *,
    disk_dir: Path | None = None,
) -> Export:  # fmt: skip
    """The transfer manifest of the snapshot in template directory ``tdir`` (RAM file
    ``mem_file``, settings ``meta``); ``templates_dir`` holds the templates its disk may
    stand on. ``disk_dir``: where its ``config.img`` and ``scratch.qcow2`` are when not in
    ``tdir`` (a paused sandbox's pause snapshot: the sandbox's own, still disks).

    Raises:
        InvalidArgument: a snapshot this edge cannot send (Firecracker, networked).
        SnapshotCorrupt: its manifest or disk chain cannot be read.
    """
    if meta.get("vmm", "qemu") != "qemu":
        raise InvalidArgument("only QEMU microVM snapshots can be copied to another edge")
    if meta.get("net"):
        raise InvalidArgument("a snapshot of a networked microVM cannot be copied")
    try:
        own = json.loads((tdir / snapshots.MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotCorrupt(f"snapshot {tdir.name} has no readable manifest: {exc}") from exc
    signed = {**own.get("files", {}), "ram": own.get("ram")}
    paths: dict[str, Path] = {"ram": mem_file}
    files: dict[str, dict[str, Any]] = {}
    for name in SNAP_FILES:
        on_disk = disk_dir is not None and name in ("config.img", "scratch.qcow2")
        paths[f"snap/{name}"] = (disk_dir if on_disk and disk_dir else tdir) / name
    for name, p in paths.items():
        known = signed.get(name.removeprefix("snap/"))
        if isinstance(known, dict) and "sha256" in known:  # the digest taken with the snapshot
            files[name] = entry(p, name == "ram", str(known["sha256"]))
        else:
            files[name] = entry(p, True)
    bases: dict[str, Path] = {"kernel": Path(meta["kernel"])}
    bases.update({role: Path(v) for role, v in meta.get("shared", {}).items()})
    by_path = {str(p.resolve()): f"base/{role}" for role, p in bases.items()}
    for role, p in bases.items():
        paths[f"base/{role}"] = p
        files[f"base/{role}"] = entry(p, True)
    # the disk's backing chain: template scratch disks, down to the scratch base
    disk, name = paths["snap/scratch.qcow2"], "snap/scratch.qcow2"
    while True:
        backing = qcow2_backing(disk)
        if not backing:
            break
        bp = Path(backing).resolve()
        ref = by_path.get(str(bp))
        if ref is None:
            if bp.parent.parent != templates_dir.resolve() or bp.name != "scratch.qcow2":
                raise SnapshotCorrupt(f"disk {disk} stands on {bp}, which is not a template")
            ref = f"tpl/{bp.parent.name}/scratch.qcow2"
            paths[ref] = bp
            files[ref] = entry(bp, True)
        files[name]["backing"] = ref
        files[name]["backing_format"] = "qcow2" if ref.startswith("tpl/") else "raw"
        if not ref.startswith("tpl/"):
            break
        disk, name = bp, ref
    manifest = {"format": FORMAT, "vmm": "qemu", "meta": meta, "snapshot_manifest": own,
                "files": files}  # fmt: skip
    return Export(manifest=manifest, paths=paths)


# --- the receiving edge ----------------------------------------------------------------


@dataclass(eq=False)
class Importer:
    """Takes in one snapshot as ``copy_id`` (see the module docstring).

    ``local_bases``: role -> this edge's own file for that role (candidates for a match by
    digest); ``bases_dir``: where bases taken in from other edges live, by digest."""

    copy_id: str
    manifest: dict[str, Any]
    templates_dir: Path
    mem_dir: Path
    bases_dir: Path
    local_bases: dict[str, Path] = field(default_factory=dict)
    cache: SnapshotCache | None = None  # files of snapshots received before, by digest
    keep: bool = True  # add what is received to ``cache`` (a moved sandbox's are not)
    source: str = ""  # the source snapshot's id (the cache forgets it when it is deleted)
    want: list[str] = field(default_factory=list)
    cached: dict[str, Path] = field(default_factory=dict)  # name -> the cache's file
    resolved: dict[str, Path] = field(default_factory=dict)  # name -> final path on this edge
    _fds: dict[str, int] = field(default_factory=dict)
    _moved: list[Path] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _aborted: bool = False

    def __post_init__(self) -> None:
        self.staging = self.templates_dir / f".import-{self.copy_id}"
        self.staging_mem = self.mem_dir / f".import-{self.copy_id}.mem"
        self.files: dict[str, dict[str, Any]] = self._check_manifest()

    def _check_manifest(self) -> dict[str, dict[str, Any]]:
        m = self.manifest
        if m.get("format") != FORMAT or m.get("vmm") != "qemu":
            raise InvalidArgument("unsupported snapshot transfer format")
        files = m.get("files")
        if not isinstance(files, dict) or not isinstance(m.get("meta"), dict):
            raise InvalidArgument("snapshot transfer manifest without files or settings")
        for name, e in files.items():
            ok = (
                isinstance(name, str) and _NAME_RE.match(name) and isinstance(e, dict)
                and isinstance(e.get("size"), int) and e["size"] >= 0
                and isinstance(e.get("sha256"), str) and _DIGEST_RE.match(e["sha256"])
            )  # fmt: skip
            if not ok:
                raise InvalidArgument(f"bad snapshot transfer manifest entry {name!r}")
            backing = e.get("backing")
            if backing is not None and backing not in files:
                raise InvalidArgument(f"{name} stands on {backing!r}, which is not sent")
        shared = m["meta"].get("shared", {})
        if not isinstance(shared, dict):
            raise InvalidArgument("snapshot transfer manifest with bad settings")
        need = {"ram", *(f"snap/{n}" for n in SNAP_FILES), "base/kernel"}
        missing = need.union(f"base/{role}" for role in shared) - set(files)
        if missing:
            raise InvalidArgument(f"snapshot transfer lacks {', '.join(sorted(missing))}")
        return files

    def plan(self) -> list[str]:
        """Decide which files to ask for (the rest this edge has by digest)."""
        self.want, self.cached = [], {}
        for name, e in sorted(self.files.items()):
            hit = self.cache.lookup(name, e) if self.cache is not None else None
            if hit is not None:
                self.cached[name] = hit
                continue
            have = self._have(name, e)
            if have is None:
                self.want.append(name)
            else:
                self.resolved[name] = have
        return self.want

    def _have(self, name: str, e: dict[str, Any]) -> Path | None:
        if name.startswith("tpl/"):
            tid = name.split("/")[1]
            tpl = self.templates_dir / tid / "scratch.qcow2"
            origin = _read_json(self.templates_dir / tid / "origin.json").get("sha256")
            return tpl if tpl.exists() and origin == e["sha256"] else None
        if not name.startswith("base/"):
            return None
        role = name.removeprefix("base/")
        meta = self.manifest["meta"]
        there = meta.get("kernel") if role == "kernel" else meta.get("shared", {}).get(role)
        for cand in (there, self.local_bases.get(role), self.bases_dir / e["sha256"]):
            if not cand or not Path(str(cand)).is_file():
                continue
            p = Path(str(cand))
            with contextlib.suppress(OSError):
                if p.stat().st_size == e["size"] and digest(p, bool(e["sparse"])) == e["sha256"]:
                    return p
        return None

    def staged(self, name: str) -> Path:
        return self.staging_mem if name == "ram" else self.staging / name

    def write(self, name: str, offset: int, data: bytes) -> None:
        """Write a chunk of a wanted file into the staging area."""
        with self._lock:
            if self._aborted:
                raise SnapshotCorrupt("the snapshot import was abandoned")
            self._write(name, offset, data)

    def _write(self, name: str, offset: int, data: bytes) -> None:
        if name not in self.want:
            raise InvalidArgument(f"snapshot file {name!r} was not asked for")
        size = int(self.files[name]["size"])
        if offset < 0 or offset + len(data) > size:
            raise SnapshotCorrupt(f"snapshot file {name}: data past its end ({size} bytes)")
        fd = self._fds.get(name)
        if fd is None:
            p = self.staged(name)
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            self._fds[name] = fd
        os.pwrite(fd, data, offset)

    def _close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def verify(self) -> None:
        """Every wanted file received in full, matching its digest (else SnapshotCorrupt)."""
        for name in self.want:
            e, p = self.files[name], self.staged(name)
            fd = self._fds.get(name)
            if fd is None:  # nothing but holes sent: an empty or all-zero file
                p.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                self._fds[name] = fd
            os.ftruncate(fd, int(e["size"]))
        self._close()
        for name in self.want:
            e, p = self.files[name], self.staged(name)
            if digest(p, bool(e["sparse"])) != e["sha256"]:
                raise SnapshotCorrupt(
                    f"snapshot file {name} does not match its digest: the copy is refused"
                )

    def commit(self, source_sandbox: str, pinned: str) -> tuple[Path, Path]:
        """Verify, rebase and move everything in; returns the snapshot's template directory
        and RAM file. On failure nothing of it stays (see :meth:`abort`)."""
        self.verify()
        self._through_cache()
        tdir = self.templates_dir / self.copy_id
        tmem = self.mem_dir / f"tpl-{self.copy_id}.mem"
        local = [*self.want, *self.cached]  # the files this copy holds, staged
        for name in local:  # where each file will live
            if name.startswith("tpl/"):
                self.resolved[name] = self.templates_dir / name.split("/")[1] / "scratch.qcow2"
            elif name.startswith("base/"):
                self.resolved[name] = self.bases_dir / self.files[name]["sha256"]
            elif name == "ram":
                self.resolved[name] = tmem
            else:
                self.resolved[name] = tdir / name.removeprefix("snap/")
        for name in local:
            e = self.files[name]
            if e.get("backing"):
                rebase(self.staged(name), self.resolved[e["backing"]], str(e["backing_format"]))
        chain = sorted({n.split("/")[1] for n in self.files if n.startswith("tpl/")})
        sdir = self.staging / "snap"
        _write_json(sdir / "vm.json", self._meta(chain))
        _write_json(sdir / snapshots.MANIFEST, self.manifest["snapshot_manifest"])
        (sdir / "pinned").write_text(pinned or source_sandbox)
        # move in: shared bases and templates first, the RAM, then the snapshot itself
        for name in self.want:
            if name.startswith("base/"):
                self._move(self.staged(name), self.resolved[name])
            elif name.startswith("tpl/"):
                tid_dir = self.staging / "tpl" / name.split("/")[1]
                _write_json(tid_dir / "origin.json", {"sha256": self.files[name]["sha256"]})
                self._move(tid_dir, self.resolved[name].parent)
        self._move(self.staging_mem, tmem)
        self._move(sdir, tdir)
        shutil.rmtree(self.staging, ignore_errors=True)
        return tdir, tmem

    def _through_cache(self) -> None:
        """Keep the verified snapshot files received (before their disk is rebased), and
        stage the ones the cache had."""
        if self.cache is None:
            return
        for name in self.want:
            if self.keep and self.cache.holds(name):
                self.cache.put(name, self.files[name]["sha256"], self.staged(name), self.source)
        for name, cached in self.cached.items():
            self.cache.take(name, cached, self.staged(name))
        if self.cached:
            self.cache.used({n: self.files[n]["sha256"] for n in self.cached}, self.source)
        self.cache.trim()

    def _meta(self, chain: list[str]) -> dict[str, Any]:
        meta = dict(self.manifest["meta"])
        meta["kernel"] = str(self.resolved["base/kernel"])
        meta["shared"] = {role: str(self.resolved[f"base/{role}"])
                          for role in meta.get("shared", {})}  # fmt: skip
        meta["templates"] = [*chain, self.copy_id]
        meta["paused"] = False
        meta.pop("parent", None)
        return meta

    def _move(self, src: Path, dst: Path) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists():  # taken in by another import meanwhile (same digest): keep that
            remove(src)
            return
        os.rename(src, dst)
        self._moved.append(dst)

    def abort(self, drop_templates: Callable[[list[str]], None] | None = None) -> None:
        """Remove the staging files and whatever this import moved in."""
        with self._lock:
            self._aborted = True
            self._close()
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging_mem.unlink(missing_ok=True)
        tids = []
        for p in reversed(self._moved):
            if p.parent == self.templates_dir and p.name != self.copy_id:
                tids.append(p.name)  # a shared template: dropped below unless in use
                continue
            remove(p)
        self._moved.clear()
        if tids and drop_templates is not None:
            drop_templates(tids)


def _current(key: str) -> bool:
    """Whether a digest cache entry still describes its file."""
    try:
        path, stamp, _ = json.loads(key)
        return bool(snapshots.stamp(Path(path)) == stamp)
    except (OSError, ValueError, TypeError):
        return False


def _read_json(p: Path) -> dict[str, Any]:
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _write_json(p: Path, d: dict[str, Any]) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(d))


def remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)
