"""Snapshot manifests: sha256 of every file of a snapshot, and a stamp of each file.

``manifest.json`` in the snapshot directory lists the device state, the driver's notes and
the RAM file (when the RAM is in a file, see ``Snapshot.ram_in_file``) with their sizes,
digests and stamps (device, inode, size, mtime, ctime). The RAM file is sparse (guest pages
never touched are holes), so its digest covers its non-zero pages and their offsets only.

Digests are computed once, when the edge writes the snapshot (or takes one in from another
edge: :func:`verify` with ``trust_stamps=False``, then :func:`restamp`). A restore on the same
edge trusts a file whose stamp is unchanged, so it does not re-read gigabytes of RAM; any
write, truncation or replacement changes the stamp, and then the file is hashed again
and refused unless its digest matches. A snapshot written without digests (a fork template,
used at once by the edge that made it) is refused once a stamp differs.
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


def stamp(path: Path) -> list[int]:
    """What changes whenever a file is written, truncated or replaced."""
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_digest(path: Path, sparse: bool) -> str:
    """sha256 of ``path``; ``sparse``: of its non-zero pages and their offsets."""
    if sparse:
        return sparse_digest(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _entry(path: Path, sparse: bool, digest: bool) -> dict[str, object]:
    out: dict[str, object] = {"path": str(path), "size": path.stat().st_size}
    if digest:
        out["sha256"] = file_digest(path, sparse)
    out["stamp"] = stamp(path)
    return out


def _entries(snap: Snapshot) -> dict[str, Path]:
    return {"state": snap.state, "qemu.json": snap.dir / "qemu.json"}


def write_manifest(snap: Snapshot, *, digests: bool = True) -> Path:
    """Write ``manifest.json`` for ``snap``: sizes and stamps, and (``digests``) sha256."""
    files = {name: _entry(p, False, digests) for name, p in _entries(snap).items() if p.exists()}
    ram = _entry(snap.mem_file, True, digests) if snap.ram_in_file else None
    return _save(snap, {"format": 2, "files": files, "ram": ram})


def _save(snap: Snapshot, manifest: dict[str, object]) -> Path:
    out = snap.dir / MANIFEST
    tmp = snap.dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.rename(out)
    return out


def _load(snap: Snapshot) -> dict[str, dict[str, object]]:
    """name -> entry of every file the manifest lists."""
    try:
        manifest = json.loads((snap.dir / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise SnapshotCorrupt(f"snapshot {snap.dir.name} has no readable manifest: {exc}") from exc
    want: dict[str, dict[str, object]] = dict(manifest.get("files", {}))
    if manifest.get("ram") is not None:
        want["ram"] = manifest["ram"]
    return want


def verify(snap: Snapshot, *, trust_stamps: bool = True) -> None:
    """Raise :class:`SnapshotCorrupt` unless every file matches the manifest: its stamp is
    the one written (``trust_stamps``), or else its digest is."""
    paths = {**_entries(snap), "ram": snap.mem_file}
    for name, entry in _load(snap).items():
        p = paths.get(name)
        if p is None or not isinstance(entry, dict):
            raise SnapshotCorrupt(f"snapshot {snap.dir.name}: bad manifest entry {name!r}")
        try:
            now = stamp(p)
        except OSError as exc:
            raise SnapshotCorrupt(f"snapshot {snap.dir.name}: {name} is missing") from exc
        if now[2] != entry.get("size"):
            raise SnapshotCorrupt(
                f"snapshot {snap.dir.name}: {name} is {now[2]} bytes, expected {entry.get('size')}"
            )
        if trust_stamps and entry.get("stamp") == now:
            continue
        if "sha256" not in entry:
            raise SnapshotCorrupt(
                f"snapshot {snap.dir.name}: {name} changed since it was written (no digest)"
            )
        if file_digest(p, name == "ram") != entry["sha256"]:
            raise SnapshotCorrupt(f"snapshot {snap.dir.name}: {name} digest mismatch")


def ram_unchanged(snap: Snapshot) -> bool:
    """The RAM file's stamp is still the one its manifest holds."""
    try:
        ram = json.loads((snap.dir / MANIFEST).read_text()).get("ram")
        return isinstance(ram, dict) and ram.get("stamp") == stamp(snap.mem_file)
    except (OSError, ValueError):
        return False


def restamp_ram(snap: Snapshot) -> None:
    """Record the RAM file's stamp as it is now: after zero pages were punched to holes,
    which its digest does not see (see :func:`sparse_digest`)."""
    manifest = json.loads((snap.dir / MANIFEST).read_text())
    if isinstance(manifest.get("ram"), dict):
        manifest["ram"]["stamp"] = stamp(snap.mem_file)
        _save(snap, manifest)


def restamp(snap: Snapshot, *, keep: bool = True) -> None:
    """Record the files' stamps as they are now (after a full :func:`verify`), or
    (``keep=False``) drop them, so the next :func:`verify` hashes every file: for a
    snapshot whose RAM file a restored VMM may write into."""
    paths = {**_entries(snap), "ram": snap.mem_file}
    manifest = json.loads((snap.dir / MANIFEST).read_text())
    for name, entry in _load(snap).items():
        if keep:
            entry["stamp"] = stamp(paths[name])
        else:
            entry.pop("stamp", None)
        if name == "ram":
            manifest["ram"] = entry
        else:
            manifest["files"][name] = entry
    _save(snap, manifest)
