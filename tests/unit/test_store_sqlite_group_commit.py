"""Group commit in the SQLite store: concurrent transactions share a commit, each keeps
its own revision, and one that fails takes no other down with it."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from dsec.core.errors import LeaseNotFound
from dsec.store import sqlite as sqlite_store
from dsec.store.api import Compare, Delete, Op, Put, Target, TxnResult
from dsec.store.sqlite import SqliteStore
from tests.waits import auntil


@pytest.mark.asyncio
async def test_concurrent_txns_share_commits_and_fail_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await SqliteStore.open(tmp_path / "s.db", synchronous="FULL")
    commits = 0
    write = store._write

    def counting(body: Callable[[sqlite3.Connection, bool], Any], *args: Any) -> Any:
        nonlocal commits
        commits += 1
        return write(body, *args)

    monkeypatch.setattr(store, "_write", counting)
    try:
        txns = [store.txn([], [Put(b"k%d" % i, b"v%d" % i)]) for i in range(50)]
        bad = store.txn([], [Put(b"bad", b"v", lease=12345)])
        results = await asyncio.gather(*txns[:25], bad, *txns[25:], return_exceptions=True)
        assert isinstance(results[25], LeaseNotFound), results[25]
        ok = [r for r in results if isinstance(r, TxnResult)]
        assert len(ok) == 50
        revs = sorted(r.revision for r in ok)
        assert revs == list(range(revs[0], revs[0] + 50)), "one revision per transaction"
        assert commits < 50, f"{commits} commits for 50 concurrent transactions"
        assert await store.get(b"bad") is None
        for i in range(50):
            kv = await store.get(b"k%d" % i)
            assert kv is not None
            assert kv.value == b"v%d" % i
    finally:
        await store.aclose()


@pytest.mark.asyncio
async def test_a_lone_failing_txn_leaves_nothing_and_takes_no_revision(tmp_path: Path) -> None:
    store = await SqliteStore.open(tmp_path / "s.db", synchronous="NORMAL")
    try:
        before = await store.put(b"a", b"1")
        with pytest.raises(LeaseNotFound):
            await store.txn([], [Put(b"b", b"2"), Put(b"c", b"3", lease=777)])
        assert await store.get(b"b") is None
        assert await store.put(b"a", b"2") == before + 1
        kv = await store.get(b"a")
        assert kv is not None
        assert (kv.create_revision, kv.mod_revision, kv.version) == (before, before + 1, 2)
    finally:
        await store.aclose()


@pytest.mark.asyncio
async def test_normal_commits_on_the_loop_and_checkpoints_the_wal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NORMAL: a transaction commits on the loop's thread (no group is submitted to the store
    thread) and the WAL is checkpointed every CHECKPOINT_COMMITS commits, not grown."""
    monkeypatch.setattr(sqlite_store, "CHECKPOINT_COMMITS", 20)
    store = await SqliteStore.open(tmp_path / "s.db", synchronous="NORMAL")
    submitted = 0
    group = store._txn_group

    def counting() -> None:
        nonlocal submitted
        submitted += 1
        group()

    monkeypatch.setattr(store, "_txn_group", counting)
    try:
        for i in range(200):
            await store.txn([], [Put(b"k", b"x" * 3000 + b"%d" % i)])
        await asyncio.sleep(0.2)  # (the last checkpoint, on the store thread)
        # (those that arrive during a checkpoint, or a lease sweep, go to the store thread)
        assert submitted < 40, f"{submitted} of 200 transactions went to the store thread"
        wal = (tmp_path / "s.db-wal").stat().st_size
        # (200 commits without checkpoints: ~6 MiB of WAL; the file keeps its largest size)
        assert wal < 2 << 20, f"WAL of {wal} bytes: not checkpointed"
        kv = await store.get(b"k")
        assert kv is not None
        assert kv.value.endswith(b"199")
    finally:
        await store.aclose()


