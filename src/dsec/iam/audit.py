"""The audit table in the iam's SQLite database.

Entries are only ever inserted. IAM mutations append their entry inside their own
transaction (so a mutation without its audit entry can never commit); other components
append through the ``AppendAudit`` RPC.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, fields

from dsec.core.audit import AuditEvent, chain

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    project TEXT NOT NULL,
    target TEXT NOT NULL,
    result TEXT NOT NULL,
    request_id TEXT NOT NULL,
    details TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_ts ON audit(ts);
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
"""

_COLUMNS = ("seq", "ts", "actor", "action", "project", "target", "result", "request_id",
            "details", "prev_hash", "hash")  # fmt: skip
_ORDER = [f.name for f in fields(AuditEvent)]


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditQuery:
    since: float = 0.0
    until: float = 0.0  # 0: no upper bound
    project: str = ""
    actor: str = ""
    action: str = ""  # exact, or a prefix ending in "." ("sandbox.")
    after_seq: int = 0
    limit: int = 1000


def _row(r: Sequence[object]) -> AuditEvent:
    values = dict(zip(_COLUMNS, r, strict=True))
    return AuditEvent(**{k: values[k] for k in _ORDER})  # type: ignore[arg-type]


def head(db: sqlite3.Connection) -> AuditEvent | None:
    r = db.execute(f"SELECT {', '.join(_COLUMNS)} FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
    return _row(r) if r else None


def append(db: sqlite3.Connection, event: AuditEvent) -> AuditEvent:
    """Insert ``event`` after the current head; call inside a write transaction."""
    return append_many(db, [event])[0]


def append_many(
    db: sqlite3.Connection, events: Sequence[AuditEvent], *, now: float = 0.0
) -> list[AuditEvent]:
    """Insert ``events`` in order after the current head (read once), those without a time
    at ``now``; call inside a write transaction."""
    out: list[AuditEvent] = []
    prev = head(db)
    insert = f"INSERT INTO audit ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
    for event in events:
        prev = chain(prev, event, now=now)
        db.execute(insert, [getattr(prev, c) for c in _COLUMNS])
        out.append(prev)
    return out


def query(db: sqlite3.Connection, q: AuditQuery) -> list[AuditEvent]:
    where, args = ["seq > ?"], [q.after_seq]
    if q.since:
        where.append("ts >= ?")
        args.append(q.since)  # type: ignore[arg-type]
    if q.until:
        where.append("ts < ?")
        args.append(q.until)  # type: ignore[arg-type]
    for col, value in (("project", q.project), ("actor", q.actor)):
        if value:
            where.append(f"{col} = ?")
            args.append(value)  # type: ignore[arg-type]
    if q.action:
        if q.action.endswith("."):
            where.append("substr(action, 1, ?) = ?")
            args += [len(q.action), q.action]  # type: ignore[list-item]
        else:
            where.append("action = ?")
            args.append(q.action)  # type: ignore[arg-type]
    sql = (f"SELECT {', '.join(_COLUMNS)} FROM audit WHERE {' AND '.join(where)} "
           "ORDER BY seq LIMIT ?")  # fmt: skip
    return [_row(r) for r in db.execute(sql, [*args, max(1, min(q.limit, 10000))])]


def all_entries(db: sqlite3.Connection) -> list[AuditEvent]:
    return [_row(r) for r in db.execute(f"SELECT {', '.join(_COLUMNS)} FROM audit ORDER BY seq")]
