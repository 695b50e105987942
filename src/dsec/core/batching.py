"""Group concurrent requests into one transaction: while one batch is being written, new
requests queue; when it is done they all go in the next one. A burst of N admissions or
audit entries then costs a handful of disk syncs (or Raft rounds) instead of N; an
apiserver uses the same queue to send a burst of admissions to the iam in one call."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")


class Batcher(Generic[_T, _R]):
    """``run`` decides a batch (at most ``max_batch`` items) in order; one result (or
    exception) per item."""

    def __init__(
        self,
        run: Callable[[Sequence[_T]], Awaitable[Sequence[_R | Exception]]],
        *,
        max_batch: int = 0,
    ) -> None:
        self._run = run
        self._max = max_batch or 1 << 30
        self._queue: list[tuple[_T, asyncio.Future[_R]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def submit(self, item: _T) -> _R:
        fut: asyncio.Future[_R] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        return await fut

    async def submit_many(self, items: Sequence[_T]) -> list[_R | Exception]:
        """Queue ``items`` together; their results (or exceptions) in order. Cheaper than a
        task per item around :meth:`submit`."""
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[_R]] = [loop.create_future() for _ in items]
        self._queue.extend(zip(items, futs, strict=True))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        out: list[_R | Exception] = []
        try:
            for fut in futs:
                try:
                    out.append(await fut)
                except Exception as exc:
                    out.append(exc)
        except asyncio.CancelledError:
            for fut in futs:  # the caller went away: its items are still decided
                fut.cancel()
            raise
        return out

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue[: self._max], self._queue[self._max :]
                try:
                    results: Sequence[_R | Exception] = await self._run([i for i, _ in batch])
                except Exception as exc:  # the commit failed: none of the batch happened
                    results = [exc] * len(batch)
                for (_, fut), result in zip(batch, results, strict=True):
                    if fut.done():  # the caller went away; the decision stands
                        continue
                    if isinstance(result, Exception):
                        fut.set_exception(result)
                    else:
                        fut.set_result(result)
        finally:
            self._drainer = None

    async def wait_idle(self) -> None:
        if self._drainer is not None:
            await self._drainer
