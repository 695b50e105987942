"""Snapshot manifests: sha256 of every file of a snapshot, checked before any restore.

``manifest.json`` in the snapshot directory lists the device state, the driver's notes and
the RAM file with their sizes and digests. The RAM file is sparse (guest pages never
touched are holes), so its digest covers its non-zero pages and their offsets only. A
truncated or altered file is refused before QEMU loads anything from it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from dsec.core.errors import SandboxFailed
from dsec.edge.backends.microvm.vmm import Snapshot

MANIFEST = "manifest.json"
CHUNK = 4 << 20
PAGE = 4096
ZERO_PAGE = bytes(PAGE)


class SnapshotCorrupt(SandboxFailed):
    pass


def sparse_digest(path: Path) -> str:
    """sha256 over (offset, page) of every non-zero page of ``path`` (holes are skipped
    without reading them), plus its size."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        h.update(size.to_bytes(8, "big"))
        for start, end in data_extents(fd, size):
            os.lseek(fd, start, os.SEEK_SET)
            off = start
            while off < end:
                data = os.read(fd, min(CHUNK, end - off))
                if not data:
                    break
                _hash_nonzero_pages(h, off, data)
                off += len(data)
    finally:
        os.close(fd)
    return h.hexdigest()


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each run of data in the open file ``fd`` of ``size`` bytes; holes
    are skipped without reading them."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end
        pos = end


def _hash_nonzero_pages(h: hashlib._Hash, off: int, data: bytes) -> None:
    """Hash (offset, page) for every page that is not all zeros: a zero page and a hole
    are the same RAM (a fork child reading a hole of the tmpfs file allocates a zero page)."""
    if data.count(0) == len(data):
        return
    mv = memoryview(data)
    for i in range(0, len(data), PAGE):
        page = mv[i : i + PAGE]
        if page != ZERO_PAGE[: len(page)]:
            h.update((off + i).to_bytes(8, "big"))
            h.update(page)


def _entry(path: Path, sparse: bool = False) -> dict[str, object]:
    digest = sparse_digest(path) if sparse else hashlib.sha256(path.read_bytes()).hexdigest()
    return {"path": str(path), "size": path.stat().st_size, "sha256": digest}


def _entries(snap: Snapshot) -> dict[str, Path]:
    return {"state": snap.state, "qemu.json": snap.dir / "qemu.json"}


def write_manifest(snap: Snapshot) -> Path:
    files = {name: _entry(p) for name, p in _entries(snap).items() if p.exists()}
    manifest = {"format": 1, "files": files, "ram": _entry(snap.mem_file, sparse=True)}
    out = snap.dir / MANIFEST
    tmp = snap.dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.rename(out)
    return out


def verify(snap: Snapshot) -> None:
    """Raise :class:`SnapshotCorrupt` unless every file matches the manifest."""
    try:
        manifest = json.loads((snap.dir / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotCorrupt(f"snapshot {snap.dir.name} has no readable manifest: {exc}") from exc
    want: dict[str, dict[str, object]] = {**manifest.get("files", {}), "ram": manifest.get("ram")}
    paths = {**_entries(snap), "ram": snap.mem_file}
    for name, entry in want.items():
        p = paths.get(name)
        if p is None or not isinstance(entry, dict):
            raise SnapshotCorrupt(f"snapshot {snap.dir.name}: bad manifest entry {name!r}")
        try:
            size = p.stat().st_size
        except OSError as exc:
            raise SnapshotCorrupt(f"snapshot {snap.dir.name}: {name} is missing") from exc
        if size != entry.get("size"):
            raise SnapshotCorrupt(
                f"snapshot {snap.dir.name}: {name} is {size} bytes, expected {entry.get('size')}"
            )
        digest = sparse_digest(p) if name == "ram" else hashlib.sha256(p.read_bytes()).hexdigest()
        if digest != entry.get("sha256"):
            raise SnapshotCorrupt(f"snapshot {snap.dir.name}: {name} digest mismatch")
