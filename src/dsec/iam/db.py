"""IAM state in SQLite: projects with quotas, API keys, and sandbox allocations.

Theory of operation:

* One process (the iam daemon) owns ``<home>/iam.db`` and one connection to it, used from a
  single thread (:class:`dsec.iam.service.IamService` runs every call on a one-thread
  executor). The database is in WAL mode with ``synchronous=FULL``: a commit that returned is
  on disk.
* Quota usage is never a counter the code keeps: it is the sum over ``allocations`` rows of
  the project, which SQLite triggers keep per project in ``project_usage`` in the same
  statement as the row. :meth:`IamDb.admit` reads those sums and inserts the new row inside one
  ``BEGIN IMMEDIATE`` transaction, so two admissions can never both see the last free slot,
  even from two processes. :meth:`IamDb.admit_many` decides a batch in one transaction
  (each request decided on its own, seeing those before it) so a burst shares one fsync.
* Every method validates its inputs and raises :mod:`dsec.core.errors` classes; sqlite3
  errors are translated to :class:`~dsec.core.errors.Unavailable` at this boundary.
* Resource amounts: CPU is stored in integer millicores so sums are exact; a limit of 0
  means "no limit".
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dsec.core.audit import AuditEvent, verify
from dsec.core.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    Unauthenticated,
    Unavailable,
)
from dsec.core.ids import parse_api_key
from dsec.iam import audit
from dsec.iam.keys import hash_secret, new_api_key, secret_matches
from dsec.iam.quotas import QuotasMixin
from dsec.iam.records import (
    DEFAULT_PROJECT,
    DEFAULT_QUOTA,
    KEY_ROLES,
    PLATFORM,
    Admission,
    Allocation,
    Grant,
    KeyRecord,
    Principal,
    Project,
    Usage,
    check_grant,
    text,
)

__all__ = [
    "DEFAULT_PROJECT",
    "DEFAULT_QUOTA",
    "KEY_ROLES",
    "REVOCATION_KINDS",
    "Admission",
    "Allocation",
    "IamDb",
    "KeyRecord",
    "Principal",
    "Project",
    "Usage",
]

_REVOCATIONS = """
CREATE TABLE IF NOT EXISTS revocations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    value TEXT NOT NULL,
    at REAL NOT NULL
);
"""
REVOCATION_KINDS = frozenset({"token", "key", "subject"})

# Per-project sums of ``allocations``, kept by SQLite itself: the triggers change them in the
# statement that inserts or deletes the allocation, so they cannot drift from the rows, and
# an admission reads a few sums instead of every allocation of the subtree. Created and
# filled from the rows in one transaction when an older database is opened (an empty
# project_usage means no allocation was ever made since it exists).
_USAGE = """
BEGIN IMMEDIATE;
CREATE TABLE IF NOT EXISTS project_usage (
    project TEXT PRIMARY KEY,
    sandboxes INTEGER NOT NULL,
    cpu_milli INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS project_usage_add AFTER INSERT ON allocations BEGIN
    INSERT INTO project_usage VALUES (NEW.project, 1, NEW.cpu_milli, NEW.memory_mb)
    ON CONFLICT (project) DO UPDATE SET sandboxes = sandboxes + 1,
        cpu_milli = cpu_milli + NEW.cpu_milli, memory_mb = memory_mb + NEW.memory_mb;
END;
CREATE TRIGGER IF NOT EXISTS project_usage_sub AFTER DELETE ON allocations BEGIN
    UPDATE project_usage SET sandboxes = sandboxes - 1, cpu_milli = cpu_milli - OLD.cpu_milli,
        memory_mb = memory_mb - OLD.memory_mb WHERE project = OLD.project;
END;
CREATE TRIGGER IF NOT EXISTS project_usage_move AFTER UPDATE ON allocations BEGIN
    UPDATE project_usage SET sandboxes = sandboxes - 1, cpu_milli = cpu_milli - OLD.cpu_milli,
        memory_mb = memory_mb - OLD.memory_mb WHERE project = OLD.project;
    INSERT INTO project_usage VALUES (NEW.project, 1, NEW.cpu_milli, NEW.memory_mb)
    ON CONFLICT (project) DO UPDATE SET sandboxes = sandboxes + 1,
        cpu_milli = cpu_milli + NEW.cpu_milli, memory_mb = memory_mb + NEW.memory_mb;
END;
INSERT INTO project_usage
    SELECT project, count(*), sum(cpu_milli), sum(memory_mb) FROM allocations
    WHERE NOT EXISTS (SELECT 1 FROM project_usage) GROUP BY project;
COMMIT;
"""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS projects (
    name TEXT PRIMARY KEY,
    max_sandboxes INTEGER NOT NULL,
    max_cpu_milli INTEGER NOT NULL,
    max_memory_mb INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    secret_sha256 TEXT NOT NULL,
    subject TEXT NOT NULL,
    project TEXT NOT NULL REFERENCES projects(name),
    role TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS allocations (
    sandbox_id TEXT PRIMARY KEY,
    project TEXT NOT NULL REFERENCES projects(name),
    edge_id TEXT NOT NULL,
    cpu_milli INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    created_at REAL NOT NULL
);
-- usage is read from project_usage, never summed over a project's rows: no index by project
-- (each admission would write one more page of it)
DROP INDEX IF EXISTS allocations_by_project;
CREATE INDEX IF NOT EXISTS allocations_by_edge ON allocations(edge_id, created_at);
CREATE TABLE IF NOT EXISTS moves (
    old TEXT PRIMARY KEY,
    new TEXT NOT NULL,
    edge_id TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS moves_by_edge ON moves(edge_id);
CREATE TABLE IF NOT EXISTS join_tokens (
    token_id TEXT PRIMARY KEY,
    secret_sha256 TEXT NOT NULL,
    expires_at REAL NOT NULL,
    used_by TEXT
);
CREATE TABLE IF NOT EXISTS edges (edge_id TEXT PRIMARY KEY, joined_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS grants (
    project TEXT NOT NULL,
    subject TEXT NOT NULL,
    role TEXT NOT NULL,
    PRIMARY KEY (project, subject)
);
"""


# What a move row keeps of the allocation it renamed (columns added to databases from before
# them; their rows have project ''): enough to count the source again if it runs at home
# once the new sandbox, and its allocation, are gone (QuotasMixin.settle_moves).
_MOVES_ALLOCATION = (
    ("project", "TEXT NOT NULL DEFAULT ''"),
    ("cpu_milli", "INTEGER NOT NULL DEFAULT 0"),
    ("memory_mb", "INTEGER NOT NULL DEFAULT 0"),
)


def _add_columns(db: sqlite3.Connection, table: str, columns: tuple[tuple[str, str], ...]) -> None:
    have = {str(r[1]) for r in db.execute(f"PRAGMA table_info({table})")}
    for name, decl in columns:
        if name not in have:
            try:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
            except sqlite3.OperationalError as e:  # another process added it just now
                if "duplicate column" not in str(e):
                    raise


class IamDb(QuotasMixin):
    """The IAM tables behind one SQLite connection; not thread-safe: use from one thread."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        """Open (creating if needed) the database at ``path``.

        Raises:
            Unavailable: the file cannot be opened or is not an IAM database.
        """
        self.path = path
        self._clock = clock
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout = 5000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.executescript(_SCHEMA)
            self._db.executescript(audit.SCHEMA)
            self._db.executescript(_REVOCATIONS)
            _add_columns(self._db, "moves", _MOVES_ALLOCATION)
            try:
                self._db.executescript(_USAGE)
            except sqlite3.Error:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            raise Unavailable(f"cannot open IAM database {path}: {e}") from e

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction: committed on success, rolled back on error."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise Unavailable(f"IAM database busy: {e}") from e
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as e:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            raise Unavailable(f"IAM database commit failed: {e}") from e

    def _read(self, sql: str, args: Sequence[object] = ()) -> list[Any]:
        try:
            return list(self._db.execute(sql, args))
        except sqlite3.Error as e:
            raise Unavailable(f"IAM database read failed: {e}") from e

    # -- bootstrap -------------------------------------------------------------------------

    def bootstrap(self, write_admin_key: Callable[[str, str], None]) -> bool:
        """On the very first start, create the default project and an admin key.

        ``write_admin_key(key_id, api_key)`` is called inside the transaction, so if it fails
        nothing is committed and the next start tries again.

        Returns:
            True if this call bootstrapped, False if the database was set up before.
        """
        with self._write() as db:
            if db.execute("SELECT 1 FROM meta WHERE key = 'bootstrapped'").fetchone():
                # A database from before per-project roles had no grants: its bootstrap
                # admin keeps the platform-wide admin role it had then.
                if not db.execute("SELECT 1 FROM grants WHERE project = ?", (PLATFORM,)).fetchone():
                    db.execute("INSERT INTO grants VALUES (?, 'admin', 'admin')", (PLATFORM,))
                return False
            now = self._clock()
            self._upsert_project(db, DEFAULT_QUOTA, now)
            key_id, token = self._insert_key(
                db, "admin", DEFAULT_PROJECT, "admin", "bootstrap", now
            )
            write_admin_key(key_id, token)
            db.execute("INSERT OR REPLACE INTO grants VALUES (?, 'admin', 'admin')", (PLATFORM,))
            db.execute("INSERT INTO meta VALUES ('bootstrapped', ?)", (repr(now),))
            audit.append(
                db,
                AuditEvent(
                    ts=now,
                    actor="iam",
                    action="iam.bootstrap",
                    project=DEFAULT_PROJECT,
                    target=key_id,
                ),
            )
            return True

    # -- keys ------------------------------------------------------------------------------

    def create_key(
        self,
        subject: str,
        project: str,
        role: str,
        name: str,
        *,
        actor: str = "iam",
        request_id: str = "",
    ) -> tuple[str, KeyRecord]:
        """Create an API key; returns the full key (shown once) and its record.

        Raises:
            InvalidArgument: bad subject, role or name.
            NotFound: the project does not exist.
        """
        text(subject, "subject")
        text(name, "key name", required=False)
        if role not in KEY_ROLES:
            raise InvalidArgument(f"role must be one of {sorted(KEY_ROLES)}, got {role!r}")
        self.get_project(project)
        with self._write() as db:
            now = self._clock()
            key_id, token = self._insert_key(db, subject, project, role, name, now)
            audit.append(db, AuditEvent(
                ts=now, actor=actor, action="key.create", project=project, target=key_id,
                request_id=request_id, details=f"subject={subject} role={role}",
            ))  # fmt: skip
        return token, self.get_key(key_id)

    def _insert_key(
        self, db: sqlite3.Connection, subject: str, project: str, role: str, name: str, now: float
    ) -> tuple[str, str]:
        key_id, secret_hash, token = new_api_key()
        db.execute(
            "INSERT INTO api_keys VALUES (?, ?, ?, ?, ?, ?, ?, NULL)",
            (key_id, secret_hash, subject, project, role, name, now),
        )
        return key_id, token

    def get_key(self, key_id: str) -> KeyRecord:
        rows = self._read(f"{_KEY_SELECT} WHERE key_id = ?", (key_id,))
        if not rows:
            raise NotFound(f"no API key {key_id!r}")
        return _key(rows[0])

    def list_keys(self, project: str = "") -> list[KeyRecord]:
        """Every key (of ``project`` when given), oldest first; secrets are never returned."""
        if project:
            rows = self._read(f"{_KEY_SELECT} WHERE project = ? ORDER BY created_at", (project,))
        else:
            rows = self._read(f"{_KEY_SELECT} ORDER BY created_at")
        return [_key(r) for r in rows]

    def revoke_key(self, key_id: str, *, actor: str = "iam", request_id: str = "") -> None:
        """Revoke a key for good; revoking it again is a no-op. Raises NotFound."""
        with self._write() as db:
            now = self._clock()
            cur = db.execute(
                "UPDATE api_keys SET revoked_at = coalesce(revoked_at, ?) WHERE key_id = ?",
                (now, key_id),
            )
            if cur.rowcount == 0:
                raise NotFound(f"no API key {key_id!r}")
            (project,) = db.execute(
                "SELECT project FROM api_keys WHERE key_id = ?", (key_id,)
            ).fetchone()
            db.execute(
                "INSERT INTO revocations (kind, value, at) VALUES ('key', ?, ?)", (key_id, now)
            )
            audit.append(
                db,
                AuditEvent(
                    ts=now,
                    actor=actor,
                    action="key.revoke",
                    project=project,
                    target=key_id,
                    request_id=request_id,
                ),
            )

    def revoke(self, kind: str, value: str, *, actor: str = "iam", request_id: str = "") -> None:
        """Revoke a token (by id), an API key, or a subject (all its keys and tokens)."""
        if kind not in REVOCATION_KINDS:
            raise InvalidArgument(f"kind must be one of {sorted(REVOCATION_KINDS)}, got {kind!r}")
        text(value, f"{kind} to revoke")
        if kind == "key":
            self.revoke_key(value, actor=actor, request_id=request_id)
            return
        with self._write() as db:
            now = self._clock()
            db.execute(
                "INSERT INTO revocations (kind, value, at) VALUES (?, ?, ?)", (kind, value, now)
            )
            if kind == "subject":
                live = db.execute(
                    "SELECT key_id FROM api_keys WHERE subject = ? AND revoked_at IS NULL",
                    (value,),
                ).fetchall()
                for (k,) in live:
                    db.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ?", (now, k))
                    db.execute(
                        "INSERT INTO revocations (kind, value, at) VALUES ('key', ?, ?)", (k, now)
                    )
            audit.append(
                db,
                AuditEvent(
                    ts=now, actor=actor, action=f"{kind}.revoke", target=value,
                    request_id=request_id,
                ),
            )  # fmt: skip

    def revocations_after(self, seq: int, limit: int = 10000) -> list[tuple[int, str, str, float]]:
        """The revocation feed after ``seq``, oldest first."""
        rows = self._read(
            "SELECT seq, kind, value, at FROM revocations WHERE seq > ? ORDER BY seq LIMIT ?",
            (seq, limit),
        )
        return [(int(r[0]), str(r[1]), str(r[2]), float(r[3])) for r in rows]

    # -- role grants -----------------------------------------------------------------------

    def grant_role(
        self, project: str, subject: str, role: str, *, actor: str = "iam", request_id: str = ""
    ) -> None:
        """Give ``subject`` ``role`` on ``project`` and beneath (role "": take it away).

        Raises:
            InvalidArgument: bad subject or role.
            NotFound: no such project.
        """
        check_grant(project, subject, role)
        with self._write() as db:
            if (
                project != PLATFORM
                and not db.execute("SELECT 1 FROM projects WHERE name = ?", (project,)).fetchone()
            ):
                raise NotFound(f"no project {project!r}")
            if role:
                db.execute(
                    "INSERT OR REPLACE INTO grants VALUES (?, ?, ?)", (project, subject, role)
                )
            else:
                db.execute(
                    "DELETE FROM grants WHERE project = ? AND subject = ?", (project, subject)
                )
            audit.append(db, AuditEvent(
                ts=self._clock(), actor=actor, action="role.grant" if role else "role.remove",
                project=project, target=subject, request_id=request_id, details=f"role={role}",
            ))  # fmt: skip

    def list_grants(self, subject: str = "", project: str = "") -> list[Grant]:
        """Grants of ``subject`` (all when empty) on ``project`` (all when empty)."""
        rows = self._read(
            "SELECT project, subject, role FROM grants WHERE (? = '' OR subject = ?) "
            "AND (? = '' OR project = ?) ORDER BY project, subject",
            (subject, subject, project, project),
        )
        return [Grant(str(r[0]), str(r[1]), str(r[2])) for r in rows]

    # -- joining nodes ---------------------------------------------------------------------

    def create_join_token(
        self, token_id: str, secret: str, ttl_s: float, *, actor: str = "iam",
        request_id: str = "",
    ) -> float:  # fmt: skip
        """Store a one-time bootstrap token (its secret hashed); returns its expiry."""
        with self._write() as db:
            now = self._clock()
            db.execute("INSERT INTO join_tokens VALUES (?, ?, ?, NULL)",
                       (token_id, hash_secret(secret), now + ttl_s))  # fmt: skip
            audit.append(db, AuditEvent(
                ts=now, actor=actor, action="cluster.token.create", target=token_id,
                request_id=request_id, details=f"ttl_s={ttl_s:g}",
            ))  # fmt: skip
            return now + ttl_s

    def redeem_join_token(self, token_id: str, secret: str, edge_id: str) -> None:
        """Burn the token for ``edge_id`` and record the edge.

        Raises:
            Unauthenticated: unknown, wrong, expired or already used token (one message).
            AlreadyExists: an edge with that id has joined before.
        """
        with self._write() as db:
            row = db.execute(
                "SELECT secret_sha256, expires_at, used_by FROM join_tokens WHERE token_id = ?",
                (token_id,),
            ).fetchone()
            now = self._clock()
            if (not secret_matches(row[0] if row else None, secret) or row is None
                    or row[1] < now or row[2] is not None):  # fmt: skip
                raise Unauthenticated("invalid, expired or used bootstrap token")
            if db.execute("SELECT 1 FROM edges WHERE edge_id = ?", (edge_id,)).fetchone():
                raise AlreadyExists(f"an edge {edge_id!r} has joined already")
            db.execute("UPDATE join_tokens SET used_by = ? WHERE token_id = ?", (edge_id, token_id))
            db.execute("INSERT INTO edges VALUES (?, ?)", (edge_id, now))
            audit.append(db, AuditEvent(
                ts=now, actor=f"edge {edge_id}", action="cluster.join", target=edge_id,
                details=f"token={token_id}",
            ))  # fmt: skip

    # -- audit -----------------------------------------------------------------------------

    def append_audit(self, event: AuditEvent) -> AuditEvent:
        """Append an event (timestamped now if it has no time); returns the stored entry."""
        with self._write() as db:
            if not event.ts:
                from dataclasses import replace

                event = replace(event, ts=self._clock())
            return audit.append(db, event)

    def append_audit_many(self, events: Sequence[AuditEvent]) -> list[AuditEvent]:
        """Append several events in one transaction (one disk sync), in order."""
        with self._write() as db:
            return audit.append_many(db, events, now=self._clock())

    def query_audit(self, q: audit.AuditQuery) -> list[AuditEvent]:
        try:
            return audit.query(self._db, q)
        except sqlite3.Error as e:
            raise Unavailable(f"IAM database read failed: {e}") from e

    def verify_audit(self) -> tuple[int, int | None, str]:
        """(number of entries, seq of the first broken entry or None, head hash)."""
        try:
            entries = audit.all_entries(self._db)
        except sqlite3.Error as e:
            raise Unavailable(f"IAM database read failed: {e}") from e
        return len(entries), verify(entries), entries[-1].hash if entries else ""

    def authenticate(self, api_key: str) -> Principal:
        """Return who ``api_key`` speaks for.

        Raises:
            Unauthenticated: malformed, unknown or revoked key (one message for all three).
        """
        try:
            key_id, secret = parse_api_key(api_key)
        except InvalidArgument as e:
            raise Unauthenticated("invalid API key") from e
        rows = self._read(
            "SELECT secret_sha256, subject, project, role, revoked_at FROM api_keys "
            "WHERE key_id = ?",
            (key_id,),
        )
        stored = str(rows[0][0]) if rows else None
        if not secret_matches(stored, secret) or rows[0][4] is not None:
            raise Unauthenticated("invalid API key")
        _, subject, project, role, _ = rows[0]
        return Principal(str(subject), str(project), str(role), key_id)


_KEY_SELECT = "SELECT key_id, subject, project, role, name, created_at, revoked_at FROM api_keys"


def _key(r: Any) -> KeyRecord:
    return KeyRecord(
        str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), float(r[5]), r[6] is not None
    )
