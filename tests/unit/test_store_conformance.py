"""The state store conformance suite on the in-memory fake and on SQLite."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core.errors import Compacted, StoreUnavailable
from dsec.store.api import StateStore
from dsec.store.memory import MemoryStore
from dsec.store.sqlite import SqliteStore
from dsec.testing.store_checks import CHECKS, admit_many, check_state_store

Factory = Callable[[], Awaitable[StateStore]]


@pytest_asyncio.fixture(params=["memory", "sqlite", "sqlite-normal"])
async def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Factory]:
    made: list[StateStore] = []
    n = 0

    async def make() -> StateStore:
        nonlocal n
        n += 1
        store: StateStore
        if request.param == "memory":
            store = MemoryStore()
        else:  # (NORMAL: transactions commit on the loop's thread when they can)
            sync = "NORMAL" if request.param == "sqlite-normal" else "FULL"
            store = await SqliteStore.open(tmp_path / f"store-{n}.db", synchronous=sync)
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
@pytest.mark.parametrize("sync", ["FULL", "NORMAL"])
async def test_sqlite_admission_is_exact_across_two_clients(tmp_path: Path, sync: str) -> None:
    a = await SqliteStore.open(tmp_path / "s.db", synchronous=sync)
    b = await SqliteStore.open(tmp_path / "s.db", synchronous=sync)
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


@pytest.mark.asyncio
async def test_sqlite_compacts_history_on_its_own(tmp_path: Path) -> None:
    s = await SqliteStore.open(tmp_path / "s.db", retain_revisions=5, compact_every_s=0.1)
    try:
        first = await s.put(b"/a/0", b"0")
        for i in range(1, 20):
            await s.put(b"/a/%d" % (i % 3), b"%d" % i)
        last = (await s.range(b"/a/")).revision
        deadline = asyncio.get_running_loop().time() + 5
        compacted_at = 0
        while compacted_at != last - 5:  # it may have compacted during the writes, then again
            try:
                await s.range(b"/a/", revision=first)
            except Compacted as exc:
                compacted_at = exc.compact_revision
            assert asyncio.get_running_loop().time() < deadline, "no automatic compaction"
            await asyncio.sleep(0.05)
        # The retained revisions still answer ranges and watches.
        old = await s.range(b"/a/", revision=last - 5)
        assert len(old.kvs) == 3
        async with aclosing(s.watch(b"/a/", start_revision=last - 5)) as w:
            assert (await asyncio.wait_for(anext(w), 5)).revision == last - 5
    finally:
        await s.aclose()


@pytest.mark.asyncio
async def test_store_protos_are_generated_from_the_checked_in_proto(tmp_path: Path) -> None:
    from grpc_tools import protoc  # type: ignore[import-untyped]

    src = Path(__file__).parents[2] / "src" / "dsec" / "store"
    inc = tmp_path / "in" / "dsec" / "store" / "_gen"
    inc.mkdir(parents=True)
    (inc / "etcd_v3_subset.proto").write_bytes(
        (src / "protos" / "etcd_v3_subset.proto").read_bytes()
    )
    out = tmp_path / "out"
    out.mkdir()
    rc = protoc.main(
        ["protoc", f"-I{tmp_path / 'in'}", f"--python_out={out}", str(inc / "etcd_v3_subset.proto")]
    )
    assert rc == 0
    generated = (out / "dsec" / "store" / "_gen" / "etcd_v3_subset_pb2.py").read_text()
    assert generated == (src / "_gen" / "etcd_v3_subset_pb2.py").read_text(), (
        "src/dsec/store/_gen is stale: run scripts/gen-etcd-protos"
    )
