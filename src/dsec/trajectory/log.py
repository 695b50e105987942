"""The trajectory log on a :class:`~dsec.store.StateStore` (memory, SQLite or etcd).

Layout (all keys under ``/dsec/trajectory/``)::

    t/<id>             the trajectory record (JSON): name, project, sandbox, step count,
                       bytes, replay cursor and mode, policy, checkpoints, last divergence
    s/<id>/<n:010d>    step n (JSON): canonical request, result, payload; or, when the
                       encoded step is over 64 KiB, a stub naming its blob (``blobs.py``)
    b/<sandbox id>     the record of the trajectory the sandbox is bound to: a copy of
                       t/<id>, written in the same transactions, so the hot path (a call
                       of a bound sandbox) finds its trajectory with one read
    u/<project>        bytes of log the project holds (for its quota)
    q/<project>        the project's quota on log bytes (absent: the server default)

A step is appended in one transaction with the record (step count, bytes) and the
project's usage, each guarded by its ``mod_revision``: two writers never number two steps
alike and usage is never lost. Each log object remembers the usage entry it last wrote or
read; a stale one only makes the guarded transaction fail once and read again. The blob
(if any) is written and fsynced first, so a step in the store always has its payload.
``<id>`` is derived from (project, name), so the same name in two projects is two
trajectories.
"""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from dsec.core.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
)
from dsec.store.api import Compare, Delete, KeyValue, Op, Put, StateStore, Target, TxnOp

from .blobs import INLINE_MAX, BlobStore
from .records import (
    MAX_NAME,
    MISMATCH_POLICIES,
    Step,
    Trajectory,
    check_name,
    trajectory_id,
)

__all__ = [
    "MAX_NAME",
    "MISMATCH_POLICIES",
    "PREFIX",
    "Step",
    "Trajectory",
    "TrajectoryLog",
    "check_name",
    "trajectory_id",
]

PREFIX = b"/dsec/trajectory/"
QUOTA_CACHE_S = 5.0
_DELETE_BATCH = 100


def _meta_key(tid: str) -> bytes:
    return PREFIX + b"t/" + tid.encode()


def _steps_prefix(tid: str) -> bytes:
    return PREFIX + b"s/" + tid.encode() + b"/"


def _step_key(tid: str, n: int) -> bytes:
    return _steps_prefix(tid) + f"{n:010d}".encode()


def _bind_key(sandbox_id: str) -> bytes:
    return PREFIX + b"b/" + sandbox_id.encode()


def _usage_key(project: str) -> bytes:
    return PREFIX + b"u/" + project.encode()


def _quota_key(project: str) -> bytes:
    return PREFIX + b"q/" + project.encode()


def _record_puts(t: Trajectory) -> list[TxnOp]:
    """The record, and its copy under the sandbox binding (see the module docstring)."""
    raw = json.dumps(t.to_json()).encode()
    puts: list[TxnOp] = [Put(_meta_key(t.id), raw)]
    if t.sandbox_id:
        puts.append(Put(_bind_key(t.sandbox_id), raw))
    return puts


def _guard(key: bytes, kv: KeyValue | None) -> Compare:
    return Compare(key, Target.MOD, Op.EQ, kv.mod_revision if kv else 0)


def _int(kv: KeyValue | None) -> int:
    return int(kv.value) if kv else 0


