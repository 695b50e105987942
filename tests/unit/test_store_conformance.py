"""The state store conformance suite on the in-memory fake and on SQLite."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core.errors import StoreUnavailable
from dsec.store.api import StateStore
from dsec.store.memory import MemoryStore
from dsec.store.sqlite import SqliteStore
from dsec.testing.store_checks import CHECKS, admit_many, check_state_store

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


@pytest.mark.asyncio
async def test_sqlite_admission_is_exact_across_two_clients(tmp_path: Path) -> None:
    a = await SqliteStore.open(tmp_path / "s.db")
    b = await SqliteStore.open(tmp_path / "s.db")
    try:
        admitted = await admit_many([a, b], b"/q/", attempts=500, quota=310, used=10)
        assert admitted == 300
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.asyncio
async def test_sqlite_state_and_history_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    s = await SqliteStore.open(path)
    r1 = await s.put(b"/k/a", b"1")
    lease = await s.lease_grant(60)
    await s.put(b"/k/b", b"2", lease=lease)
    await s.aclose()
    s = await SqliteStore.open(path)
    try:
        kv = await s.get(b"/k/a")
        assert kv is not None
        assert kv.mod_revision == r1
        assert await s.lease_keepalive(lease) == 60
        r3 = await s.put(b"/k/c", b"3")
        assert r3 == r1 + 2
        async with aclosing(s.watch(b"/k/", start_revision=r1)) as w:
            revs = [(await asyncio.wait_for(anext(w), 5)).revision for _ in range(3)]
        assert revs == [r1, r1 + 1, r3]
    finally:
        await s.aclose()


@pytest.mark.asyncio
async def test_closed_store_is_unavailable(tmp_path: Path) -> None:
    for s in (MemoryStore(), await SqliteStore.open(tmp_path / "s.db")):
        await s.aclose()
        with pytest.raises(StoreUnavailable):
            await s.get(b"k")
