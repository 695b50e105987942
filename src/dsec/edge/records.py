"""The edge's durable sandbox records, in SQLite next to the edge's other state.

A record is written before every side effect (``creating`` before the container exists,
``stopping`` before teardown), so after a crash the edge knows exactly what may be half
done and finishes or undoes it on restart.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from dsec.core.lifecycle import LIVE, Event, State, apply
from dsec.core.spec import SandboxSpec

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
  id TEXT PRIMARY KEY,
  project TEXT NOT NULL,
  owner TEXT NOT NULL,
  state TEXT NOT NULL,
  spec TEXT NOT NULL,
  created_at REAL NOT NULL,
  started_at REAL NOT NULL DEFAULT 0,
  expires_at REAL NOT NULL,
  ended_at REAL NOT NULL DEFAULT 0,
  pid INTEGER NOT NULL DEFAULT 0,
  error TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
"""
# Columns added since: an older edge's table gains them on open (``ALTER TABLE ... ADD``).
_ADDED = {
    "moved_to": "TEXT NOT NULL DEFAULT ''",
    "moved_from": "TEXT NOT NULL DEFAULT ''",
}
_COLUMNS = (
    "id, project, owner, state, spec, created_at, started_at, expires_at, ended_at, pid, error, "
    "moved_to, moved_from"
)
# How an edge before ``moved_to`` recorded a move, in ``error``: still read as ``moved_to``.
LEGACY_MOVED_TO = "moved to another edge as "


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxRecord:
    id: str
    project: str
    owner: str
    state: State
    spec: SandboxSpec
    created_at: float
    expires_at: float
    started_at: float = 0.0
    ended_at: float = 0.0
    pid: int = 0
    error: str = ""
    moved_to: str = ""  # the tombstone of a sandbox resumed on another edge: its id there
    moved_from: str = ""  # a sandbox resumed here from another edge: its id there

    def moved(self, event: Event, **changes: object) -> SandboxRecord:
        """The record after ``event`` (raises InvalidState if the lifecycle forbids it)."""
        return replace(self, state=apply(self.state, event), **changes)  # type: ignore[arg-type]

    @property
    def live(self) -> bool:
        return self.state in LIVE


class RecordStore:
    """SQLite-backed records; every call is a short, synchronous transaction."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        have = {str(r[1]) for r in self._db.execute("PRAGMA table_info(sandboxes)")}
        for name, decl in _ADDED.items():
            if name not in have:
                self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {decl}")
        self._lock = threading.Lock()

    def put(self, rec: SandboxRecord) -> None:
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO sandboxes ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    rec.id,
                    rec.project,
                    rec.owner,
                    rec.state.value,
                    json.dumps(rec.spec.to_dict()),
                    rec.created_at,
                    rec.started_at,
                    rec.expires_at,
                    rec.ended_at,
                    rec.pid,
                    rec.error,
                    rec.moved_to,
                    rec.moved_from,
                ),
            )

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM sandboxes WHERE id=?", (sandbox_id,)
            ).fetchone()
        return _row(row) if row else None

    def all(self) -> list[SandboxRecord]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM sandboxes ORDER BY created_at"
            ).fetchall()
        return [_row(r) for r in rows]

    def delete_ended_before(self, cutoff: float) -> int:
        with self._lock:
            cur = self._db.execute(
                "DELETE FROM sandboxes WHERE state IN (?, ?) AND ended_at < ?",
                (State.STOPPED.value, State.FAILED.value, cutoff),
            )
        return cur.rowcount

    def close(self) -> None:
        self._db.close()


def _row(row: tuple[object, ...]) -> SandboxRecord:
    (sid, project, owner, state, spec, created, started, expires, ended, pid, error, moved_to,
     moved_from) = row  # fmt: skip
    error, moved_to = str(error), str(moved_to)
    if not moved_to and error.startswith(LEGACY_MOVED_TO):
        error, moved_to = "", error.removeprefix(LEGACY_MOVED_TO)
    return SandboxRecord(
        id=str(sid),
        project=str(project),
        owner=str(owner),
        state=State(state),
        spec=SandboxSpec.from_dict(json.loads(str(spec))),
        created_at=float(created),  # type: ignore[arg-type]
        started_at=float(started),  # type: ignore[arg-type]
        expires_at=float(expires),  # type: ignore[arg-type]
        ended_at=float(ended),  # type: ignore[arg-type]
        pid=int(pid),  # type: ignore[call-overload]
        error=error,
        moved_to=moved_to,
        moved_from=str(moved_from),
    )
