"""The edge's durable sandbox records."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from dsec.core.errors import InvalidState
from dsec.core.lifecycle import Event, State
from dsec.core.spec import SandboxSpec
from dsec.edge.records import RecordStore, SandboxRecord


def _rec(sid: str = "sbx-e0a1-aaaaaaaaaaaaaaaaaaaa") -> SandboxRecord:
    return SandboxRecord(
        id=sid,
        project="p",
        owner="o",
        state=State.CREATING,
        spec=SandboxSpec(memory_mb=64),
        created_at=1.0,
        expires_at=301.0,
    )


def test_records_survive_reopen_and_move_through_the_table(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    store = RecordStore(db)
    rec = _rec()
    store.put(rec)
    running = rec.moved(Event.STARTED, pid=42, started_at=2.0)
    store.put(running)
    store.close()
    again = RecordStore(db)
    got = again.get(rec.id)
    assert got == running
    assert got is not None
    assert got.live
    assert got.state is State.RUNNING
    with pytest.raises(InvalidState):
        got.moved(Event.RESUME)
    stopped = got.moved(Event.STOP).moved(Event.STOPPED, ended_at=5.0)
    again.put(stopped)
    assert not stopped.live
    assert again.delete_ended_before(4.0) == 0
    assert again.delete_ended_before(6.0) == 1
    assert again.get(rec.id) is None
    assert again.all() == []


def test_move_fields_round_trip(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "r.db")
    rec = _rec().moved(Event.FAILED, moved_to="sbx-ffff-bbbbbbbbbbbbbbbbbbbb", moved_from="x")
    store.put(rec)
    assert store.get(rec.id) == rec


def test_an_older_edges_table_gains_the_move_columns_and_its_tombstones_read_as_moved_to(
    tmp_path: Path,
) -> None:
    db = tmp_path / "r.db"
    old = sqlite3.connect(db)  # the table as an edge before moved_to wrote it
    old.executescript(
        "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, project TEXT NOT NULL, owner TEXT NOT "
        "NULL, state TEXT NOT NULL, spec TEXT NOT NULL, created_at REAL NOT NULL, started_at "
        "REAL NOT NULL DEFAULT 0, expires_at REAL NOT NULL, ended_at REAL NOT NULL DEFAULT 0, "
        "pid INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '');"
    )
    new = "sbx-ffff-cccccccccccccccccccc"
    rows = [
        ("sbx-e0a1-aaaaaaaaaaaaaaaaaaaa", f"moved to another edge as {new}"),
        ("sbx-e0a1-dddddddddddddddddddd", "create failed: no"),
    ]
    for sid, error in rows:
        old.execute(
            "INSERT INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (sid, "p", "o", "stopped", '{"memory_mb": 64}', 1.0, 2.0, 3.0, 4.0, 0, error),
        )
    old.commit()
    old.close()
    store = RecordStore(db)
    moved, failed = (store.get(sid) for sid, _ in rows)
    assert moved is not None
    assert failed is not None
    assert (moved.moved_to, moved.error, moved.moved_from) == (new, "", "")
    assert (failed.moved_to, failed.error) == ("", "create failed: no")
    store.put(moved)  # rewritten in the new form: still the same record
    store.close()
    assert RecordStore(db).get(moved.id) == moved
