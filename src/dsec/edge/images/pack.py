"""Pack a sandbox's overlay upper dir into a new OCI layer on top of its image.

The upper dir is walked in sorted order (never following symlinks):

- a char device 0/0 (an overlay whiteout) becomes an empty ``DIR/.wh.NAME``;
- a directory with ``trusted.overlay.opaque=y`` becomes the directory plus
  ``DIR/.wh..wh..opq``;
- everything else is a PAX entry with numeric owners, modes, mtimes, hard links and
  ``SCHILY.xattr.*`` (``trusted.overlay.*`` xattrs are overlay bookkeeping: never exported);
- other device nodes, FIFOs and sockets are skipped (images carry none).

The tar's sha256 is the layer's diff_id; it is stored gzip'd (``gzip -1 -n``) as a blob
and unpacked (confined, like any pulled layer) into the layer store, then a ref is written with the
base image's layers plus this one and the base image's config.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dsec.core.errors import Internal
from dsec.edge.images.store import Image, ImageStore, LayerBlob
from dsec.edge.images.unpack import OPAQUE_MARKER, OPAQUE_XATTR, WHITEOUT_PREFIX, XATTR_PAX

LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True, slots=True)
class PackedLayer:
    """A layer made from an upper dir: its ids and how many entries of each kind."""

    diff_id: str  # hex sha256 of the tar
    digest: str  # sha256:<hex> of the gzip'd blob
    size: int  # compressed bytes
    entries: int
    whiteouts: int
    opaque_dirs: int


class _HashingWriter:
    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.hash = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        return self.raw.write(data)


def _xattrs(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return out
    for name in names:
        if name.startswith("trusted.overlay."):
            continue
        try:
            value = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue
        out[XATTR_PAX + name] = value.decode("utf-8", "surrogateescape")
    return out


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def write_diff_tar(upper: Path, out: IO[bytes]) -> tuple[str, int, int, int]:
    """Write the OCI layer tar of ``upper`` to ``out``; return (diff_id, entries, wh, opq)."""
    writer = _HashingWriter(out)
    entries = whiteouts = opaques = 0
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for dirpath, dirnames, filenames in os.walk(upper):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, upper)
            prefix = "" if rel_dir == "." else rel_dir + "/"
            names = sorted(dirnames + filenames)
            for name in names:
                full = os.path.join(dirpath, name)
                arc = prefix + name
                st = os.lstat(full)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    info = tarfile.TarInfo(prefix + WHITEOUT_PREFIX + name)
                    info.mtime = int(st.st_mtime)
                    tar.addfile(info)
                    whiteouts += 1
                    entries += 1
                    continue
                if not (
                    stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)
                ):
                    continue
                info = tar.gettarinfo(full, arcname=arc)
                info.uname = info.gname = ""
                info.pax_headers = _xattrs(full)
                if info.isreg():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
                entries += 1
                if stat.S_ISDIR(st.st_mode) and _is_opaque(full):
                    marker = tarfile.TarInfo(arc + "/" + OPAQUE_MARKER)
                    marker.mtime = int(st.st_mtime)
                    tar.addfile(marker)
                    opaques += 1
            # os.walk must not descend into symlinked dirs: it does not by default
    return writer.hash.hexdigest(), entries, whiteouts, opaques


def pack_upper(store: ImageStore, upper: Path) -> PackedLayer:
    """Turn ``upper`` into a gzip'd layer blob in the store and unpack it as a layer.

    The tar is compressed (``gzip -1 -n``, its own process) while the same tar is unpacked
    into the layer store, so the two costs overlap.
    """
    with store.scratch_dir() as scratch:
        tar_path = scratch / "layer.tar"
        with tar_path.open("wb") as f:
            diff_id, entries, wh, opq = write_diff_tar(upper, f)
        gz_path = scratch / "layer.tar.gz"
        with tar_path.open("rb") as src, gz_path.open("wb") as dst:
            gzip = subprocess.Popen(
                ["gzip", "-1", "-n", "-c"], stdin=src, stdout=dst, stderr=subprocess.PIPE
            )
        try:
            store.import_layer_blob(tar_path, LAYER_TAR, diff_id)
        finally:
            _, err = gzip.communicate()
        if gzip.returncode != 0:
            raise Internal(f"gzip failed: {err.decode(errors='replace').strip()}")
        h = hashlib.sha256()
        with gz_path.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        digest = "sha256:" + h.hexdigest()
        blob = store.blob_path(digest)
        blob.parent.mkdir(parents=True, exist_ok=True)
        size = gz_path.stat().st_size
        os.replace(gz_path, blob)
    return PackedLayer(diff_id, digest, size, entries, wh, opq)


def pack_image(store: ImageStore, upper: Path, base: Image, name: str) -> Image:
    """Record ``upper`` as a new image ``name`` on top of ``base`` (its config kept)."""
    layer = pack_upper(store, upper)
    return store.write_ref(
        name,
        [*base.diff_ids, layer.diff_id],
        base.config,
        blobs=[*base.blobs, layer.digest],
        source=base.source or base.name,
        layer_blobs=[
            *base.layer_blobs,
            LayerBlob(layer.diff_id, layer.digest, LAYER_GZIP, layer.size),
        ],
    )
