"""The trajectory log on a :class:`~dsec.store.StateStore` (memory, SQLite or etcd).

Layout (all keys under ``/dsec/trajectory/``)::

    t/<id>             the trajectory record (JSON): name, project, sandbox, step count,
                       bytes, replay cursor and mode, policy, checkpoints, last divergence;
                       its step count and bytes as of when it was last written (below)
    s/<id>/<n:010d>    step n (JSON): canonical request, result, payload; or, when the
                       encoded step is over 64 KiB, a stub naming its blob (``blobs.py``)
    b/<sandbox id>     ``{"id": <id>}``: the trajectory the sandbox is bound to, written
                       when it is bound (valid only while t/<id> names the sandbox too)
    q/<project>        the quota on the log bytes of the project and every project
                       beneath it (absent: the server default), as sandbox quotas bound
                       a subtree

A step is appended in a transaction guarded by the record's ``mod_revision`` (no one
re-opened, rebound, truncated or removed the trajectory since the writer read it) and by
the step's key not existing yet: two writers never number two steps alike, and steps of
other trajectories never contend with it. The record itself is written again only by every
``RECORD_EVERY``-th append and by an append whose step is a blob (with the step count and
bytes), not by each one: rewriting it was a quarter of a recorded call's work. So the
steps after the count the record holds are its tail; every read of a record adds its tail
(one range read, fewer than ``RECORD_EVERY`` steps of at most 64 KiB), and every write of
a record is made from such a read, so no write loses a step. A writer that keeps the
record it last wrote (the apiserver, per recording sandbox) knows its tail and reads
nothing. A project's usage is not a counter every step
rewrites (one hot key per project, every concurrent append of the project conflicting on
it): it is the sum of the ``bytes`` of its subtree's records, as stored. Each log object
sums them once (a range read at revision R) and then follows the records with a watch from
R + 1 (:class:`_Usage`): a step this object appended is counted from what it wrote, a
record another apiserver wrote is decoded when the usage is next needed; nothing re-reads
every record. So a quota holds exactly within one apiserver; across apiservers, within the
watch's delay and the tails of the others' trajectories (fewer than ``RECORD_EVERY``
inline steps each).
The blob (if any) is written and fsynced first, so a step in the store always has its
payload. ``<id>`` is derived from (project, name), so the same name in two projects is two
trajectories.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from dsec.core import projects
from dsec.core.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
)
from dsec.obs import log
from dsec.store.api import (
    Compare,
    Delete,
    Event,
    EventType,
    KeyValue,
    Op,
    Put,
    StateStore,
    Target,
    TxnOp,
)

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
RECORD_EVERY = 16  # an append writes the record every this many steps (see above)
QUOTA_CACHE_S = 5.0  # how long a quota read stays good (a changed quota applies within it)
_DELETE_BATCH = 100
_log = logging.getLogger("dsec.trajectory.log")


def _meta_key(tid: str) -> bytes:
    return PREFIX + b"t/" + tid.encode()


def _steps_prefix(tid: str) -> bytes:
    return PREFIX + b"s/" + tid.encode() + b"/"


def _step_key(tid: str, n: int) -> bytes:
    return _steps_prefix(tid) + f"{n:010d}".encode()


def _bind_key(sandbox_id: str) -> bytes:
    return PREFIX + b"b/" + sandbox_id.encode()


def _quota_key(project: str) -> bytes:
    return PREFIX + b"q/" + project.encode()


def _record_put(t: Trajectory) -> Put:
    return Put(_meta_key(t.id), t.encode())


@functools.lru_cache(maxsize=4096)
def _levels(project: str) -> tuple[str, ...]:
    """The projects whose quota a step of ``project`` counts against: it and its ancestors
    (asked on every recorded call: kept per project)."""
    return tuple(projects.ancestors(project)) if project else (project,)


def _guard(key: bytes, kv: KeyValue | None) -> Compare:
    return Compare(key, Target.MOD, Op.EQ, kv.mod_revision if kv else 0)


def _stored_size(d: dict[str, Any], raw: bytes) -> int:
    """The log bytes of a stored step ``raw`` (decoded: ``d``): its blob's size for a stub."""
    return int(d["size"]) if "blob" in d else len(raw)


