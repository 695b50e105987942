"""Garbage collection of the image store: layers and blobs no ref uses.

A layer directory that is a lower dir of a mounted overlay (a running sandbox whose image
ref was removed) is kept until that sandbox is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from dsec.edge.images.store import GcResult, ImageStore


def collect(store: ImageStore) -> GcResult:
    """Remove layers and blobs no ref uses (layers under a mounted overlay are kept)."""
    keep_layers: set[str] = set()
    keep_blobs: set[str] = set()
    for image in store.list():
        keep_layers.update(image.diff_ids)
        keep_blobs.update(b.removeprefix("sha256:") for b in image.blobs)
        keep_blobs.update(b.digest.removeprefix("sha256:") for b in image.layer_blobs)
    in_use = _mounted_lowers()
    layers = blobs = freed = 0
    if store.layers_dir.is_dir():
        for d in store.layers_dir.iterdir():
            if d.name in keep_layers or str(d) in in_use:
                continue
            if not d.is_dir():  # a layer's block image (microvm: <diff_id>.erofs) and its lock
                if d.name.split(".", 1)[0] not in keep_layers:
                    freed += d.lstat().st_size
                    d.unlink(missing_ok=True)
                continue
            freed += _du(d)
            shutil.rmtree(d, ignore_errors=True)
            layers += 1
    if store.blobs_dir.is_dir():
        for f in store.blobs_dir.iterdir():
            if f.name in keep_blobs or f.name.endswith(".part"):
                continue
            freed += f.lstat().st_size
            f.unlink(missing_ok=True)
            blobs += 1
    return GcResult(layers=layers, blobs=blobs, bytes_freed=freed)


def _mounted_lowers() -> set[str]:
    """Every directory used as an overlay lowerdir by a mount on this host."""
    out: set[str] = set()
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if " - overlay " not in line:
            continue
        for opt in line.rsplit(" ", 1)[-1].split(","):
            if opt.startswith("lowerdir="):
                out.update(p.replace("\\040", " ") for p in opt[9:].split(":") if p)
    return out


def _du(path: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for n in (*dirnames, *filenames):
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
    return total
