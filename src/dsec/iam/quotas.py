"""Projects, quotas and admission: the part of :class:`dsec.iam.db.IamDb` that decides
whether a sandbox may start.

Usage is never a counter the code keeps: it is the sum of ``allocations`` rows beneath a
project (per-project sums that SQLite triggers keep with the rows), read and written inside
one ``BEGIN IMMEDIATE`` transaction, and a quota on a project bounds its
whole subtree, so admission checks every ancestor (see ``dsec.core.projects``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from dsec.core import projects
from dsec.core.audit import AuditEvent
from dsec.core.errors import (
    AlreadyExists,
    InvalidArgument,
    InvalidState,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Unavailable,
)
from dsec.core.ids import edge_of, is_sandbox_id, validate_edge_id
from dsec.iam import audit
from dsec.iam.records import Admission, Allocation, Project, Usage, milli


class QuotasMixin:
    """Needs the connection, clock and transaction helpers of :class:`IamDb`."""

    _db: sqlite3.Connection
    _clock: Callable[[], float]

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def _read(self, sql: str, args: Sequence[object] = ()) -> list[Any]:
        raise NotImplementedError

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
            (p.name, p.max_sandboxes, milli(p.max_cpu), p.max_memory_mb, now),
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
        with self._write() as db:
            return self._admit_each(db, batch)

    def admit_and_append(
        self, admissions: Sequence[Admission], events: Sequence[AuditEvent]
    ) -> tuple[list[bool | Exception], list[AuditEvent]]:
        """:meth:`admit_many` and ``append_audit_many`` in one transaction (one disk sync)."""
        with self._write() as db:
            verdicts = self._admit_each(db, admissions)
            now = self._clock()
            entries = audit.append_many(db, events, now=now)
        return verdicts, entries

    def _admit_each(
        self, db: sqlite3.Connection, batch: Sequence[Admission]
    ) -> list[bool | Exception]:
        # No savepoint per request: a request writes one row, after all of its checks, and
        # SQLite undoes a failed statement whole (with what its triggers did). The projects'
        # limits cannot change inside this transaction, so each is read once per batch.
        out: list[bool | Exception] = []
        limits: dict[str, tuple[int, int, int] | None] = {}
        for a in batch:
            try:
                out.append(self._admit_one(db, a, limits))
            except Exception as exc:
                out.append(exc)
        return out

    def _admit_one(
        self, db: sqlite3.Connection, a: Admission, limits: dict[str, tuple[int, int, int] | None]
    ) -> bool:
        cpu_milli = check_admission(a)
        chain = []
        for level in projects.ancestors(a.project):
            if level in limits:
                row = limits[level]
            else:
                row = limits[level] = db.execute(
                    "SELECT max_sandboxes, max_cpu_milli, max_memory_mb FROM projects "
                    "WHERE name = ?",
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
            check_quota(level, row, _subtree_usage(db, level), cpu_milli, a.memory_mb)
        db.execute(
            "INSERT INTO allocations VALUES (?, ?, ?, ?, ?, ?)",
            (a.sandbox_id, a.project, edge_of(a.sandbox_id), cpu_milli, a.memory_mb, self._clock()),
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

    def move_allocation(self, old: str, new: str) -> Allocation:
        """Give sandbox ``old``'s allocation to ``new`` (the same sandbox, moved to another
        edge): one row renamed, so the usage never changes. Idempotent. The move is recorded
        (:meth:`settle_moves` tells ``old``'s edge to end it); renaming it back forgets it.

        Raises:
            InvalidArgument: a malformed id.
            NotFound: neither id has an allocation.
            AlreadyExists: both have one.
        """
        check_move(old, new)
        with self._write() as db:
            rows = {str(r[0]): _alloc(r) for r in db.execute(
                f"{_ALLOC_SELECT} WHERE sandbox_id IN (?, ?)", (old, new)).fetchall()}  # fmt: skip
            if old in rows and new in rows:
                raise AlreadyExists(f"sandboxes {old} and {new} both hold an allocation")
            db.execute("DELETE FROM moves WHERE old = ? AND new = ?", (new, old))  # undone
            if new in rows:
                return rows[new]
            if old not in rows:
                raise NotFound(f"sandbox {old} holds no allocation")
            now = self._clock()  # the new edge's reconcile grace covers it as an admission
            db.execute("UPDATE allocations SET sandbox_id = ?, edge_id = ?, created_at = ? "
                       "WHERE sandbox_id = ?", (new, edge_of(new), now, old))  # fmt: skip
            a = rows[old]
            db.execute("INSERT OR REPLACE INTO moves (old, new, edge_id, at, project, cpu_milli, "
                       "memory_mb) VALUES (?, ?, ?, ?, ?, ?, ?)", (old, new, edge_of(old), now,
                       a.project, milli(a.cpu), a.memory_mb))  # fmt: skip
        return replace(a, sandbox_id=new, edge_id=edge_of(new), created_at=now)

    def settle_moves(
        self, edge_id: str, live: Sequence[str], grace_s: float, running: Sequence[str] = ()
    ) -> tuple[list[tuple[str, str]], list[str]]:
        """What ``edge_id`` should do about its ``live`` sandboxes that hold no allocation.

        Returns:
            ``(moved, unallocated)``: ``moved`` pairs ``(id, new id)`` of sandboxes whose
            allocation moved to another edge more than ``grace_s`` ago (the edge ends them as
            moved if paused: the apiserver that moved them did not); ``unallocated``, every
            live id holding no allocation. A moved one ``running`` again (resumed on its own
            edge before the apiserver could end it) gets its allocation back, as the apiserver
            would have done: the new one is then unallocated on its edge; if the new one has
            ended meanwhile, taking the allocation with it, the source is counted again as
            the move counted it (even over a quota lowered since: it runs). Moves older than
            ``grace_s`` whose source is no longer live are forgotten.
        """
        validate_edge_id(edge_id)
        keep = set(live)
        cutoff = self._clock() - grace_s
        held = {str(r[0]) for r in self._read(
            "SELECT sandbox_id FROM allocations WHERE edge_id = ?", (edge_id,))}  # fmt: skip
        moves = {str(r[0]): (str(r[1]), float(r[2])) for r in self._read(
            "SELECT old, new, at FROM moves WHERE edge_id = ?", (edge_id,))}  # fmt: skip
        done = [(o, cutoff) for o, (_, at) in moves.items() if o not in keep and at <= cutoff]
        if done:  # no write (nor its disk sync) on the usual reconcile
            with self._write() as db:
                db.executemany("DELETE FROM moves WHERE old = ? AND at <= ?", done)
        moved, unallocated, back = settled(live, held, moves, cutoff, running)
        for old, new in back:
            try:
                self.move_allocation(new, old)
            except NotFound:  # the new one is gone too, its allocation with it
                if not self._count_again(old, new):
                    continue
            unallocated.remove(old)
        return moved, unallocated

    def _count_again(self, old: str, new: str) -> bool:
        """Give moved sandbox ``old`` (running at home) the allocation its move renamed to
        ``new`` (ended since, freeing it) anew, and forget the move; False if the move row
        predates the amounts (or the project is gone): it then stays unallocated."""
        with self._write() as db:
            row = db.execute("SELECT project, cpu_milli, memory_mb FROM moves "
                             "WHERE old = ? AND new = ?", (old, new)).fetchone()  # fmt: skip
            if row is None or not row[0]:
                return False
            if not db.execute("SELECT 1 FROM projects WHERE name = ?", (row[0],)).fetchone():
                return False
            db.execute("INSERT OR IGNORE INTO allocations VALUES (?, ?, ?, ?, ?, ?)",
                       (old, row[0], edge_of(old), row[1], row[2], self._clock()))  # fmt: skip
            db.execute("DELETE FROM moves WHERE old = ?", (old,))
        return True

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
            count, used_milli, mem = _subtree_usage(self._db, project)
        except sqlite3.Error as e:
            raise Unavailable(f"IAM database read failed: {e}") from e
        return Usage(p, count, used_milli / 1000, mem)

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
            db.execute("DELETE FROM grants WHERE project = ?", (name,))
            db.execute("DELETE FROM projects WHERE name = ?", (name,))
            db.execute("DELETE FROM project_usage WHERE project = ?", (name,))  # all zeros
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


_ALLOC_SELECT = (
    "SELECT sandbox_id, project, edge_id, cpu_milli, memory_mb, created_at FROM allocations"
)


def _subtree_usage(db: sqlite3.Connection, project: str) -> tuple[int, int, int]:
    """(sandboxes, cpu millicores, memory MiB) allocated in ``project`` and beneath it."""
    # The per-project sums the triggers keep (db.py's _USAGE), in two primary key range
    # scans (the project, then everything from "p/" up to "p0"; '0' follows '/').
    row = db.execute(
        "SELECT coalesce(sum(sandboxes), 0), coalesce(sum(cpu_milli), 0), "
        "coalesce(sum(memory_mb), 0) "
        "FROM project_usage WHERE project = ? OR (project >= ? AND project < ?)",
        (project, project + "/", project + "0"),
    ).fetchone()
    return int(row[0]), int(row[1]), int(row[2])


def check_admission(a: Admission) -> int:
    """Validate an admission request (sandbox id, its edge, amounts); return its milli-CPUs."""
    if not is_sandbox_id(a.sandbox_id):
        raise InvalidArgument(f"malformed sandbox id {a.sandbox_id!r}")
    owner = edge_of(a.sandbox_id)
    if a.edge_id and validate_edge_id(a.edge_id) != owner:
        raise InvalidArgument(f"sandbox {a.sandbox_id} belongs to edge {owner}, not {a.edge_id}")
    if a.cpu < 0 or a.memory_mb < 0:
        raise InvalidArgument("cpu and memory_mb must be >= 0")
    return milli(a.cpu)


def check_move(old: str, new: str) -> None:
    for sid in (old, new):
        if not is_sandbox_id(sid):
            raise InvalidArgument(f"malformed sandbox id {sid!r}")
    if old == new:
        raise InvalidArgument("a sandbox moves to a new id")


def check_quota(
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


def _alloc(r: Any) -> Allocation:
    return Allocation(str(r[0]), str(r[1]), str(r[2]), int(r[3]) / 1000, int(r[4]), float(r[5]))


def settled(
    live: Sequence[str],
    held: set[str],
    moves: dict[str, tuple[str, float]],
    cutoff: float,
    running: Sequence[str],
) -> tuple[list[tuple[str, str]], list[str], list[tuple[str, str]]]:
    """:meth:`QuotasMixin.settle_moves`'s answer from the edge's allocations and moves, and
    the moves to give back (their source runs again)."""
    unallocated = [s for s in dict.fromkeys(live) if s not in held]
    due = [(s, moves[s][0]) for s in unallocated if s in moves and moves[s][1] <= cutoff]
    again = set(running)
    return [m for m in due if m[0] not in again], unallocated, [m for m in due if m[0] in again]