class TrajectoryLog:
    """Trajectories on ``store``; step payloads over 64 KiB go to ``blobs``."""

    def __init__(
        self,
        store: StateStore,
        blobs: BlobStore,
        *,
        default_quota_bytes: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.default_quota_bytes = default_quota_bytes
        self.clock = clock
        self._quotas: dict[str, tuple[float, int]] = {}  # project -> (read at, limit)
        self._usage: dict[str, KeyValue | None] = {}  # project -> usage entry last seen

    # -- records --------------------------------------------------------------------------

    async def _read(self, tid: str) -> tuple[Trajectory, KeyValue]:
        kv = await self.store.get(_meta_key(tid))
        if kv is None:
            raise NotFound(f"no trajectory {tid}")
        return Trajectory.from_json(json.loads(kv.value)), kv

    async def get(self, tid: str) -> Trajectory:
        return (await self._read(tid))[0]

    async def find(self, project: str, name: str) -> Trajectory | None:
        kv = await self.store.get(_meta_key(trajectory_id(project, check_name(name))))
        return Trajectory.from_json(json.loads(kv.value)) if kv else None

    async def list(self, project: str = "") -> builtins.list[Trajectory]:
        res = await self.store.range(PREFIX + b"t/")
        out = [Trajectory.from_json(json.loads(kv.value)) for kv in res.kvs]
        if project:
            out = [t for t in out if t.project == project or t.project.startswith(project + "/")]
        return sorted(out, key=lambda t: t.created_at)

    async def update(
        self,
        tid: str,
        fn: Callable[[Trajectory], Trajectory],
        extra: tuple[TxnOp, ...] = (),
        *,
        known: KeyValue | None = None,
    ) -> Trajectory:
        """Apply ``fn`` to the record atomically (retried if someone else wrote it);
        ``known``: the record as last read, tried first without reading it again."""
        while True:
            if known is not None:
                t, kv = Trajectory.from_json(json.loads(known.value)), known
                known = None
            else:
                t, kv = await self._read(tid)
            new = replace(fn(t), updated_at=self.clock())
            res = await self.store.txn([_guard(kv.key, kv)], [*_record_puts(new), *extra])
            if res.succeeded:
                return new

    async def open(
        self,
        project: str,
        name: str,
        *,
        spec: dict[str, Any],
        on_mismatch: str = "diverge",
        checkpoint_every: int = 0,
    ) -> tuple[Trajectory, bool]:
        """The trajectory ``name`` of ``project``, created if new (then True). An existing
        one with steps starts replaying from step 0."""
        check_name(name)
        if on_mismatch not in MISMATCH_POLICIES:
            raise InvalidArgument(f"on_mismatch must be one of {', '.join(MISMATCH_POLICIES)}")
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
            raise InvalidArgument("checkpoint_every must be an integer (0: never)")
        if checkpoint_every < 0:
            raise InvalidArgument("checkpoint_every must be >= 0 (0: never)")
        tid = trajectory_id(project, name)
        now = self.clock()
        fresh = Trajectory(
            id=tid,
            project=project,
            name=name,
            created_at=now,
            updated_at=now,
            on_mismatch=on_mismatch,
            checkpoint_every=checkpoint_every,
            spec=spec,
        )
        key = _meta_key(tid)
        res = await self.store.txn(
            [Compare(key, Target.CREATE, Op.EQ, 0)],
            [Put(key, json.dumps(fresh.to_json()).encode())],
        )
        if res.succeeded:
            return fresh, True

        def reopen(t: Trajectory) -> Trajectory:
            return replace(
                t,
                mode="replay" if t.steps else "record",
                cursor=0,
                replayed=0,
                on_mismatch=on_mismatch,
                checkpoint_every=checkpoint_every,
                divergence=None,
            )

        return await self.update(tid, reopen), False

    async def bind(self, tid: str, sandbox_id: str) -> Trajectory:
        """Bind ``sandbox_id`` to the trajectory (its calls are recorded from now on)."""
        bound = await self.store.get(_bind_key(sandbox_id))
        if bound is not None and json.loads(bound.value)["id"] != tid:
            raise AlreadyExists(f"sandbox {sandbox_id} is bound to another trajectory")
        t = await self.get(tid)
        extra: tuple[TxnOp, ...] = ()
        if t.sandbox_id and t.sandbox_id != sandbox_id:
            extra += (Delete(_bind_key(t.sandbox_id)),)
        return await self.update(tid, lambda t: replace(t, sandbox_id=sandbox_id), extra)

    async def for_sandbox(self, sandbox_id: str) -> Trajectory | None:
        found = await self.lookup(sandbox_id)
        return found[0] if found else None

    async def lookup(self, sandbox_id: str) -> tuple[Trajectory, KeyValue] | None:
        """The trajectory ``sandbox_id`` is bound to, and its record as read (for
        ``known=`` in :meth:`update` and :meth:`append`)."""
        kv = await self.store.get(_bind_key(sandbox_id))
        if kv is None:
            return None
        t = Trajectory.from_json(json.loads(kv.value))
        # Written in the same transaction as t/<id>: the same mod_revision guards both.
        return t, replace(kv, key=_meta_key(t.id))

    # -- steps ----------------------------------------------------------------------------

    async def _decode(self, raw: bytes) -> Step:
        d = json.loads(raw)
        if "blob" in d:
            return Step.decode(await self.blobs.get(d["blob"]))
        return Step.decode(raw)

    async def step(self, tid: str, n: int) -> Step | None:
        kv = await self.store.get(_step_key(tid, n))
        return await self._decode(kv.value) if kv else None

    async def steps(self, tid: str, start: int = 0) -> AsyncIterator[Step]:
        t = await self.get(tid)
        for n in range(start, t.steps):
            s = await self.step(tid, n)
            if s is not None:
                yield s

    async def quota(self, project: str, *, max_age_s: float = 0) -> int:
        """The project's limit; ``max_age_s`` > 0 accepts a value read that recently (the
        hot path: a quota set on another apiserver applies here within that time)."""
        cached = self._quotas.get(project)
        if cached and max_age_s and self.clock() - cached[0] < max_age_s:
            return cached[1]
        kv = await self.store.get(_quota_key(project))
        limit = _int(kv) if kv else self.default_quota_bytes
        self._quotas[project] = (self.clock(), limit)
        return limit

    async def set_quota(self, project: str, limit_bytes: int) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise InvalidArgument("a trajectory quota is a number of bytes >= 0 (0: no limit)")
        await self.store.put(_quota_key(project), str(limit_bytes).encode())
        self._quotas.pop(project, None)

    async def _check_quota(self, project: str, used: int) -> None:
        limit = await self.quota(project, max_age_s=QUOTA_CACHE_S)
        if limit and used >= limit:
            raise QuotaExceeded(
                f"the trajectory log of project {project!r} holds {used} bytes, at or over its "
                f"quota of {limit} bytes; remove old trajectories (dsec trajectory rm) or "
                "raise the quota"
            )

    async def check_quota(self, project: str) -> KeyValue | None:
        """Refuse (QuotaExceeded) when the project's log is at or over its quota; the step
        that crosses it is still recorded, the calls after it are refused before they run.
        Returns the usage as read (for ``known=`` in :meth:`append`)."""
        if project in self._usage:
            kv = self._usage[project]
        else:
            kv = self._usage[project] = await self.store.get(_usage_key(project))
        await self._check_quota(project, _int(kv))
        return kv

    async def usage(self, project: str) -> int:
        return _int(await self.store.get(_usage_key(project)))

    async def append(
        self,
        tid: str,
        make: Callable[[int], Step],
        *,
        known: tuple[KeyValue, KeyValue | None] | None = None,
    ) -> Step:
        """Record ``make(n)`` as the next step n; the log advances past it (record mode).
        ``known``: the record and the project's usage as last read, tried first."""
        while True:
            if known is not None:
                meta, usage = known
                t = Trajectory.from_json(json.loads(meta.value))
            else:
                t, meta = await self._read(tid)
            ukey = _usage_key(t.project)
            if known is None:
                usage = await self.store.get(ukey)
            known = None
            step = make(t.steps)
            raw = step.encode()
            size = len(raw)
            stored = raw
            if size > INLINE_MAX:
                digest = await self.blobs.put(raw)
                stored = json.dumps({"n": step.n, "blob": digest, "size": size}).encode()
            await self._check_quota(t.project, _int(usage))
            new = replace(
                t,
                steps=t.steps + 1,
                bytes=t.bytes + size,
                cursor=t.steps + 1,
                mode="record",
                updated_at=self.clock(),
            )
            used = str(_int(usage) + size).encode()
            res = await self.store.txn(
                [_guard(meta.key, meta), _guard(ukey, usage)],
                [Put(_step_key(tid, step.n), stored), *_record_puts(new), Put(ukey, used)],
            )
            if res.succeeded:
                self._saw_usage(ukey, t.project, used, res.revision)
                return step
            self._usage.pop(t.project, None)

    def _saw_usage(self, ukey: bytes, project: str, value: bytes, revision: int) -> None:
        self._usage[project] = KeyValue(ukey, value, revision, revision, 1)

    async def _sizes(self, tid: str, start: int) -> tuple[builtins.list[bytes], int]:
        res = await self.store.range(_steps_prefix(tid))
        keys, total = [], 0
        for kv in res.kvs:
            if int(kv.key.rsplit(b"/", 1)[1]) >= start:
                keys.append(kv.key)
                d = json.loads(kv.value)
                total += int(d["size"]) if "blob" in d else len(kv.value)
        return keys, total

    async def truncate(
        self, tid: str, start: int, fn: Callable[[Trajectory], Trajectory]
    ) -> Trajectory:
        """Drop steps ``start`` and after (a diverged replay), applying ``fn`` too."""
        while True:
            t, meta = await self._read(tid)
            keys, freed = await self._sizes(tid, start)
            ukey = _usage_key(t.project)
            usage = await self.store.get(ukey)
            new = replace(fn(t), steps=min(t.steps, start), bytes=max(0, t.bytes - freed))
            used = str(max(0, _int(usage) - freed)).encode()
            res = await self.store.txn(
                [_guard(meta.key, meta), _guard(ukey, usage)],
                [*_record_puts(new), Put(ukey, used)],
            )
            if res.succeeded:
                self._saw_usage(ukey, t.project, used, res.revision)
                break
        for i in range(0, len(keys), _DELETE_BATCH):
            await self.store.txn([], [Delete(k) for k in keys[i : i + _DELETE_BATCH]])
        return new

    async def remove(self, tid: str) -> Trajectory:
        """Delete a trajectory, its steps and its binding (blobs go with the next sweep)."""
        t, meta = await self._read(tid)
        while True:
            ukey = _usage_key(t.project)
            usage = await self.store.get(ukey)
            used = str(max(0, _int(usage) - t.bytes)).encode()
            ops: list[TxnOp] = [
                Delete(meta.key),
                Delete(_steps_prefix(tid), prefix=True),
                Put(ukey, used),
            ]
            if t.sandbox_id:
                ops.append(Delete(_bind_key(t.sandbox_id)))
            res = await self.store.txn([_guard(meta.key, meta), _guard(ukey, usage)], ops)
            if res.succeeded:
                self._saw_usage(ukey, t.project, used, res.revision)
                return t
            t, meta = await self._read(tid)

    async def referenced_blobs(self) -> set[str]:
        res = await self.store.range(PREFIX + b"s/")
        out = set()
        for kv in res.kvs:
            d = json.loads(kv.value)
            if "blob" in d:
                out.add(str(d["blob"]))
        return out
