"""In-process watch fan-out for the embedded backends (memory and SQLite).

A watcher registers first, then reads the history from its start revision, then takes live
batches, skipping any the history already covered; so no batch is lost or repeated between
the two.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

from dsec.core.errors import StoreUnavailable

from .api import Event, WatchBatch

History = Callable[[bytes, int], Awaitable[tuple[int, list[WatchBatch]]]]


def filter_batch(batch: WatchBatch, prefix: bytes) -> WatchBatch | None:
    events = tuple(e for e in batch.events if e.kv.key.startswith(prefix))
    if len(events) == len(batch.events):
        return batch  # (batches are frozen: the watcher may have this one)
    return WatchBatch(batch.revision, events) if events else None


def group(revisions_events: list[tuple[int, Event]]) -> list[WatchBatch]:
    """Group (revision, event) pairs, already in order, into one batch per revision."""
    out: list[WatchBatch] = []
    for rev, ev in revisions_events:
        if out and out[-1].revision == rev:
            out[-1] = WatchBatch(rev, (*out[-1].events, ev))
        else:
            out.append(WatchBatch(rev, (ev,)))
    return out


@dataclass(eq=False)
class _Sub:
    prefix: bytes
    queue: asyncio.Queue[WatchBatch | None] = field(default_factory=asyncio.Queue)


class WatchHub:
    def __init__(self) -> None:
        self._subs: set[_Sub] = set()
        self._closed = False

    def publish(self, batch: WatchBatch) -> None:
        for sub in self._subs:
            mine = filter_batch(batch, sub.prefix)
            if mine is not None:
                sub.queue.put_nowait(mine)

    def close(self) -> None:
        self._closed = True
        for sub in self._subs:
            sub.queue.put_nowait(None)

    async def stream(
        self, prefix: bytes, start_revision: int, history: History
    ) -> AsyncGenerator[WatchBatch, None]:
        if self._closed:
            raise StoreUnavailable("the store is closed")
        sub = _Sub(prefix)
        self._subs.add(sub)
        try:
            current, past = await history(prefix, start_revision)
            seen = current if start_revision <= 0 else max(current, start_revision - 1)
            for batch in past:
                yield batch
            while True:
                item = await sub.queue.get()
                if item is None:
                    raise StoreUnavailable("the store was closed under a watch")
                if item.revision > seen:
                    seen = item.revision
                    yield item
        finally:
            self._subs.discard(sub)
