"""Named snapshots on one edge: take one of a running sandbox (it keeps running), list,
delete, and start new sandboxes from one.

Two kinds, by backend:

* ``full`` (microvm): guest RAM, device state and disk, a fork template the backend keeps
  until the snapshot is deleted; a sandbox made from it resumes where the source was
  (processes, shells, memory), after every file is checked against its sha256 manifest.
* ``filesystem`` (container): the sandbox's changes packed as image ``dsec-snapshots/<id>``
  on this edge; a sandbox made from it boots that image (no processes carried over).

A record per snapshot (``<id>.json`` under the edge's ``snapshots`` directory) says who owns
it: its project, owner, source sandbox, backend, size and the source's spec. Only callers
whose role covers the project see or use it. Snapshot ids name their edge
(``snp-<edge>-<random>``), so the apiserver routes without a table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dsec.core import projects
from dsec.core.errors import (
    AlreadyExists,
    InvalidArgument,
    InvalidState,
    NotFound,
    PermissionDenied,
    SnapshotNotFound,
)
from dsec.core.ids import snapshot_edge_of
from dsec.core.lifecycle import State
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import SandboxPaths, Started
from dsec.edge.images.service import EdgeImages
from dsec.edge.manager import Caller, SandboxManager
from dsec.edge.records import SandboxRecord
from dsec.obs import log

_log = logging.getLogger("dsec.edge")

MODES = ("full", "filesystem")
IMAGE_PREFIX = "dsec-snapshots/"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRecord:
    id: str
    name: str
    project: str
    owner: str
    source_sandbox: str
    backend: str
    mode: str
    size_bytes: int
    created_at: float
    spec: SandboxSpec

    def to_json(self) -> str:
        d = asdict(self)
        d["spec"] = self.spec.to_dict()
        return json.dumps(d)

    @classmethod
    def from_json(cls, raw: str) -> SnapshotRecord:
        d: dict[str, Any] = json.loads(raw)
        d["spec"] = SandboxSpec.from_dict(d["spec"])
        return cls(**d)


def validate_name(name: str) -> str:
    if name and not _NAME_RE.match(name):
        raise InvalidArgument(
            f"invalid snapshot name {name!r}: up to 128 letters, digits and ._:/@- "
            "(starting with a letter or digit)"
        )
    return name


class NamedSnapshots:
    """The edge's named snapshots (see the module docstring)."""

    def __init__(self, manager: SandboxManager, images: EdgeImages | None, root: Path) -> None:
        self._m = manager
        self._images = images
        self._root = root
        self._lock = asyncio.Lock()  # one snapshot taken at a time per edge

    # ---- records -----------------------------------------------------------------------

    def _path(self, snapshot_id: str) -> Path:
        snapshot_edge_of(snapshot_id)  # a malformed id is not found
        return self._root / f"{snapshot_id}.json"

    def _load(self, snapshot_id: str) -> SnapshotRecord | None:
        try:
            return SnapshotRecord.from_json(self._path(snapshot_id).read_text())
        except FileNotFoundError:
            return None

    def _save(self, rec: SnapshotRecord) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        tmp = self._root / f".{rec.id}.tmp"
        tmp.write_text(rec.to_json())
        tmp.rename(self._root / f"{rec.id}.json")

    def get(self, snapshot_id: str, caller: Caller) -> SnapshotRecord:
        rec = self._load(snapshot_id)
        if rec is None:
            raise SnapshotNotFound(f"no snapshot {snapshot_id}")
        _check(caller, rec)
        return rec

    def query(self, caller: Caller, *, project: str = "", sandbox_id: str = "",
              name: str = "") -> list[SnapshotRecord]:  # fmt: skip
        out = []
        for p in sorted(self._root.glob("snp-*.json")) if self._root.exists() else ():
            try:
                rec = SnapshotRecord.from_json(p.read_text())
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not caller.covers(rec.project):
                continue
            if project and not projects.contains(project, rec.project):
                continue
            if (sandbox_id and rec.source_sandbox != sandbox_id) or (name and rec.name != name):
                continue
            out.append(rec)
        out.sort(key=lambda r: r.created_at)
        return out

    # ---- create / delete ---------------------------------------------------------------

    async def create(
        self, sandbox_id: str, snapshot_id: str, name: str, mode: str, caller: Caller
    ) -> SnapshotRecord:
        """Snapshot the running ``sandbox_id`` as ``snapshot_id``; nothing is left behind
        if it fails.

        Raises:
            InvalidArgument: bad name or mode, or the backend cannot take this kind.
            InvalidState: the sandbox is not running.
        """
        src = self._m.get(sandbox_id, caller)
        validate_name(name)
        if mode not in ("", *MODES):
            raise InvalidArgument(f"snapshot mode must be one of {', '.join(MODES)}, not {mode!r}")
        if snapshot_edge_of(snapshot_id) != self._m.edge_id:
            raise InvalidArgument(f"snapshot id {snapshot_id} does not belong to this edge")
        if src.state is not State.RUNNING:
            raise InvalidState(f"sandbox {sandbox_id} is {src.state.value}: only a running one "
                               "can be snapshotted")  # fmt: skip
        backend = self._m.backend(src.spec.backend)
        full = getattr(backend, "snapshot", None)
        kinds = (["full"] if full is not None else []) + (
            ["filesystem"] if src.spec.backend == "container" else []
        )
        if not kinds or (mode and mode not in kinds):
            takes = f"it takes {kinds[0]} snapshots only" if kinds else "it takes none"
            raise InvalidArgument(
                f"the {src.spec.backend} backend cannot take {mode or 'any'} snapshots: {takes}"
            )
        mode = mode or kinds[0]
        async with self._lock:
            if self._load(snapshot_id) is not None:
                raise AlreadyExists(f"snapshot {snapshot_id} already exists")
            started = time.perf_counter()
            if mode == "full":
                assert full is not None
                size = await full(sandbox_id, snapshot_id)
            else:
                size = await self._pack(src, snapshot_id)
            rec = SnapshotRecord(
                id=snapshot_id,
                name=name,
                project=src.project,
                owner=caller.subject or src.owner,
                source_sandbox=sandbox_id,
                backend=src.spec.backend,
                mode=mode,
                size_bytes=int(size),
                created_at=time.time(),
                spec=src.spec,
            )
            try:
                await asyncio.to_thread(self._save, rec)
            except BaseException:
                await self._drop_data(rec)
                raise
        ms = round((time.perf_counter() - started) * 1000, 1)
        log(_log, "snapshot taken", snapshot=snapshot_id, sandbox=sandbox_id, mode=mode,
            size_bytes=rec.size_bytes, ms=ms)  # fmt: skip
        return rec

    async def _pack(self, src: SandboxRecord, snapshot_id: str) -> int:
        if self._images is None:
            raise InvalidArgument("this edge has no image store: no filesystem snapshots")
        backend = self._m.backend(src.spec.backend)
        upper = self._m.paths(src.id).state_dir / "upper"
        await backend.pause(src.id)  # a still upper dir while it is read
        try:
            image = await self._images.pack(upper, src.spec.image, IMAGE_PREFIX + snapshot_id)
        finally:
            await backend.resume(src.id)
        top = image.layer_blobs[-1].size if image.layer_blobs else 0
        return int(top)

    async def delete(self, snapshot_id: str, caller: Caller) -> SnapshotRecord:
        """Remove the snapshot (sandboxes started from it keep running)."""
        rec = self.get(snapshot_id, caller)
        await self._drop_data(rec)
        self._path(snapshot_id).unlink(missing_ok=True)
        log(_log, "snapshot deleted", snapshot=snapshot_id)
        return rec

    async def _drop_data(self, rec: SnapshotRecord) -> None:
        if rec.mode == "full":
            backend = self._m.backend(rec.backend)
            with contextlib.suppress(NotFound):
                await backend.delete_snapshot(rec.id)  # type: ignore[attr-defined]
        elif self._images is not None:
            with contextlib.suppress(NotFound):
                self._images.remove(IMAGE_PREFIX + rec.id)

    # ---- create a sandbox from one -----------------------------------------------------

    async def create_sandbox(
        self,
        snapshot_id: str,
        sandbox_id: str,
        spec: SandboxSpec,
        *,
        project: str,
        owner: str,
        caller: Caller,
        moved_from: str = "",
    ) -> SandboxRecord:
        """Start ``sandbox_id`` from the snapshot. The snapshot decides backend, image, CPU
        and memory; ``spec`` brings the lifetime, env and metadata; ``moved_from`` names the
        sandbox this one continues (a move)."""
        snap = self.get(snapshot_id, caller)
        if not caller.covers(project):
            raise PermissionDenied(f"cannot create sandboxes in project {project!r}")
        spec = replace(snap.spec, timeout_s=spec.timeout_s, metadata=spec.metadata)
        if snap.mode == "filesystem":
            spec = replace(spec, image=IMAGE_PREFIX + snap.id)
            return await self._m.create(sandbox_id, spec, project=project, owner=owner,
                                        caller=caller, moved_from=moved_from)  # fmt: skip
        backend = self._m.backend(snap.backend)

        async def start(paths: SandboxPaths) -> Started:
            started: Started = await backend.create_from_snapshot(  # type: ignore[attr-defined]
                snap.id, sandbox_id, paths
            )
            return started

        return await self._m.create(sandbox_id, spec, project=project, owner=owner,
                                    caller=caller, start=start, moved_from=moved_from)  # fmt: skip


def _check(caller: Caller, rec: SnapshotRecord) -> None:
    if caller.covers(rec.project):
        return
    if any(r == "*" or projects.contains(r, rec.project) for r in caller.visible):
        raise PermissionDenied(f"your role on project {rec.project!r} does not allow this")
    raise SnapshotNotFound(f"no snapshot {rec.id}")  # do not reveal other projects' snapshots
