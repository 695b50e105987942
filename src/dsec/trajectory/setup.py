"""Opening the trajectory log the apiserver was configured with."""

from __future__ import annotations

from pathlib import Path

from dsec.core.errors import InvalidArgument
from dsec.store.api import StateStore
from dsec.store.etcd import EtcdStore
from dsec.store.sqlite import SqliteStore

from .blobs import FileBlobStore
from .log import TrajectoryLog


async def open_store(url: str, *, sync: str = "FULL") -> StateStore:
    """``sqlite:PATH`` (one node) or ``etcd:ENDPOINT[,ENDPOINT...]`` (a cluster).

    ``sync`` (SQLite only): ``FULL`` fsyncs every step before it is answered (survives
    power loss); ``NORMAL`` writes it to the WAL before it is answered (survives a crash of
    the apiserver, not of the node) and fsyncs at WAL checkpoints.
    """
    scheme, _, rest = url.partition(":")
    if scheme == "sqlite" and rest:
        path = Path(rest)
        path.parent.mkdir(parents=True, exist_ok=True)
        return await SqliteStore.open(path, synchronous=sync.upper(), retain_revisions=10_000)
    if scheme == "etcd" and rest:
        endpoints = [e.removeprefix("http://") for e in rest.split(",") if e]
        return EtcdStore(endpoints)
    raise InvalidArgument(f"trajectory store {url!r}: use sqlite:PATH or etcd:HOST:PORT[,...]")


async def open_log(
    url: str, blobs: Path, *, default_quota_bytes: int = 0, sync: str = "FULL"
) -> TrajectoryLog:
    store = await open_store(url, sync=sync)
    return TrajectoryLog(store, FileBlobStore(blobs), default_quota_bytes=default_quota_bytes)
