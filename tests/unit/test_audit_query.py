"""Audit queries by time, project, actor and action: the same answers from the SQLite
tables and the StateStore layout, and on the store a query reads what it returns."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

import pytest

from dsec.core.audit import AuditEvent
from dsec.iam.audit import AuditQuery
from dsec.iam.db import IamDb
from dsec.store.api import KeyValue, RangeResult, StateStore
from dsec.store.memory import MemoryStore
from dsec.testing.iam_sync import SyncKvIam

PROJECTS = ["org", "org/team", "other"]
ACTORS = ["alice", "bob via spiffe://dsec/apiserver/apiserver"]
ACTIONS = ["sandbox.create", "sandbox.kill", "key.create"]


class CountingStore(MemoryStore):
    """Counts the keys reads hand back."""

    read = 0

    async def range(
        self, prefix: bytes, *, revision: int = 0, limit: int = 0, start: bytes = b""
    ) -> RangeResult:
        got = await super().range(prefix, revision=revision, limit=limit, start=start)
        self.read += len(got.kvs)
        return got

    async def get_many(self, keys: Sequence[bytes]) -> list[KeyValue | None]:
        self.read += len(keys)
        return await super().get_many(keys)


_store = CountingStore()


async def _counting_store() -> StateStore:
    return _store


@pytest.fixture(params=["sqlite", "kv"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[IamDb]:
    global _store
    clock = itertools.count(1000.0, 1.0)
    if request.param == "sqlite":
        d = IamDb(tmp_path / "iam.db", clock=lambda: next(clock))
    else:
        _store = CountingStore()
        d = cast(IamDb, SyncKvIam(_counting_store, clock=lambda: next(clock)))
    events = [
        AuditEvent(ts=1000.0 + i, actor=ACTORS[i % 2], action=ACTIONS[i % 3],
                   project=PROJECTS[i % 3] if i % 7 else PROJECTS[0], target=f"t{i}")
        for i in range(600)
    ]  # fmt: skip
    for i in range(0, len(events), 100):
        d.append_audit_many(events[i : i + 100])
    yield d
    d.close()


QUERIES = [
    AuditQuery(limit=10),
    AuditQuery(after_seq=590),
    AuditQuery(project="org/team", limit=7),
    AuditQuery(project="org", after_seq=300, limit=20),
    AuditQuery(actor=ACTORS[1], action="sandbox.kill", limit=50),
    AuditQuery(action="key.create", limit=5),
    AuditQuery(action="sandbox.", limit=30, after_seq=100),
    AuditQuery(since=1100.0, until=1110.0),
    AuditQuery(since=1500.0, project="other", limit=3),
    AuditQuery(until=1003.0),
    AuditQuery(project="nope"),
    AuditQuery(project="org", limit=10000),
]


def test_answers_match_a_filter_over_the_whole_log(db: IamDb) -> None:
    every = db.query_audit(AuditQuery(limit=10000))
    assert len(every) == 600
    for q in QUERIES:
        wanted = [e for e in every if e.seq > q.after_seq
                  and (not q.since or e.ts >= q.since) and (not q.until or e.ts < q.until)
                  and (not q.project or e.project == q.project)
                  and (not q.actor or e.actor == q.actor)
                  and (not q.action or (e.action.startswith(q.action) if q.action.endswith(".")
                                        else e.action == q.action))][: q.limit]  # fmt: skip
        assert db.query_audit(q) == wanted, q
    assert db.verify_audit()[:2] == (600, None)


@pytest.mark.parametrize("db", ["kv"], indirect=True)
def test_a_store_query_reads_about_what_it_returns(db: IamDb) -> None:
    for q, most in [
        (AuditQuery(project="org/team", limit=7), 32),  # index page + entries (pages of 16)
        (AuditQuery(project="org", after_seq=500, limit=20), 40),
        (AuditQuery(since=1100.0, until=1110.0), 40),
        (AuditQuery(after_seq=590), 20),
        (AuditQuery(actor=ACTORS[0], limit=100), 200),
    ]:
        before = _store.read
        got = db.query_audit(q)
        assert got
        read = _store.read - before
        assert read <= most, (q, read)


def test_a_log_from_before_the_index_is_still_answered_in_full() -> None:
    """Entries written without index keys (an older iam) are found by a scan of the log
    up to the first indexed entry; later ones through the index."""
    global _store
    _store = CountingStore()
    clock = itertools.count(1000.0, 1.0)
    d = SyncKvIam(_counting_store, clock=lambda: next(clock))
    try:
        old = [AuditEvent(ts=0.0, actor="alice", action="key.create", project="org",
                          target=f"old{i}") for i in range(30)]  # fmt: skip
        d.append_audit_many(old)
        d._call(_drop_index_keys(_store))  # as an iam before the index wrote them
        assert len(d.query_audit(AuditQuery(project="org"))) == 30
        d.kv._indexed = False  # a new iam process starts on that log
        d.append_audit_many(
            [
                AuditEvent(
                    ts=0.0, actor="alice", action="key.create", project="org", target=f"new{i}"
                )
                for i in range(5)
            ]
        )
        got = d.query_audit(AuditQuery(project="org"))
        assert [e.target for e in got] == [f"old{i}" for i in range(30)] + [
            f"new{i}" for i in range(5)
        ]
        assert [e.target for e in d.query_audit(AuditQuery(actor="alice", after_seq=28))] == [
            "old28", "old29", "new0", "new1", "new2", "new3", "new4"
        ]  # fmt: skip
        assert [e.target for e in d.query_audit(AuditQuery(project="org", limit=3))] == [
            "old0", "old1", "old2"
        ]  # fmt: skip
    finally:
        d.close()


async def _drop_index_keys(store: StateStore) -> None:
    await store.delete(b"/dsec/iam/audit_ix/", prefix=True)
    await store.delete(b"/dsec/iam/meta/audit_ix_from")
