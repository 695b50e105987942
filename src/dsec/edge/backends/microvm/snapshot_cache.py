"""Snapshot files received from other edges, kept by digest so the next copy of the same
snapshot to this edge sends nothing but its manifest.

An import (``snapshot_copy.Importer``) adds what it received of the snapshot itself: the
RAM file (under the RAM directory, ``cache-<sha256>.mem``) and the device state, settings,
config disk and disk layer (``vm-cache/<sha256>``); the next import of a manifest naming
the same digests takes them from here (hard links; the disk layer is copied, since taking
it in rewrites its header). The files are immutable once here (a sandbox made from a copy
maps its RAM privately, and its disk overlay only reads the layer), so a hard link is a
copy.

``vm-cache/index.json`` records, per digest, its size, when it was last used and the
source snapshots it belongs to. :meth:`SnapshotCache.drop_source` removes what only a
deleted snapshot used; :meth:`SnapshotCache.trim` keeps the total under ``max_bytes``,
dropping the least recently used first. Files linked into live snapshots stay there
(the link count keeps their data).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

DEFAULT_MAX_MB = 2048
INDEX = "index.json"
_lock = threading.Lock()  # every import of this process shares the index


def max_bytes_from_env() -> int:
    """``DSEC_SNAPSHOT_CACHE_MB`` (0 turns the cache off), else :data:`DEFAULT_MAX_MB`."""
    raw = os.environ.get("DSEC_SNAPSHOT_CACHE_MB", "")
    return (int(raw) if raw.strip().isdigit() else DEFAULT_MAX_MB) << 20


class SnapshotCache:
    def __init__(self, cache_dir: Path, mem_dir: Path, max_bytes: int) -> None:
        self.dir, self.mem_dir, self.max_bytes = cache_dir, mem_dir, max_bytes

    @staticmethod
    def holds(name: str) -> bool:
        """Whether a transfer manifest file of this name is kept here."""
        return name == "ram" or name.startswith("snap/")

    def path(self, name: str, sha256: str) -> Path:
        return self.mem_dir / f"cache-{sha256}.mem" if name == "ram" else self.dir / sha256

    def lookup(self, name: str, entry: dict[str, Any]) -> Path | None:
        """The cached file with ``entry``'s digest and size, if any."""
        if self.max_bytes <= 0 or not self.holds(name):
            return None
        p = self.path(name, str(entry["sha256"]))
        with contextlib.suppress(OSError):
            if p.stat().st_size == entry["size"]:
                return p
        return None

    def take(self, name: str, cached: Path, dest: Path) -> None:
        """Put the cached file at ``dest`` (a link, or a copy of a disk)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".qcow2"):
            shutil.copyfile(cached, dest)
        else:
            os.link(cached, dest)

    def put(self, name: str, sha256: str, src: Path, source: str) -> None:
        """Keep verified file ``src`` (received for snapshot ``source``) by its digest."""
        if self.max_bytes <= 0 or not self.holds(name):
            return
        dest = self.path(name, sha256)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            if name.endswith(".qcow2"):
                shutil.copyfile(src, tmp)
            else:
                os.link(src, tmp)
            tmp.rename(dest)
        self.used({name: sha256}, source)

    def used(self, files: dict[str, str], source: str) -> None:
        """Record that ``files`` (name -> digest) were used now for snapshot ``source``."""
        if self.max_bytes <= 0 or not files:
            return
        with _lock:
            index = self._index()
            now = time.time()
            for name, sha in files.items():
                p = self.path(name, sha)
                if not p.exists():
                    continue
                e = index.setdefault(sha, {"name": name, "sources": []})
                e["used"], e["bytes"] = now, p.stat().st_blocks * 512
                if source and source not in e["sources"]:
                    e["sources"].append(source)
            self._save(index)

    def drop_source(self, source: str) -> int:
        """Forget snapshot ``source``: remove the files only it used; returns how many."""
        with _lock:
            index = self._index()
            gone = []
            for sha, e in index.items():
                if source in e.get("sources", []):
                    e["sources"].remove(source)
                    if not e["sources"]:
                        gone.append(sha)
            for sha in gone:
                self.path(str(index.pop(sha)["name"]), sha).unlink(missing_ok=True)
            self._save(index)
        return len(gone)

    def trim(self) -> int:
        """Drop the least recently used files until the total is within ``max_bytes``."""
        with _lock:
            index = self._index()
            total = sum(int(e.get("bytes", 0)) for e in index.values())
            gone = 0
            for sha, e in sorted(index.items(), key=lambda kv: float(kv[1].get("used", 0))):
                if total <= self.max_bytes:
                    break
                self.path(str(e["name"]), sha).unlink(missing_ok=True)
                total -= int(e.get("bytes", 0))
                del index[sha]
                gone += 1
            self._save(index)
        return gone

    def total_bytes(self) -> int:
        with _lock:
            return sum(int(e.get("bytes", 0)) for e in self._index().values())

    def _index(self) -> dict[str, dict[str, Any]]:
        try:
            d = json.loads((self.dir / INDEX).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(d, dict):
            return {}
        # entries whose file went (removed by hand, or a RAM tmpfs emptied by a reboot)
        return {k: v for k, v in d.items()
                if isinstance(v, dict) and self.path(str(v.get("name")), k).exists()}  # fmt: skip

    def _save(self, index: dict[str, dict[str, Any]]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{INDEX}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(index))
        tmp.rename(self.dir / INDEX)
