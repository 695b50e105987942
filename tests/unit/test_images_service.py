"""The edge's image service: pulls share the store, gc waits for them and excludes them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dsec.edge.images.service import EdgeImages
from dsec.edge.images.store import ImageStore


@pytest.mark.asyncio
async def test_pulls_run_together_and_gc_runs_alone(tmp_path: Path) -> None:
    svc = EdgeImages(ImageStore(tmp_path), "e0a1", None)
    order: list[str] = []
    release = asyncio.Event()

    async def user(name: str) -> None:
        async with svc._shared():
            order.append(f"{name} in")
            await release.wait()
            order.append(f"{name} out")

    async def gc() -> None:
        await svc.gc()
        order.append("gc done")

    a = asyncio.create_task(user("a"))
    b = asyncio.create_task(user("b"))
    await asyncio.sleep(0.01)
    g = asyncio.create_task(gc())
    await asyncio.sleep(0.01)
    late = asyncio.create_task(user("late"))  # waits: a gc is queued
    await asyncio.sleep(0.01)
    assert order == ["a in", "b in"]  # both pulls at once; gc waits for them
    release.set()
    await asyncio.wait_for(asyncio.gather(a, b, g, late), 5)
    assert order == ["a in", "b in", "a out", "b out", "gc done", "late in", "late out"]
