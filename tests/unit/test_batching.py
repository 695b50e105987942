"""dsec.core.batching: results per item, and the minimum interval between batches."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import pytest

from dsec.core.batching import Batcher


@pytest.mark.asyncio
async def test_batches_start_min_interval_apart_and_a_lone_item_goes_at_once() -> None:
    loop = asyncio.get_running_loop()
    starts: list[float] = []
    sizes: list[int] = []

    async def run(items: Sequence[int]) -> list[int | Exception]:
        starts.append(loop.time())
        sizes.append(len(items))
        await asyncio.sleep(0.01)  # a call takes 10 ms, so a few items queue meanwhile
        return [ValueError(i) if i < 0 else i * 2 for i in items]

    b: Batcher[int, int] = Batcher(run, min_interval_s=0.05)

    async def steady(i: int) -> int:
        await asyncio.sleep(i * 0.005)  # one item every 5 ms for 200 ms
        return await b.submit(i)

    assert await asyncio.gather(*(steady(i) for i in range(40))) == [i * 2 for i in range(40)]
    # after a batch of several items (the first goes alone, at once) the next waits
    gaps = [b - a for (a, b), n in zip(itertools.pairwise(starts), sizes, strict=False) if n > 1]
    assert gaps
    assert min(gaps) >= 0.049, (gaps, sizes)
    assert sum(sizes) == 40
    assert len(sizes) <= 7, sizes  # about 5 batches, not 40

    await asyncio.sleep(0.1)  # quiet for longer than the interval
    sent = loop.time()
    with pytest.raises(ValueError):
        await b.submit(-1)  # its own error, and no waiting
    assert starts[-1] - sent < 0.025


@pytest.mark.asyncio
async def test_a_lone_caller_never_waits_for_the_interval() -> None:
    loop = asyncio.get_running_loop()

    async def run(items: Sequence[int]) -> list[int | Exception]:
        return list(items)

    b: Batcher[int, int] = Batcher(run, min_interval_s=10.0)
    t0 = loop.time()
    for i in range(20):  # one at a time, back to back: batches of one
        assert await b.submit(i) == i
    assert loop.time() - t0 < 1.0


@pytest.mark.asyncio
async def test_without_an_interval_the_next_batch_goes_when_the_last_is_done() -> None:
    calls: list[list[int]] = []
    release = asyncio.Event()

    async def run(items: Sequence[int]) -> list[int | Exception]:
        calls.append(list(items))
        if len(calls) == 1:
            await release.wait()
        return list(items)

    b: Batcher[int, int] = Batcher(run)
    first = asyncio.ensure_future(b.submit(0))
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(b.submit(i)) for i in range(1, 6)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(first, *rest) == list(range(6))
    assert calls == [[0], [1, 2, 3, 4, 5]]
