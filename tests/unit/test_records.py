"""The edge's durable sandbox records."""

from __future__ import annotations

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
