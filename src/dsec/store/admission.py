"""Atomic admission against quotas, on any :class:`~dsec.store.api.StateStore`.

Usage is never a counter: each admitted thing is a key under one or more prefixes (a project
and its ancestors), and a prefix's usage is the sum over its keys. :func:`admit` reads the
prefixes at revision R and creates the key only if no key under any of them changed after R,
so two admissions can never both take the last unit, on any backend and across any number of
clients. Within one process, an :class:`Admitter` serializes admissions per prefix set, so
concurrent callers queue instead of failing each other's compare-and-swap.

A write whose outcome is unknown (:class:`~dsec.core.errors.StoreUnavailable`) is resolved by
reading the key back: it is created once, never twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dsec.core.errors import InvalidArgument, StoreUnavailable

from .api import Compare, KeyValue, Op, Put, StateStore, Target


@dataclass(frozen=True)
class Limit:
    prefix: bytes
    limit: int  # the sum of usage under prefix may not exceed this


def usage_as_int(kv: KeyValue) -> int:
    """The default usage of one record: its value as a decimal integer."""
    return int(kv.value)


@dataclass
class Admitter:
    store: StateStore
    usage_of: Callable[[KeyValue], int] = usage_as_int
    retry_s: float = 30.0
    _locks: dict[tuple[bytes, ...], asyncio.Lock] = field(default_factory=dict)

    async def admit(
        self, key: bytes, value: bytes, amount: int, limits: Sequence[Limit], *, lease: int = 0
    ) -> bool:
        """Create ``key`` = ``value`` if ``amount`` more fits under every limit; True if it did.

        True also when ``key`` already exists (an earlier attempt of the same admission).
        """
        for lim in limits:
            if not key.startswith(lim.prefix):
                raise InvalidArgument(f"{key!r} is not under {lim.prefix!r}")
        group = tuple(sorted(lim.prefix for lim in limits))
        lock = self._locks.setdefault(group, asyncio.Lock())
        async with lock:
            return await self._admit(key, value, amount, limits, lease)

    async def _admit(
        self, key: bytes, value: bytes, amount: int, limits: Sequence[Limit], lease: int
    ) -> bool:
        give_up = time.monotonic() + self.retry_s
        delay = 0.02
        while True:
            try:
                outcome = await self._attempt(key, value, amount, limits, lease)
                if outcome is not None:
                    return outcome
                delay = 0.0
            except StoreUnavailable:
                if time.monotonic() > give_up:
                    raise
                delay = min(max(delay * 2, 0.02), 0.5)
            await asyncio.sleep(delay)

    async def _attempt(
        self, key: bytes, value: bytes, amount: int, limits: Sequence[Limit], lease: int
    ) -> bool | None:
        """One read-check-write round: True/False when decided, None when it raced."""
        compares = [Compare(key, Target.CREATE, Op.EQ, 0)]
        for lim in limits:
            got = await self.store.range(lim.prefix)
            if any(kv.key == key for kv in got.kvs):
                return True
            if sum(self.usage_of(kv) for kv in got.kvs) + amount > lim.limit:
                return False
            compares.append(Compare(lim.prefix, Target.MOD, Op.LT, got.revision + 1, prefix=True))
        res = await self.store.txn(compares, [Put(key, value, lease)])
        return True if res.succeeded else None
