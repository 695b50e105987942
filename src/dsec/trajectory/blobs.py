"""Content-addressed blobs for step payloads too large for the state store.

The store keeps each step's metadata; a step whose encoded form exceeds
:data:`INLINE_MAX` bytes is written here and the store holds only its digest. On one node
the blobs are files under ``<home>/trajectory/blobs/sha256/ab/<hex>`` (written to a temp
file, fsynced, renamed: a blob either exists whole or not at all). In a cluster every
apiserver must reach the same blobs: mount one shared directory (NFS, CephFS) there, or put
an object store behind :class:`BlobStore` (same interface: put by digest, get, delete).
Content addressing makes writes idempotent, so two apiservers racing on one blob is fine.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from dsec.core.errors import InvalidArgument, NotFound

INLINE_MAX = 64 * 1024


class BlobStore(Protocol):
    async def put(self, data: bytes) -> str: ...

    async def get(self, digest: str) -> bytes: ...

    async def delete(self, digest: str) -> None: ...

    def digests(self) -> Iterator[tuple[str, float]]: ...


def _hex(digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd):
        raise InvalidArgument(f"invalid blob digest {digest!r}")
    return hexd


class FileBlobStore:
    """Blobs as files on this node (see the module docstring for clusters)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, digest: str) -> Path:
        h = _hex(digest)
        return self.root / "sha256" / h[:2] / h

    def _put(self, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        path = self._path(digest)
        if path.exists():
            return digest
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(data)}.tmp")
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        return digest

    def _get(self, digest: str) -> bytes:
        try:
            return self._path(digest).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"trajectory blob {digest} is missing") from None

    async def put(self, data: bytes) -> str:
        return await asyncio.to_thread(self._put, data)

    async def get(self, digest: str) -> bytes:
        return await asyncio.to_thread(self._get, digest)

    async def delete(self, digest: str) -> None:
        await asyncio.to_thread(self._path(digest).unlink, missing_ok=True)

    def digests(self) -> Iterator[tuple[str, float]]:
        """Every stored blob and its modification time (for the sweeper)."""
        base = self.root / "sha256"
        if not base.is_dir():
            return
        for sub in base.iterdir():
            for f in sub.iterdir():
                if not f.name.startswith("."):
                    yield "sha256:" + f.name, f.stat().st_mtime
