"""A private data dir for end-to-end image tests (images they make stay out of the shared
store): the shared agent bundle and ``base`` layers linked in, its own refs."""

from __future__ import annotations

import shutil
from pathlib import Path

from dsec.edge.images.store import ImageStore


def private_data(shared: Path, top: Path) -> Path:
    """``top/data`` linking ``shared``'s agent bundle and base image, with its own store."""
    data = top / "data"
    (data / "images" / "refs").mkdir(parents=True)
    (data / "images" / "layers" / "sha256").mkdir(parents=True)
    (data / "agent").symlink_to(shared / "agent")
    base = ImageStore(shared / "images").resolve("base")
    for d in base.layer_dirs:
        (data / "images" / "layers" / "sha256" / d.name).symlink_to(d)
    shutil.copy(shared / "images" / "refs" / "base.json", data / "images" / "refs")
    return data
