"""The state store conformance suite on the in-memory fake and on SQLite."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.store.api import StateStore
from dsec.store.memory import MemoryStore
from dsec.store.sqlite import SqliteStore
from dsec.testing.store_checks import CHECKS, check_state_store

Factory = Callable[[], Awaitable[StateStore]]


@pytest_asyncio.fixture(params=["memory", "sqlite"])
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Factory]:
    made: list[StateStore] = []
    n = 0

    async def make() -> StateStore:
        nonlocal n
        n += 1
        store: StateStore
        if request.param == "memory":
            store = MemoryStore()
        else:
            store = await SqliteStore.open(tmp_path / f"store-{n}.db")
        made.append(store)
        return store

    yield make
    for s in made:
        await s.aclose()


@pytest.mark.parametrize("name", sorted(CHECKS))
@pytest.mark.asyncio
async def test_conformance(make_store: Factory, name: str) -> None:
    store = await make_store()
    await CHECKS[name](store, b"/t/")


@pytest.mark.asyncio
async def test_check_state_store_runs_everything() -> None:
    async def make() -> StateStore:
        return MemoryStore()

    await check_state_store(make)
