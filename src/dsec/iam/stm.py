"""Optimistic read-modify-write transactions over a :class:`~dsec.store.api.StateStore`.

A :class:`Stm` records the ``mod_revision`` of every key (and prefix) it reads, keeps what
it read (a key is fetched once per attempt; :meth:`Stm.prefetch` fetches many in one round
trip) and buffers every write; :meth:`Stm.commit` applies the writes in one store
transaction guarded by "nothing I read has changed since", so a commit is serializable
with every other writer of those keys, whatever process or machine it runs on. A commit
that loses a race returns False and the caller runs its whole function again on fresh
reads (:func:`atomically`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from dsec.core.errors import StoreUnavailable
from dsec.store.api import Compare, Delete, KeyValue, Op, Put, StateStore, Target, TxnOp

_T = TypeVar("_T")


class Stm:
    """One attempt of a transaction: reads go to the store (or the writes buffered here)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._reads: dict[bytes, int] = {}  # key -> mod_revision seen (0: absent)
        self._values: dict[bytes, bytes | None] = {}  # key -> value seen
        self._ranges: dict[bytes, int] = {}  # prefix -> store revision it was read at
        self._writes: dict[bytes, bytes | None] = {}  # None: delete

    async def get(self, key: bytes) -> bytes | None:
        if key in self._writes:
            return self._writes[key]
        if key in self._values:
            return self._values[key]
        kv = await self.store.get(key)
        self._seen(key, kv)
        return kv.value if kv else None

    async def prefetch(self, keys: Sequence[bytes]) -> None:
        """Read ``keys`` not read yet, together (later :meth:`get` calls answer from here)."""
        todo = [k for k in dict.fromkeys(keys) if k not in self._values and k not in self._writes]
        for key, kv in zip(todo, await self.store.get_many(todo), strict=True):
            self._seen(key, kv)

    def _seen(self, key: bytes, kv: KeyValue | None) -> None:
        self._reads.setdefault(key, kv.mod_revision if kv else 0)
        self._values.setdefault(key, kv.value if kv else None)

    async def range(self, prefix: bytes) -> list[KeyValue]:
        """Every key under ``prefix`` as committed (buffered writes are not merged in)."""
        got = await self.store.range(prefix)
        self._ranges.setdefault(prefix, got.revision)
        return list(got.kvs)

    def put(self, key: bytes, value: bytes) -> None:
        self._writes[key] = value

    def delete(self, key: bytes) -> None:
        self._writes[key] = None

    def mark(self) -> dict[bytes, bytes | None]:
        """A copy of the buffered writes, to :meth:`undo` to (a savepoint)."""
        return dict(self._writes)

    def undo(self, mark: dict[bytes, bytes | None]) -> None:
        self._writes = dict(mark)

    async def commit(self) -> bool:
        if not self._writes:
            return True
        compares = [Compare(k, Target.MOD, Op.EQ, rev) for k, rev in self._reads.items()]
        compares += [
            Compare(p, Target.MOD, Op.LT, rev + 1, prefix=True) for p, rev in self._ranges.items()
        ]
        ops: list[TxnOp] = [
            Put(k, v) if v is not None else Delete(k) for k, v in self._writes.items()
        ]
        return (await self.store.txn(compares, ops)).succeeded


async def atomically(
    store: StateStore,
    fn: Callable[[Stm], Awaitable[_T]],
    *,
    lock: asyncio.Lock | None = None,
    retry_s: float = 30.0,
) -> _T:
    """Run ``fn`` in a fresh :class:`Stm` until its commit succeeds; returns its result.

    ``fn`` must be safe to run again after a lost race or an unknown outcome
    (:class:`StoreUnavailable` on commit): it re-reads everything, so it sees what an
    earlier attempt may have written. Exceptions from ``fn`` abort without writing.
    """
    give_up = time.monotonic() + retry_s
    delay = 0.02
    while True:
        try:
            if lock is None:
                result, ok = await _attempt(store, fn)
            else:
                async with lock:
                    result, ok = await _attempt(store, fn)
            if ok:
                return result
        except StoreUnavailable:
            if time.monotonic() > give_up:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)


async def _attempt(store: StateStore, fn: Callable[[Stm], Awaitable[_T]]) -> tuple[_T, bool]:
    stm = Stm(store)
    result = await fn(stm)
    return result, await stm.commit()
