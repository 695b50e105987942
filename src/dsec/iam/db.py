"""IAM state in SQLite: projects with quotas, API keys, and sandbox allocations.

Theory of operation:

* One process (the iam daemon) owns ``<home>/iam.db`` and one connection to it, used from a
  single thread (:class:`dsec.iam.service.IamService` runs every call on a one-thread
  executor). The database is in WAL mode with ``synchronous=FULL``: a commit that returned is
  on disk.
* Quota usage is never stored as a counter: it is the sum over ``allocations`` rows of the
  project. :meth:`IamDb.admit` reads that sum and inserts the new row inside one
  ``BEGIN IMMEDIATE`` transaction, so two admissions can never both see the last free slot,
  even from two processes. :meth:`IamDb.admit_many` decides a batch in one transaction
  (each request in its own savepoint) so a burst shares one fsync.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.core import projects
from dsec.core.audit import AuditEvent, verify
from dsec.core.errors import (
    AlreadyExists,
    InvalidArgument,
    InvalidState,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    Unavailable,
)
from dsec.core.ids import edge_of, is_sandbox_id, parse_api_key, validate_edge_id
from dsec.iam import audit
from dsec.iam.keys import new_api_key, secret_matches

KEY_ROLES = frozenset({"admin", "member", "viewer"})
DEFAULT_PROJECT = "default"
_MAX_TEXT = 200

_REVOCATIONS = """
CREATE TABLE IF NOT EXISTS revocations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    value TEXT NOT NULL,
    at REAL NOT NULL
);
"""
REVOCATION_KINDS = frozenset({"token", "key", "subject"})

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
CREATE INDEX IF NOT EXISTS allocations_by_project
    ON allocations(project, cpu_milli, memory_mb);
CREATE INDEX IF NOT EXISTS allocations_by_edge ON allocations(edge_id, created_at);
"""


@dataclass(frozen=True, slots=True)
class Project:
    """A project and its quota; a limit of 0 means no limit."""

    name: str
    max_sandboxes: int
    max_cpu: float
    max_memory_mb: int


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key_id: str
    subject: str
    project: str
    role: str
    name: str
    created_at: float
    revoked: bool


@dataclass(frozen=True, slots=True)
class Principal:
    """Who an API key speaks for."""

    subject: str
    project: str
    role: str
    key_id: str


@dataclass(frozen=True, slots=True)
class Usage:
    project: Project
    sandboxes: int
    cpu: float
    memory_mb: int


@dataclass(frozen=True, slots=True)
class Admission:
    """One request to admit a sandbox against its project's quota."""

    project: str
    sandbox_id: str
    cpu: float
    memory_mb: int
    edge_id: str = ""


@dataclass(frozen=True, slots=True)
class Allocation:
    sandbox_id: str
    project: str
    edge_id: str
    cpu: float
    memory_mb: int
    created_at: float


DEFAULT_QUOTA = Project(DEFAULT_PROJECT, max_sandboxes=1000, max_cpu=0.0, max_memory_mb=0)


def _milli(cpu: float) -> int:
    return round(cpu * 1000)


def _text(value: str, what: str, *, required: bool = True) -> str:
    if (required and not value) or len(value) > _MAX_TEXT or not value.isprintable():
        raise InvalidArgument(f"{what} must be 1-{_MAX_TEXT} printable characters, got {value!r}")
    return value