def _int(kv: KeyValue | None) -> int:
    return int(kv.value) if kv else 0


class _Usage:
    """Log bytes per project, from the records as stored: summed once, then kept by a
    watch on the records (see the module docstring). ``note`` takes a record's size at a
    revision (this object's own writes: no decoding), ``fold`` applies what the watch saw."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.bytes: dict[str, int] = {}  # project (exact) -> log bytes
        self.subtree: dict[str, int] = {}  # project -> log bytes of it and all beneath it
        self._sized: dict[bytes, tuple[int, str, int]] = {}  # record key -> (rev, project, bytes)
        self._gone: dict[bytes, int] = {}  # removed record -> the revision that removed it
        self._seen: dict[bytes, Event] = {}  # the latest event of each record, not folded yet
        self._watched = 0  # the last revision the watch delivered
        self.summed = False  # (bytes holds every record, not only this object's writes)
        self._follow: asyncio.Task[None] | None = None

    @property
    def live(self) -> bool:
        return self._follow is not None and not self._follow.done()

    def note(self, key: bytes, rev: int, project: str, size: int | None) -> None:
        """The record ``key`` holds ``size`` bytes of ``project`` as of ``rev`` (None: it
        was removed at ``rev``); older news than what is known is ignored."""
        cur = self._sized.get(key)
        if (cur is not None and cur[0] >= rev) or self._gone.get(key, 0) >= rev:
            return
        if cur is not None:
            self._add(cur[1], -cur[2])
        if size is None:
            self._sized.pop(key, None)
            self._gone[key] = rev
            return
        self._sized[key] = (rev, project, size)
        self._add(project, size)

    def _add(self, project: str, size: int) -> None:
        self.bytes[project] = self.bytes.get(project, 0) + size
        for level in _levels(project):  # (a quota check reads one sum per level)
            self.subtree[level] = self.subtree.get(level, 0) + size

    def fold(self) -> None:
        seen, self._seen = self._seen, {}
        for key, ev in seen.items():
            rev = ev.kv.mod_revision
            if ev.type is EventType.DELETE:
                self.note(key, rev, "", None)
            elif (cur := self._sized.get(key)) is None or cur[0] < rev:
                d = json.loads(ev.kv.value)
                self.note(key, rev, str(d["project"]), int(d.get("bytes", 0)))
        if self._gone:  # no event older than what the watch delivered can come any more
            self._gone = {k: r for k, r in self._gone.items() if r > self._watched}

    async def start(self) -> None:
        """Sum every record (once), then follow them from the next revision."""
        if self._follow is not None:
            self._follow.cancel()
        res = await self.store.range(PREFIX + b"t/")
        self._sized, sums = await asyncio.to_thread(_sized, res.kvs)
        self.bytes, self.subtree = {}, {}
        for project, size in sums.items():
            self._add(project, size)
        self._gone, self._seen, self._watched = {}, {}, res.revision
        self.summed = True
        self._follow = asyncio.ensure_future(self._watch(res.revision + 1))

    async def _watch(self, start: int) -> None:
        try:
            async for batch in self.store.watch(PREFIX + b"t/", start_revision=start):
                for ev in batch.events:
                    self._seen[ev.kv.key] = ev
                self._watched = batch.revision
        except Exception as exc:  # (compacted past it, the store closed...: sum again)
            log(_log, "trajectory usage watch ended", level=logging.INFO, error=str(exc))

    async def aclose(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)


def _sized(kvs: tuple[KeyValue, ...]) -> tuple[dict[bytes, tuple[int, str, int]], dict[str, int]]:
    sized: dict[bytes, tuple[int, str, int]] = {}
    sums: dict[str, int] = {}
    for kv in kvs:
        d = json.loads(kv.value)
        project, size = str(d["project"]), int(d.get("bytes", 0))
        sized[kv.key] = (kv.mod_revision, project, size)
        sums[project] = sums.get(project, 0) + size
    return sized, sums


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
        self._usage = _Usage(store)
        self._starting: asyncio.Task[None] | None = None

    async def aclose(self) -> None:
        """Stop following the records (the store stays open)."""
        await self._usage.aclose()

    # -- records --------------------------------------------------------------------------

    async def _read(self, tid: str) -> tuple[Trajectory, KeyValue]:
        kv = await self.store.get(_meta_key(tid))
        if kv is None:
            raise NotFound(f"no trajectory {tid}")
        return await self._current(kv), kv

    async def _current(self, kv: KeyValue) -> Trajectory:
        return await self._with_tail(Trajectory.from_json(json.loads(kv.value)))

    async def _with_tail(self, t: Trajectory) -> Trajectory:
        """``t`` as stored, with its tail: the steps appended since it was written. Only a
        record in record mode has one (an append to any other writes the record; a replay
        reads nothing more per call)."""
        if t.mode != "record":
            return t
        res = await self.store.range(_steps_prefix(t.id), start=_step_key(t.id, t.steps))
        if not res.kvs:
            return t
        size, at = 0, t.updated_at
        for step in res.kvs:
            d = json.loads(step.value)
            size += _stored_size(d, step.value)
            at = max(at, float(d.get("at", 0.0)))
        n = int(res.kvs[-1].key.rsplit(b"/", 1)[1]) + 1
        return replace(t, steps=n, cursor=n, bytes=t.bytes + size, updated_at=at)

    async def get(self, tid: str) -> Trajectory:
        return (await self._read(tid))[0]

    async def find(self, project: str, name: str) -> Trajectory | None:
        kv = await self.store.get(_meta_key(trajectory_id(project, check_name(name))))
        return await self._current(kv) if kv else None

    async def list(self, project: str = "") -> builtins.list[Trajectory]:
        res = await self.store.range(PREFIX + b"t/")
        out = [Trajectory.from_json(json.loads(kv.value)) for kv in res.kvs]
        if project:
            out = [t for t in out if projects.contains(project, t.project)]
        out = [await self._with_tail(t) for t in out]
        return sorted(out, key=lambda t: t.created_at)

    async def update(
        self,
        tid: str,
        fn: Callable[[Trajectory], Trajectory],
        extra: tuple[TxnOp, ...] = (),
        *,
        known: tuple[Trajectory, KeyValue] | None = None,
    ) -> Trajectory:
        """Apply ``fn`` to the record atomically (retried if someone else wrote it);
        ``known``: the record as last read (with its tail) and as stored, tried first
        without reading it again."""
        while True:
            if known is not None:
                (t, kv), known = known, None
            else:
                t, kv = await self._read(tid)
            new = replace(fn(t), updated_at=self.clock())
            res = await self.store.txn([_guard(kv.key, kv)], [_record_put(new), *extra])
            if res.succeeded:
                self._usage.note(kv.key, res.revision, new.project, new.bytes)
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
            [_record_put(fresh)],
        )
        if res.succeeded:
            self._usage.note(key, res.revision, project, 0)
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
        extra: tuple[TxnOp, ...] = (Put(_bind_key(sandbox_id), json.dumps({"id": tid}).encode()),)
        if t.sandbox_id and t.sandbox_id != sandbox_id:
            extra += (Delete(_bind_key(t.sandbox_id)),)
        epoch = secrets.token_hex(8)
        return await self.update(
            tid, lambda t: replace(t, sandbox_id=sandbox_id, epoch=epoch), extra
        )

    async def for_sandbox(self, sandbox_id: str) -> Trajectory | None:
        found = await self.lookup(sandbox_id)
        return found[0] if found else None

    async def lookup(self, sandbox_id: str, tid: str = "") -> tuple[Trajectory, KeyValue] | None:
        """The trajectory ``sandbox_id`` is bound to, and its record as read (for
        ``known=`` in :meth:`update` and :meth:`append`). ``tid``: the trajectory it was
        bound to when last looked up (then one read, if that still holds)."""
        if tid:
            found = await self._bound_record(tid, sandbox_id)
            if found is not None:
                return found
        kv = await self.store.get(_bind_key(sandbox_id))
        if kv is None:
            return None
        bound = str(json.loads(kv.value)["id"])
        return None if bound == tid else await self._bound_record(bound, sandbox_id)

    async def _bound_record(self, tid: str, sandbox_id: str) -> tuple[Trajectory, KeyValue] | None:
        kv = await self.store.get(_meta_key(tid))
        if kv is None:
            return None
        t = Trajectory.from_json(json.loads(kv.value))
        return (await self._with_tail(t), kv) if t.sandbox_id == sandbox_id else None

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
        """The limit on ``project``'s subtree; ``max_age_s`` > 0 accepts a value read that
        recently (the hot path: a quota set on another apiserver applies here within that
        time)."""
        limit = self._recent_quota(project, max_age_s)
        if limit is not None:
            return limit
        kv = await self.store.get(_quota_key(project))
        limit = _int(kv) if kv else self.default_quota_bytes
        self._quotas[project] = (self.clock(), limit)
        return limit

    def _recent_quota(self, project: str, max_age_s: float) -> int | None:
        """The limit on ``project``'s subtree if read within ``max_age_s`` (> 0), else None."""
        cached = self._quotas.get(project)
        if cached and max_age_s and self.clock() - cached[0] < max_age_s:
            return cached[1]
        return None

    async def set_quota(self, project: str, limit_bytes: int) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise InvalidArgument("a trajectory quota is a number of bytes >= 0 (0: no limit)")
        await self.store.put(_quota_key(project), str(limit_bytes).encode())
        self._quotas.pop(project, None)

    async def _project_bytes(self, *, wait: bool) -> dict[str, int]:
        """Log bytes per project and everything beneath it. Not following the records (first
        use, or the watch ended): summed again, awaited when ``wait`` or there is no sum
        yet, else in the background (the hot path never waits for a range over every
        record while it has a sum)."""
        u = self._usage
        if not u.live:
            if self._starting is None or self._starting.done():
                self._starting = asyncio.ensure_future(u.start())
                # (in the background its error is the next call's to see: mark it seen)
                self._starting.add_done_callback(lambda t: t.cancelled() or t.exception())
            if wait or not u.summed:
                await asyncio.shield(self._starting)
        u.fold()
        return u.subtree

    async def check_quota(self, project: str) -> None:
        """Refuse (QuotaExceeded) when the log of the project, or of one of its ancestors,
        is at or over its quota; the step that crosses it is still recorded, the calls after
        it are refused before they run."""
        sums = await self._project_bytes(wait=False)
        for level in _levels(project):
            limit = self._recent_quota(level, QUOTA_CACHE_S)  # (no coroutine when cached)
            if limit is None:
                limit = await self.quota(level, max_age_s=QUOTA_CACHE_S)
            if not limit:
                continue
            used = sums.get(level, 0)
            if used >= limit:
                within = "" if level == project else f" (which holds project {project!r})"
                raise QuotaExceeded(
                    f"the trajectory log of project {level!r}{within} holds {used} bytes, at or "
                    f"over its quota of {limit} bytes; remove old trajectories (dsec trajectory "
                    "rm) or raise the quota"
                )

    async def usage(self, project: str) -> int:
        """Bytes of log ``project`` and the projects beneath it hold."""
        return (await self._project_bytes(wait=True)).get(project, 0)

    async def append(self, tid: str, make: Callable[[int], Step]) -> Step:
        """Record ``make(n)`` as the next step n; the log advances past it (record mode)."""
        return (await self.append_known(tid, make))[0]

    async def append_known(
        self,
        tid: str,
        make: Callable[[int], Step],
        *,
        known: tuple[Trajectory, KeyValue] | None = None,
        quota_checked: bool = False,
    ) -> tuple[Step, Trajectory, KeyValue]:
        """:meth:`append`, answering the record after it (with its tail) and as stored:
        the next call's ``known``, so a writer that keeps it reads nothing per step.
        ``quota_checked``: the caller checked the quota before the call it records ran (the
        apiserver): a call that ran is recorded even if a concurrent step filled the quota
        meanwhile, and the check is not paid twice."""
        while True:
            if known is not None:
                (t, meta), known = known, None
            else:
                t, meta = await self._read(tid)
            step = make(t.steps)
            raw = step.encode()
            size = len(raw)
            stored = raw
            if size > INLINE_MAX:
                digest = await self.blobs.put(raw)
                stored = json.dumps({"n": step.n, "blob": digest, "size": size}).encode()
            if not quota_checked:
                await self.check_quota(t.project)
            new = t.appended(size, step.at)
            key = _step_key(tid, step.n)
            # (the record is written when a read of its tail would not find ``new``: the
            # append changes more than the count, bytes and time; and periodically)
            tail_only = t.mode == "record" and t.cursor == t.steps and size <= INLINE_MAX
            put = None if tail_only and new.steps % RECORD_EVERY else _record_put(new)
            res = await self.store.txn(
                [_guard(meta.key, meta), Compare(key, Target.CREATE, Op.EQ, 0)],
                [Put(key, stored), put] if put else [Put(key, stored)],
            )
            if res.succeeded:
                self._usage.note(meta.key, res.revision, new.project, new.bytes)
                if put:  # (every key a transaction puts gets its revision: etcd's rule)
                    version = meta.version + 1
                    meta = KeyValue(put.key, put.value, meta.create_revision, res.revision, version)
                return step, new, meta

    async def _sizes(self, tid: str, start: int) -> tuple[builtins.list[bytes], int]:
        """The keys of the steps from ``start`` on, and their log bytes."""
        res = await self.store.range(_steps_prefix(tid), start=_step_key(tid, start))
        total = sum(_stored_size(json.loads(kv.value), kv.value) for kv in res.kvs)
        return [kv.key for kv in res.kvs], total

    async def truncate(
        self, tid: str, start: int, fn: Callable[[Trajectory], Trajectory]
    ) -> Trajectory:
        """Drop steps ``start`` and after (a diverged replay), applying ``fn`` too."""
        while True:
            t, meta = await self._read(tid)
            keys, freed = await self._sizes(tid, start)
            new = replace(fn(t), steps=min(t.steps, start), bytes=max(0, t.bytes - freed))
            res = await self.store.txn([_guard(meta.key, meta)], [_record_put(new)])
            if res.succeeded:
                self._usage.note(meta.key, res.revision, new.project, new.bytes)
                break
        for i in range(0, len(keys), _DELETE_BATCH):
            await self.store.txn([], [Delete(k) for k in keys[i : i + _DELETE_BATCH]])
        return new

    async def remove(self, tid: str) -> None:
        """Delete a trajectory, its steps and its binding (blobs go with the next sweep)."""
        while True:
            meta = await self.store.get(_meta_key(tid))  # (its tail goes with it: not read)
            if meta is None:
                raise NotFound(f"no trajectory {tid}")
            t = Trajectory.from_json(json.loads(meta.value))
            ops: list[TxnOp] = [Delete(meta.key), Delete(_steps_prefix(tid), prefix=True)]
            if t.sandbox_id:
                ops.append(Delete(_bind_key(t.sandbox_id)))
            res = await self.store.txn([_guard(meta.key, meta)], ops)
            if res.succeeded:
                self._usage.note(meta.key, res.revision, t.project, None)
                return

    async def referenced_blobs(self) -> set[str]:
        res = await self.store.range(PREFIX + b"s/")
        out = set()
        for kv in res.kvs:
            d = json.loads(kv.value)
            if "blob" in d:
                out.add(str(d["blob"]))
        return out
