"""Sending a named snapshot to another edge and taking one in (``ExportSnapshot`` /
``ImportSnapshot``); the apiserver pipes one into the other (``apiserver/snapshot_copy``).

Export: without files asked, one message holding the transfer manifest (the snapshot's
record and the backend's list of files with sizes and digests); with files, their data
runs in chunks, then ``end``. Import: the manifest with the copy's id first; the answer is
the files this edge lacks; then their chunks and ``end``; the copy is verified, moved in
and recorded, and the answer is its record. A stream that ends or is cancelled before
``end``, a file that does not match its digest, or any other failure removes everything
received: nothing half-copied is left or can be restored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from dsec.core.errors import AlreadyExists, InvalidArgument, InvalidState, PermissionDenied
from dsec.core.ids import snapshot_edge_of
from dsec.core.lifecycle import State
from dsec.edge.manager import Caller
from dsec.edge.named_snapshots import NamedSnapshots, SnapshotRecord
from dsec.obs import log
from dsec.rpc._gen import dsec_pb2 as pb

_log = logging.getLogger("dsec.edge")


class SnapshotTransfer:
    """Export and import of this edge's full (microVM) snapshots."""

    def __init__(self, snapshots: NamedSnapshots) -> None:
        self._s = snapshots

    def _backend(self, name: str) -> Any:
        backend = self._s._m.backend(name)
        if not hasattr(backend, "export_snapshot"):
            raise InvalidArgument(f"{name} snapshots cannot be copied to another edge")
        return backend

    async def export(
        self, snapshot_id: str, files: list[str], caller: Caller, *, sandbox_id: str = ""
    ) -> AsyncIterator[pb.SnapshotChunk]:
        """``sandbox_id``: send that paused sandbox's pause snapshot (to resume it on
        another edge) instead of named snapshot ``snapshot_id``."""
        if sandbox_id:
            rec, exp = await self._paused(sandbox_id, caller)
            snapshot_id = sandbox_id
        else:
            rec = self._s.get(snapshot_id, caller)
            if rec.mode != "full":
                raise InvalidArgument(
                    f"snapshot {snapshot_id} is a {rec.mode} snapshot: only full ones are "
                    "copied (a filesystem snapshot is an image: push and pull it)"
                )
            backend = self._backend(rec.backend)
            exp = await asyncio.to_thread(backend.export_snapshot, snapshot_id)
        if not files:
            # a paused sandbox's files are sent once: the target does not cache them
            doc = {"record": json.loads(rec.to_json()), "backend": exp.manifest,
                   "cache": not sandbox_id}  # fmt: skip
            yield pb.SnapshotChunk(manifest=json.dumps(doc).encode())
            return
        from dsec.edge.backends.microvm.snapshot_copy import chunks

        sent, started = 0, time.perf_counter()
        for name in files:
            it = chunks(exp.path(name))
            while True:
                part = await asyncio.to_thread(next, it, None)
                if part is None:
                    break
                sent += len(part[1])
                yield pb.SnapshotChunk(file=name, offset=part[0], data=part[1])
        yield pb.SnapshotChunk(end=True)
        log(_log, "snapshot sent", snapshot=snapshot_id, files=len(files), bytes=sent,
            ms=round((time.perf_counter() - started) * 1000, 1))  # fmt: skip

    async def _paused(self, sandbox_id: str, caller: Caller) -> tuple[SnapshotRecord, Any]:
        """A snapshot record for paused ``sandbox_id`` and its pause snapshot's export."""
        sbx = self._s._m.get(sandbox_id, caller)
        if sbx.state is not State.PAUSED:
            raise InvalidState(
                f"sandbox {sandbox_id} is {sbx.state.value}: only a paused one moves"
            )
        backend = self._backend(sbx.spec.backend)
        exp = await asyncio.to_thread(backend.export_paused, sandbox_id)
        rec = SnapshotRecord(id=sandbox_id, name="paused", project=sbx.project, owner=sbx.owner,
                             source_sandbox=sandbox_id, backend=sbx.spec.backend, mode="full",
                             size_bytes=0, created_at=time.time(), spec=sbx.spec)  # fmt: skip
        return rec, exp

    async def import_(
        self, requests: AsyncIterator[pb.SnapshotChunk], caller: Caller
    ) -> AsyncIterator[pb.ImportSnapshotEvent]:
        first = await anext(requests, None)
        if first is None or not first.manifest:
            raise InvalidArgument("a snapshot import starts with its transfer manifest")
        copy_id = first.snapshot_id
        if snapshot_edge_of(copy_id) != self._s._m.edge_id:
            raise InvalidArgument(f"snapshot id {copy_id} does not belong to this edge")
        try:
            doc = json.loads(first.manifest)
            src = SnapshotRecord.from_json(json.dumps(doc["record"]))
            manifest = doc["backend"]
            keep = bool(doc.get("cache", True))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"bad snapshot transfer manifest: {exc}") from None
        if not caller.covers(src.project):
            raise PermissionDenied(f"cannot create snapshots in project {src.project!r}")
        if self._s._load(copy_id) is not None:
            raise AlreadyExists(f"snapshot {copy_id} already exists")
        backend = self._backend(src.backend)
        started = time.perf_counter()
        imp = await asyncio.to_thread(
            backend.snapshot_importer, copy_id, manifest, src.spec.image, source=src.id, keep=keep
        )
        try:
            yield pb.ImportSnapshotEvent(want=imp.want)
            received, ended = 0, False
            async for chunk in requests:
                if chunk.end:
                    ended = True
                    break
                received += len(chunk.data)
                await asyncio.to_thread(imp.write, chunk.file, chunk.offset, chunk.data)
            if not ended:
                raise InvalidArgument(
                    f"the transfer of snapshot {src.id} ended before all its files came: "
                    "nothing was kept"
                )
            size = await asyncio.to_thread(backend.import_commit, imp, src.source_sandbox)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(backend.import_abort, imp))
            raise
        rec = replace(src, id=copy_id, size_bytes=size, created_at=time.time())
        try:
            await asyncio.to_thread(self._s._save, rec)
        except BaseException:
            await asyncio.shield(self._s._drop_data(rec))
            raise
        log(_log, "snapshot received", snapshot=copy_id, source=src.id, files=len(imp.want),
            cached=len(imp.cached), bytes=received,
            ms=round((time.perf_counter() - started) * 1000, 1))  # fmt: skip
        from dsec.edge.service import snapshot_to_pb

        yield pb.ImportSnapshotEvent(snapshot=snapshot_to_pb(rec, self._s._m.edge_id))

    async def drop_copies(self, snapshot_id: str) -> None:
        """Forget the cached files of ``snapshot_id``, deleted on its edge."""
        for backend in list(self._s._m._backends.values()):
            dropper = getattr(backend, "drop_copies", None)
            if dropper is not None:
                n = await asyncio.to_thread(dropper, snapshot_id)
                if n:
                    log(_log, "snapshot copies dropped", snapshot=snapshot_id, files=n)