class IamDb:
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
                return False
            now = self._clock()
            self._upsert_project(db, DEFAULT_QUOTA, now)
            key_id, token = self._insert_key(
                db, "admin", DEFAULT_PROJECT, "admin", "bootstrap", now
            )
            write_admin_key(key_id, token)
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

    # -- projects --------------------------------------------------------------------------

    def put_project(self, project: Project, *, actor: str = "iam", request_id: str = "") -> Project:
        """Create ``project`` or replace its quota (existing allocations are kept)."""
        projects.validate(project.name)
        if project.max_sandboxes < 0 or project.max_cpu < 0 or project.max_memory_mb < 0:
            raise InvalidArgument("quota limits must be >= 0 (0 means no limit)")
        with self._write() as db:
            now = self._clock()
            up = projects.parent(project.name)
            if up and not db.execute("SELECT 1 FROM projects WHERE name = ?", (up,)).fetchone():
                raise NotFound(f"no parent project {up!r}: create it first")
            self._upsert_project(db, project, now)
            audit.append(db, AuditEvent(
                ts=now, actor=actor, action="project.put", project=project.name,
                target=project.name, request_id=request_id,
                details=f"max_sandboxes={project.max_sandboxes} max_cpu={project.max_cpu:g} "
                        f"max_memory_mb={project.max_memory_mb}",
            ))  # fmt: skip
        return self.get_project(project.name)

    def _upsert_project(self, db: sqlite3.Connection, p: Project, now: float) -> None:
        db.execute(
            "INSERT INTO projects VALUES (?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
            "max_sandboxes = excluded.max_sandboxes, max_cpu_milli = excluded.max_cpu_milli, "
            "max_memory_mb = excluded.max_memory_mb",
            (p.name, p.max_sandboxes, _milli(p.max_cpu), p.max_memory_mb, now),
        )

    def get_project(self, name: str) -> Project:
        """Raises NotFound if there is no such project."""
        rows = self._read(
            "SELECT name, max_sandboxes, max_cpu_milli, max_memory_mb FROM projects WHERE name = ?",
            (name,),
        )
        if not rows:
            raise NotFound(f"no project {name!r}")
        return _project(rows[0])

    def list_projects(self) -> list[Project]:
        rows = self._read(
            "SELECT name, max_sandboxes, max_cpu_milli, max_memory_mb FROM projects ORDER BY name"
        )
        return [_project(r) for r in rows]

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
        _text(subject, "subject")
        _text(name, "key name", required=False)
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
        _text(value, f"{kind} to revoke")
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

    # -- audit -----------------------------------------------------------------------------

    def append_audit(self, event: AuditEvent) -> AuditEvent:
        """Append an event (timestamped now if it has no time); returns the stored entry."""
        with self._write() as db:
            if not event.ts:
                from dataclasses import replace

                event = replace(event, ts=self._clock())
            return audit.append(db, event)

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

    # -- allocations -----------------------------------------------------------------------

    def admit(
        self, project: str, sandbox_id: str, cpu: float, memory_mb: int, edge_id: str = ""
    ) -> bool:
        """Record an allocation if the project's quota allows it, atomically.

        Admitting the same sandbox id to the same project again is a no-op.

        Returns:
            True if a new allocation was recorded, False if it already existed.

        Raises:
            InvalidArgument: bad sandbox id, edge id or amounts.
            NotFound: no such project.
            AlreadyExists: the sandbox id is allocated to another project.
            QuotaExceeded: a limit would be exceeded; the message names it.
        """
        (result,) = self.admit_many([Admission(project, sandbox_id, cpu, memory_mb, edge_id)])
        if isinstance(result, Exception):
            raise result
        return result

    def admit_many(self, batch: Sequence[Admission]) -> list[bool | Exception]:
        """Admit several requests in one transaction, so they share one disk sync.

        Each is decided on its own, in order, seeing the ones before it; the answer for each
        is what :meth:`admit` would return or raise. If the commit itself fails, this raises
        (nothing was admitted).
        """
        out: list[bool | Exception] = []
        with self._write() as db:
            for a in batch:
                db.execute("SAVEPOINT admit")
                try:
                    out.append(self._admit_one(db, a))
                except Exception as exc:
                    db.execute("ROLLBACK TO admit")
                    out.append(exc)
                db.execute("RELEASE admit")
        return out

    def _admit_one(self, db: sqlite3.Connection, a: Admission) -> bool:
        if not is_sandbox_id(a.sandbox_id):
            raise InvalidArgument(f"malformed sandbox id {a.sandbox_id!r}")
        owner = edge_of(a.sandbox_id)
        if a.edge_id and validate_edge_id(a.edge_id) != owner:
            raise InvalidArgument(
                f"sandbox {a.sandbox_id} belongs to edge {owner}, not {a.edge_id}"
            )
        if a.cpu < 0 or a.memory_mb < 0:
            raise InvalidArgument("cpu and memory_mb must be >= 0")
        milli = _milli(a.cpu)
        chain = []
        for level in projects.ancestors(a.project):
            row = db.execute(
                "SELECT max_sandboxes, max_cpu_milli, max_memory_mb FROM projects WHERE name = ?",
                (level,),
            ).fetchone()
            if row is None:
                raise NotFound(f"no project {level!r}")
            chain.append((level, row))
        have = db.execute(
            "SELECT project FROM allocations WHERE sandbox_id = ?", (a.sandbox_id,)
        ).fetchone()
        if have is not None:
            if have[0] != a.project:
                raise AlreadyExists(f"sandbox {a.sandbox_id} is allocated to another project")
            return False
        for level, row in chain:  # a quota bounds everything beneath its project
            if row == (0, 0, 0):
                continue
            _check_quota(level, row, _subtree_usage(db, level), milli, a.memory_mb)
        db.execute(
            "INSERT INTO allocations VALUES (?, ?, ?, ?, ?, ?)",
            (a.sandbox_id, a.project, owner, milli, a.memory_mb, self._clock()),
        )
        return True

    def release(self, sandbox_id: str, *, edge_id: str = "") -> Allocation | None:
        """Drop a sandbox's allocation; returns it, or None if there was none (idempotent).

        With ``edge_id`` (the caller is that edge) only that edge's allocations may go.

        Raises:
            PermissionDenied: the allocation belongs to another edge.
        """
        with self._write() as db:
            row = db.execute(f"{_ALLOC_SELECT} WHERE sandbox_id = ?", (sandbox_id,)).fetchone()
            if row is None:
                return None
            alloc = _alloc(row)
            if edge_id and alloc.edge_id != edge_id:
                raise PermissionDenied(f"edge {edge_id} may not release {sandbox_id}")
            db.execute("DELETE FROM allocations WHERE sandbox_id = ?", (sandbox_id,))
        return alloc

    def reconcile(self, edge_id: str, live: Sequence[str], grace_s: float) -> list[str]:
        """Drop allocations of ``edge_id`` whose sandbox is not in ``live``.

        Allocations younger than ``grace_s`` are kept: the edge may not have received the
        create call yet when it took its list.

        Returns:
            The sandbox ids released.
        """
        validate_edge_id(edge_id)
        keep = set(live)
        cutoff = self._clock() - grace_s
        with self._write() as db:
            rows = db.execute(
                "SELECT sandbox_id FROM allocations WHERE edge_id = ? AND created_at <= ?",
                (edge_id, cutoff),
            ).fetchall()
            gone = [str(r[0]) for r in rows if r[0] not in keep]
            db.executemany("DELETE FROM allocations WHERE sandbox_id = ?", [(s,) for s in gone])
        return gone

    def usage(self, project: str) -> Usage:
        """Current usage of ``project``, summed from its allocations. Raises NotFound."""
        p = self.get_project(project)
        try:
            count, milli, mem = _subtree_usage(self._db, project)
        except sqlite3.Error as e:
            raise Unavailable(f"IAM database read failed: {e}") from e
        return Usage(p, count, milli / 1000, mem)

    def delete_project(self, name: str, *, actor: str = "iam", request_id: str = "") -> None:
        """Delete an empty leaf project and revoke its keys.

        Raises:
            NotFound: no such project.
            InvalidState: it has sub-projects or live sandboxes.
        """
        with self._write() as db:
            if not db.execute("SELECT 1 FROM projects WHERE name = ?", (name,)).fetchone():
                raise NotFound(f"no project {name!r}")
            children = db.execute(
                "SELECT count(*) FROM projects WHERE substr(name, 1, ?) = ?",
                (len(name) + 1, name + "/"),
            ).fetchone()[0]
            if children:
                raise InvalidState(
                    f"project {name!r} has {children} sub-projects; delete them first"
                )
            live = _subtree_usage(db, name)[0]
            if live:
                raise InvalidState(
                    f"project {name!r} still has {live} live sandboxes; kill them first"
                )
            now = self._clock()
            for (k,) in db.execute(
                "SELECT key_id FROM api_keys WHERE project = ? AND revoked_at IS NULL", (name,)
            ).fetchall():
                db.execute("UPDATE api_keys SET revoked_at = ? WHERE key_id = ?", (now, k))
                db.execute(
                    "INSERT INTO revocations (kind, value, at) VALUES ('key', ?, ?)", (k, now)
                )
            db.execute("DELETE FROM api_keys WHERE project = ?", (name,))  # all revoked above
            db.execute("DELETE FROM projects WHERE name = ?", (name,))
            audit.append(
                db,
                AuditEvent(
                    ts=now,
                    actor=actor,
                    action="project.delete",
                    project=name,
                    target=name,
                    request_id=request_id,
                ),
            )

    def allocations(self, *, edge_id: str = "") -> list[Allocation]:
        if edge_id:
            rows = self._read(f"{_ALLOC_SELECT} WHERE edge_id = ? ORDER BY created_at", (edge_id,))
        else:
            rows = self._read(f"{_ALLOC_SELECT} ORDER BY created_at")
        return [_alloc(r) for r in rows]


