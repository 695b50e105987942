"""Group commit in the SQLite store: concurrent transactions share a commit, each keeps
its own revision, and one that fails takes no other down with it."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dsec.core.errors import LeaseNotFound
from dsec.store.api import Put, TxnResult
from dsec.store.sqlite import SqliteStore


@pytest.mark.asyncio
async def test_concurrent_txns_share_commits_and_fail_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await SqliteStore.open(tmp_path / "s.db", synchronous="FULL")
    commits = 0
    write = store._write

    def counting(body: Callable[[sqlite3.Connection], Any]) -> Any:
        nonlocal commits
        commits += 1
        return write(body)

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
