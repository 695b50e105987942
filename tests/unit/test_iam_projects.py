"""The project tree: quotas bound whole subtrees; deletion and bad trees are refused."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from dsec.core import errors as e
from dsec.core.ids import new_sandbox_id
from dsec.iam.db import Admission, IamDb, Project
from dsec.store.api import StateStore
from dsec.store.memory import MemoryStore
from dsec.testing.iam_sync import SyncKvIam


async def _memory_store() -> StateStore:
    return MemoryStore()


@pytest.fixture(params=["sqlite", "kv"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[IamDb]:
    """The SQLite tables, and the same API on the StateStore layout (dsec.iam.kv)."""
    if request.param == "sqlite":
        d = IamDb(tmp_path / "iam.db")
    else:
        d = cast(IamDb, SyncKvIam(_memory_store, clock=time.time))
    yield d
    d.close()


def _sid() -> str:
    return new_sandbox_id("e0a1", os.urandom(13))


def _admit(db: IamDb, project: str, cpu: float = 1.0, mem: int = 100) -> str:
    sid = _sid()
    db.admit(project, sid, cpu, mem, "e0a1")
    return sid


def test_parents_must_exist_and_names_are_paths(db: IamDb) -> None:
    with pytest.raises(e.NotFound, match="parent"):
        db.put_project(Project("org/team", 0, 0, 0))
    with pytest.raises(e.InvalidArgument):
        db.put_project(Project("org//team", 0, 0, 0))
    db.put_project(Project("org", 0, 0, 0))
    db.put_project(Project("org/team", 0, 0, 0))
    db.put_project(Project("org/team/exp", 0, 0, 0))
    assert {p.name for p in db.list_projects()} >= {"org", "org/team", "org/team/exp"}


def test_a_quota_bounds_everything_beneath_it(db: IamDb) -> None:
    db.put_project(Project("org", 3, 0, 0))
    db.put_project(Project("org/a", 10, 0, 0))
    db.put_project(Project("org/b", 0, 0, 0))
    db.put_project(Project("org/b/x", 0, 0, 0))
    _admit(db, "org/a")
    _admit(db, "org/b/x")
    _admit(db, "org")
    with pytest.raises(e.QuotaExceeded, match="'org'"):
        _admit(db, "org/a")  # org/a has room, org does not
    assert db.usage("org").sandboxes == 3
    assert db.usage("org/b").sandboxes == 1
    db.put_project(Project("org", 10, 0, 0))
    db.put_project(Project("org/b", 0, 2.5, 0))
    with pytest.raises(e.QuotaExceeded, match="max_cpu"):
        _admit(db, "org/b/x", cpu=2.0)  # 1.0 in use beneath org/b
    _admit(db, "org/b/x", cpu=1.5)  # exactly at 2.5 now


def test_quota_below_usage_refuses_new_work_only(db: IamDb) -> None:
    db.put_project(Project("t", 5, 0, 0))
    live = [_admit(db, "t") for _ in range(3)]
    db.put_project(Project("t", 1, 0, 0))  # allowed: existing sandboxes are kept
    assert db.usage("t").sandboxes == 3
    with pytest.raises(e.QuotaExceeded):
        _admit(db, "t")
    for sid in live:
        db.release(sid)
    _admit(db, "t")


def test_delete_refuses_live_sandboxes_and_children(db: IamDb) -> None:
    db.put_project(Project("p", 0, 0, 0))
    db.put_project(Project("p/c", 0, 0, 0))
    _, key = db.create_key("bob", "p/c", "member", "")
    sid = _admit(db, "p/c")
    with pytest.raises(e.InvalidState, match="sub-projects"):
        db.delete_project("p")
    with pytest.raises(e.InvalidState, match="live sandboxes"):
        db.delete_project("p/c")
    db.release(sid)
    db.delete_project("p/c")
    with pytest.raises(e.NotFound):
        db.get_key(key.key_id)  # revoked, then removed with its project
    assert any(kind == "key" and v == key.key_id for _, kind, v, _ in db.revocations_after(0))
    with pytest.raises(e.NotFound):
        db.delete_project("p/c")
    db.delete_project("p")


def test_500_concurrent_admissions_against_a_subtree_quota_admit_exactly_300(db: IamDb) -> None:
    db.put_project(Project("big", 300, 0, 0))
    db.put_project(Project("big/a", 0, 0, 0))
    db.put_project(Project("big/b", 0, 0, 0))
    batch = [Admission("big/a" if i % 2 else "big/b", _sid(), 0.1, 10, "e0a1")
             for i in range(500)]  # fmt: skip
    results = db.admit_many(batch)
    assert sum(r is True for r in results) == 300
    assert sum(isinstance(r, e.QuotaExceeded) for r in results) == 200
    assert db.usage("big").sandboxes == 300


def test_a_burst_across_many_projects_is_split_into_transactions_that_fit(db: IamDb) -> None:
    db.put_project(Project("wide", 0, 0, 0))
    for i in range(80):
        db.put_project(Project(f"wide/p{i}", 3, 0, 0))
    batch = [Admission(f"wide/p{i % 80}", _sid(), 0.1, 10, "e0a1") for i in range(400)]
    results = db.admit_many(batch)
    assert sum(r is True for r in results) == 240
    assert all(isinstance(r, e.QuotaExceeded) for r in results if r is not True)
    assert db.usage("wide").sandboxes == 240