@pytest.mark.asyncio
async def test_normal_never_blocks_the_loop_on_another_writer(tmp_path: Path) -> None:
    """NORMAL: while another connection holds the write lock, a transaction waits on the
    store thread (the loop keeps running) and commits once the lock is free."""
    store = await SqliteStore.open(tmp_path / "s.db", synchronous="NORMAL")
    other = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        txn = asyncio.ensure_future(store.txn([], [Put(b"k", b"v")]))
        ticks = 0
        for _ in range(10):
            await asyncio.sleep(0.01)
            ticks += 1
        assert not txn.done()
        assert ticks == 10
        other.execute("COMMIT")
        res = await asyncio.wait_for(txn, 5)
        assert res.succeeded
        kv = await store.get(b"k")
        assert kv is not None
        assert kv.value == b"v"
    finally:
        other.close()
        await store.aclose()


@pytest.mark.asyncio
async def test_normal_commits_large_transactions_on_the_store_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NORMAL: a range delete (or many keys, or much data) is not committed on the loop."""
    store = await SqliteStore.open(tmp_path / "s.db", synchronous="NORMAL")
    submitted = 0
    group = store._txn_group

    def counting() -> None:
        nonlocal submitted
        submitted += 1
        group()

    monkeypatch.setattr(store, "_txn_group", counting)
    try:
        await store.txn([], [Put(b"/p/%d" % i, b"v") for i in range(10)])
        assert submitted == 0
        await store.txn([], [Put(b"/q/%d" % i, b"v") for i in range(100)])
        await store.txn([], [Delete(b"/p/", prefix=True)])
        await store.txn([], [Put(b"/big", b"x" * (1 << 20))])
        assert submitted == 3
        assert (await store.range(b"/p/")).count == 0
        assert (await store.range(b"/q/")).count == 100
    finally:
        await store.aclose()


@pytest.mark.asyncio
async def test_normal_watchers_see_every_commit_of_both_threads_in_order(tmp_path: Path) -> None:
    """NORMAL: large transactions commit on the store thread, small ones on the loop; a
    watcher still gets every revision once, in order (one settlement, in commit order)."""
    store = await SqliteStore.open(tmp_path / "s.db", synchronous="NORMAL")
    seen: list[int] = []
    start = await store.put(b"/w/start", b"")

    async def watch() -> None:
        async for batch in store.watch(b"/w/", start_revision=start + 1):
            seen.append(batch.revision)  # noqa: PERF401 (the watch runs until cancelled)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.sleep(0.05)
        revs: list[int] = []

        async def writer(name: bytes, keys: int, rounds: int) -> None:
            for r in range(rounds):
                ops = [Put(b"/w/%s/%d/%d" % (name, r, i), b"v") for i in range(keys)]
                revs.append((await store.txn([], ops)).revision)

        # (writers on the loop keep committing while the store thread commits the big ones)
        await asyncio.gather(
            writer(b"big", 40, 40), *(writer(b"s%d" % w, 1, 100) for w in range(4))
        )
        await auntil(lambda: len(seen) >= len(revs), "the watcher has every revision", 5)
        assert sorted(revs) == list(range(start + 1, start + 1 + len(revs)))
        assert seen == sorted(revs), "a watcher missed or reordered a revision"
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await store.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("sync", ["FULL", "NORMAL"])
async def test_history_rows_of_puts_come_from_the_connections_own_triggers(
    tmp_path: Path, sync: str
) -> None:
    """Each put's history row (written by a TEMP trigger of the write connection) holds
    what the put stored: historic reads and watches from a revision see every version; the
    file itself holds no trigger (another binary opening it writes its rows itself)."""
    path = tmp_path / "s.db"
    store = await SqliteStore.open(path, synchronous=sync)
    try:
        r1 = await store.put(b"/h/a", b"1")
        res = await store.txn([], [Put(b"/h/a", b"2"), Put(b"/h/b", b"x")])
        r2 = res.revision
        r3 = (await store.txn([], [Delete(b"/h/b"), Put(b"/h/c", b"y")])).revision
        grouped = await asyncio.gather(*(store.put(b"/h/g%d" % i, b"v") for i in range(5)))
        old = await store.range(b"/h/", revision=r1)
        assert [(kv.key, kv.value, kv.version) for kv in old.kvs] == [(b"/h/a", b"1", 1)]
        mid = await store.range(b"/h/", revision=r2)
        assert [(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version)
                for kv in mid.kvs] == [
            (b"/h/a", b"2", r1, r2, 2), (b"/h/b", b"x", r2, r2, 1)
        ]  # fmt: skip
        after = await store.range(b"/h/", revision=r3)
        assert [kv.key for kv in after.kvs] == [b"/h/a", b"/h/c"]
        async with aclosing(store.watch(b"/h/", start_revision=r1)) as w:
            seen: list[tuple[int, bytes, str, bytes]] = []
            async for batch in w:
                seen += [(batch.revision, e.kv.key, e.type.name, e.kv.value) for e in batch.events]
                if batch.revision == max(grouped):
                    break
        assert seen[:5] == [
            (r1, b"/h/a", "PUT", b"1"),
            (r2, b"/h/a", "PUT", b"2"),
            (r2, b"/h/b", "PUT", b"x"),
            (r3, b"/h/b", "DELETE", b""),
            (r3, b"/h/c", "PUT", b"y"),
        ]
        assert sorted(r for r, *_ in seen[5:]) == sorted(grouped)
        with sqlite3.connect(path) as other:
            count = other.execute("SELECT COUNT(*) FROM changes").fetchone()[0]
            triggers = other.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
            assert triggers.fetchall() == []
        assert count == 10, "one history row per put or delete, none twice"
    finally:
        await store.aclose()


@pytest.mark.asyncio
async def test_normal_commits_a_guarded_put_in_one_statement(tmp_path: Path) -> None:
    """NORMAL: one put under single-key compares is one autocommitted statement, written as
    the usual way writes it (revision, versions, history, watch); a failed compare writes
    nothing and is answered the usual way."""
    store = await SqliteStore.open(tmp_path / "s.db", synchronous="NORMAL")
    assert store._db is not None
    statements: list[str] = []
    db = store._db

    class Counting:  # (the write connection, its statements noted)
        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            statements.append(sql)
            return db.execute(sql, *args)

        def __getattr__(self, name: str) -> Any:
            return getattr(db, name)

    store._db = Counting()  # type: ignore[assignment]
    try:
        first = await store.put(b"k", b"1")
        rec = await store.put(b"rec", b"r")
        statements.clear()
        guards = [
            Compare(b"rec", Target.MOD, Op.EQ, rec),
            Compare(b"k", Target.VERSION, Op.EQ, 1),
            Compare(b"k", Target.VALUE, Op.EQ, b"1"),
            Compare(b"new", Target.CREATE, Op.EQ, 0),  # (missing: reads 0)
        ]
        res = await store.txn(guards, [Put(b"k", b"2")])
        assert res == TxnResult(True, rec + 1)
        assert len(statements) == 1, statements
        assert statements[0].startswith("INSERT"), statements
        kv = await store.get(b"k")
        assert kv is not None
        assert (kv.value, kv.create_revision, kv.mod_revision, kv.version) == (
            b"2",
            first,
            rec + 1,
            2,
        )
        old = await store.range(b"k", revision=first)
        assert [x.value for x in old.kvs] == [b"1"], "no history row"
        async with aclosing(store.watch(b"k", start_revision=rec + 1)) as events:
            batch = await asyncio.wait_for(anext(events), 5)
        assert [(e.kv.key, e.kv.mod_revision) for e in batch.events] == [(b"k", rec + 1)]
        statements.clear()
        for failing in (
            Compare(b"rec", Target.MOD, Op.EQ, rec - 1),
            Compare(b"k", Target.VALUE, Op.EQ, b"1"),
            Compare(b"missing", Target.VALUE, Op.NE, b"x"),  # (a missing key has no value)
        ):
            assert await store.txn([failing], [Put(b"k", b"3")]) == TxnResult(False, rec + 1)
        assert statements[0].startswith("INSERT")
        assert "BEGIN IMMEDIATE" in statements, "a failed compare is not answered the usual way"
        assert (await store.get(b"k")) == kv
        # the usual way (two puts) takes the next revision after the one-statement write
        assert (await store.txn([], [Put(b"a", b"x"), Put(b"b", b"y")])).revision == rec + 2
        assert await store.put(b"k", b"4") == rec + 3
    finally:
        await store.aclose()
