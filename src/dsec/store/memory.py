"""A state store in memory with the same semantics as the real ones, for unit tests."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import secrets
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from dsec.core.errors import Compacted, InvalidArgument, LeaseNotFound, StoreUnavailable

from .api import (
    Compare,
    Delete,
    Event,
    EventType,
    KeyValue,
    Put,
    RangeResult,
    StoreHelpers,
    TxnOp,
    TxnResult,
    WatchBatch,
    check_txn,
    in_range,
)
from .hub import WatchHub, group

REAP_INTERVAL_S = 0.1


@dataclass
class _Lease:
    ttl: int
    deadline: float


class MemoryStore(StoreHelpers):
    def __init__(self) -> None:
        self._kv: dict[bytes, KeyValue] = {}
        self._keys: list[bytes] = []  # sorted
        self._history: list[tuple[int, Event]] = []
        self._rev = 1
        self._compact_rev = 0
        self._leases: dict[int, _Lease] = {}
        self._hub = WatchHub()
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False

    # reads

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("the store is closed")

    async def get(self, key: bytes) -> KeyValue | None:
        self._check_open()
        return self._kv.get(key)

    def _at(self, revision: int) -> dict[bytes, KeyValue]:
        if revision < self._compact_rev:
            raise Compacted(f"revision {revision} is compacted", self._compact_rev)
        if revision > self._rev:
            raise InvalidArgument(f"revision {revision} is in the future (now {self._rev})")
        state: dict[bytes, KeyValue] = {}
        for rev, ev in self._history:
            if rev > revision:
                break
            if ev.type is EventType.PUT:
                state[ev.kv.key] = ev.kv
            else:
                state.pop(ev.kv.key, None)
        return state

    async def range(
        self, prefix: bytes, *, revision: int = 0, limit: int = 0, start: bytes = b""
    ) -> RangeResult:
        self._check_open()
        if revision and revision != self._rev:
            state = self._at(revision)
            kvs = [state[k] for k in sorted(state) if k.startswith(prefix) and k >= start]
        else:
            i = bisect.bisect_left(self._keys, max(prefix, start))
            kvs = []
            while i < len(self._keys) and self._keys[i].startswith(prefix):
                kvs.append(self._kv[self._keys[i]])
                i += 1
        count = len(kvs)
        if limit and count > limit:
            kvs = kvs[:limit]
        return RangeResult(tuple(kvs), revision or self._rev, limit > 0 and count > limit, count)

    # writes

    def _covered(self, c: Compare) -> list[KeyValue]:
        if c.prefix:
            return [kv for k, kv in self._kv.items() if k.startswith(c.key)]
        kv = self._kv.get(c.key)
        return [kv] if kv else []

    def _apply(self, ops: Sequence[TxnOp]) -> tuple[list[Event], list[int]]:
        for op in ops:
            if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                raise LeaseNotFound(f"lease {op.lease:x} not found")
        rev = self._rev + 1
        events: dict[bytes, Event] = {}
        deleted: list[int] = []
        for op in ops:
            if isinstance(op, Put):
                old = self._kv.get(op.key)
                kv = KeyValue(
                    op.key,
                    op.value,
                    old.create_revision if old else rev,
                    rev,
                    (old.version if old else 0) + 1,
                    op.lease,
                )
                if old is None:
                    bisect.insort(self._keys, op.key)
                self._kv[op.key] = kv
                events[op.key] = Event(EventType.PUT, kv)
            else:
                gone = [k for k in self._kv if in_range(k, op.key, op.prefix)]
                for k in gone:
                    del self._kv[k]
                    self._keys.remove(k)
                    events[k] = Event(EventType.DELETE, KeyValue(k, b"", 0, rev, 0))
                deleted.append(len(gone))
        return list(events.values()), deleted

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
    ) -> TxnResult:
        self._check_open()
        check_txn(compare, success, failure)
        ok = all(c.holds(self._covered(c)) for c in compare)
        events, deleted = self._apply(success if ok else failure)
        self._commit(events)
        return TxnResult(ok, self._rev, tuple(deleted))

    def _commit(self, events: list[Event]) -> None:
        if not events:
            return
        self._rev += 1
        events.sort(key=lambda e: e.kv.key)
        self._history.extend((self._rev, e) for e in events)
        self._hub.publish(WatchBatch(self._rev, tuple(events)))

    # leases

    async def lease_grant(self, ttl_s: int) -> int:
        self._check_open()
        if ttl_s <= 0:
            raise InvalidArgument("a lease needs a positive TTL")
        lease = secrets.randbits(62) + 1
        self._leases[lease] = _Lease(ttl_s, time.monotonic() + ttl_s)
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap())
        return lease

    async def lease_keepalive(self, lease: int) -> int:
        self._check_open()
        got = self._leases.get(lease)
        if got is None:
            raise LeaseNotFound(f"lease {lease:x} not found")
        got.deadline = time.monotonic() + got.ttl
        return got.ttl

    async def lease_revoke(self, lease: int) -> None:
        self._check_open()
        if lease not in self._leases:
            raise LeaseNotFound(f"lease {lease:x} not found")
        self._expire(lease)

    def _expire(self, lease: int) -> None:
        del self._leases[lease]
        ops = [Delete(k) for k, kv in self._kv.items() if kv.lease == lease]
        self._commit(self._apply(ops)[0])

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for lease in [i for i, le in self._leases.items() if le.deadline <= now]:
                self._expire(lease)

    # history

    async def compact(self, revision: int) -> None:
        self._check_open()
        if revision <= self._compact_rev:
            raise Compacted(f"revision {revision} is already compacted", self._compact_rev)
        if revision > self._rev:
            raise InvalidArgument(f"revision {revision} is in the future (now {self._rev})")
        self._compact_rev = revision

    async def _history_from(self, prefix: bytes, start: int) -> tuple[int, list[WatchBatch]]:
        if start <= 0:
            return self._rev, []
        if start < self._compact_rev:
            raise Compacted(f"watch from {start}: history is compacted", self._compact_rev)
        pairs = [(r, e) for r, e in self._history if r >= start and e.kv.key.startswith(prefix)]
        return self._rev, group(pairs)

    def watch(self, prefix: bytes, *, start_revision: int) -> AsyncGenerator[WatchBatch, None]:
        return self._hub.stream(prefix, start_revision, self._history_from)

    async def aclose(self) -> None:
        self._closed = True
        self._hub.close()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