_KEY_SELECT = "SELECT key_id, subject, project, role, name, created_at, revoked_at FROM api_keys"
_ALLOC_SELECT = (
    "SELECT sandbox_id, project, edge_id, cpu_milli, memory_mb, created_at FROM allocations"
)


def _subtree_usage(db: sqlite3.Connection, project: str) -> tuple[int, int, int]:
    """(sandboxes, cpu millicores, memory MiB) allocated in ``project`` and beneath it."""
    row = db.execute(
        "SELECT count(*), coalesce(sum(cpu_milli), 0), coalesce(sum(memory_mb), 0) "
        "FROM allocations WHERE project = ? OR substr(project, 1, ?) = ?",
        (project, len(project) + 1, project + "/"),
    ).fetchone()
    return int(row[0]), int(row[1]), int(row[2])


def _check_quota(
    project: str,
    limits: tuple[int, int, int],
    used: tuple[int, int, int],
    cpu_milli: int,
    memory_mb: int,
) -> None:
    max_sbx, max_milli, max_mem = limits
    count, used_milli, used_mem = used
    if max_sbx and count + 1 > max_sbx:
        raise QuotaExceeded(
            f"project {project!r}: max_sandboxes {max_sbx} reached ({count} in use)"
        )
    if max_milli and used_milli + cpu_milli > max_milli:
        raise QuotaExceeded(
            f"project {project!r}: max_cpu {max_milli / 1000:g} exceeded "
            f"({used_milli / 1000:g} in use + {cpu_milli / 1000:g} requested)"
        )
    if max_mem and used_mem + memory_mb > max_mem:
        raise QuotaExceeded(
            f"project {project!r}: max_memory_mb {max_mem} exceeded "
            f"({used_mem} in use + {memory_mb} requested)"
        )


def _project(r: Any) -> Project:
    return Project(str(r[0]), int(r[1]), int(r[2]) / 1000, int(r[3]))


def _key(r: Any) -> KeyRecord:
    return KeyRecord(
        str(r[0]), str(r[1]), str(r[2]), str(r[3]), str(r[4]), float(r[5]), r[6] is not None
    )


def _alloc(r: Any) -> Allocation:
    return Allocation(str(r[0]), str(r[1]), str(r[2]), int(r[3]) / 1000, int(r[4]), float(r[5]))
