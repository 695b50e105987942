"""dsec.core.batching: what queues while a batch is decided goes in the next one."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from dsec.core.batching import Batcher


@pytest.mark.asyncio
async def test_the_next_batch_goes_when_the_last_is_done() -> None:
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
