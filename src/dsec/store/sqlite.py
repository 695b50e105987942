"""The embedded state store: one SQLite file in WAL mode, owned by one thread.

Every statement runs on a single worker thread with its own connection, writes inside
``BEGIN IMMEDIATE``; so transactions are serial and the revision counter needs no locking.
The ``changes`` table is the history behind ``range(revision=...)`` and ``watch``; compaction
drops what no revision at or after the compaction point can see. Watchers in this process are
fed after each commit; a lease reaper task deletes the keys of expired leases.

Transactions are committed in groups: those that arrive while a commit is in progress
(its fsync, with ``synchronous=FULL``) are applied together, each in a savepoint of its
own and at a revision of its own, and made durable by one commit: concurrent writers share
the fsync instead of queueing one each. With ``synchronous=NORMAL`` a commit never waits for
the disk (the WAL is fsynced at checkpoints), so a transaction is committed on the event
loop's thread when the connection is free, without the two thread hand-offs (their wake-ups
cost more than the commit); the connection is then shared by both threads under a lock.
When the store thread holds the connection (a lease, a compaction), or the transaction is
large (a range delete, many keys, much data), it is queued to the store thread as with
``FULL``. Both ways go through one commit (:meth:`_commit_queued`, under the lock) and one
settlement on the loop (:meth:`_settle`: committed batches are published, and their
transactions answered, in commit order, whichever thread committed them). One shape skips
even that: a transaction that puts one key under compares of single keys, with nothing to
do when they fail (a trajectory's step), is one autocommitted statement on the loop
(:meth:`_put_alone`), the compares in its ``WHERE``; four statements (``BEGIN``, the
revision, the upsert, ``COMMIT``) were half the cost of recording a call. Should a compare
fail, or another process hold the write lock, nothing is written and the transaction takes
the usual way. Why two threads
commit at all: a commit on the loop saves the hand-offs but blocks every other request for
its duration, which is fine for a small transaction without an fsync and not for an fsync
(``FULL``), a range delete of a long trajectory or a compaction.

The WAL is checkpointed every ``CHECKPOINT_COMMITS`` commits, in both modes, asked for in
one place (:meth:`_committed`) and run on the store thread with the connection to itself:
commits meanwhile wait on the store thread. (On a connection of its own, a checkpoint let
commits go on, but it was then rarely whole, so the WAL seldom started over: it grew to
~20 MiB, and commits to a growing WAL cost more CPU.)

One process should own the file. A second opener (another process, or a second store in
this one) still gets serial, correct transactions, but its live watches see only its own
writes; they see everyone's when they start or resume from a revision.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import secrets
import sqlite3
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from dsec.core.errors import (
    Compacted,
    DsecError,
    Internal,
    InvalidArgument,
    LeaseNotFound,
    StoreUnavailable,
)

from .api import (
    Compare,
    Delete,
    Event,
    EventType,
    KeyValue,
    Op,
    Put,
    RangeResult,
    StoreHelpers,
    Target,
    TxnOp,
    TxnResult,
    WatchBatch,
    check_txn,
    prefix_end,
)
from .hub import WatchHub, group

T = TypeVar("T")
_Queued = tuple[Sequence[Compare], Sequence[TxnOp], Sequence[TxnOp], "asyncio.Future[TxnResult]"]
# (a commit's watch batches, then its transactions' futures and results)
_Settled = tuple[
    list[WatchBatch], list["asyncio.Future[TxnResult]"], list["TxnResult | BaseException"]
]
REAP_INTERVAL_S = 0.1
BUSY_TIMEOUT_S = 5.0
INLINE_MAX_OPS = 16  # (NORMAL: larger transactions are committed on the store thread)
INLINE_MAX_BYTES = 256 * 1024
CHECKPOINT_COMMITS = 200  # (commits between WAL checkpoints, on the store thread)

SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (
  key BLOB PRIMARY KEY, value BLOB NOT NULL, create_rev INTEGER NOT NULL,
  mod_rev INTEGER NOT NULL, version INTEGER NOT NULL, lease INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS kv_lease ON kv (lease) WHERE lease != 0;
CREATE TABLE IF NOT EXISTS changes (
  rev INTEGER NOT NULL, key BLOB NOT NULL, deleted INTEGER NOT NULL, value BLOB NOT NULL,
  create_rev INTEGER NOT NULL, version INTEGER NOT NULL, lease INTEGER NOT NULL,
  PRIMARY KEY (rev, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS changes_key ON changes (key, rev);
CREATE TABLE IF NOT EXISTS leases (id INTEGER PRIMARY KEY, ttl INTEGER NOT NULL,
  expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('rev', 1), ('compact_rev', 0);
"""

# The history row of each put is written by the put's own statement (a trigger: one
# statement per transaction fewer). TEMP: the triggers live in the writing connection only,
# nothing of them is stored in the file, so another binary opening it (which writes its
# history rows itself) is not affected. Deletes write theirs from :meth:`SqliteStore._apply`.
_HISTORY_TRIGGERS = "".join(
    f"CREATE TEMP TRIGGER kv_{event.lower()}_history AFTER {event} ON kv BEGIN "
    "INSERT INTO changes VALUES (NEW.mod_rev, NEW.key, 0, NEW.value, NEW.create_rev, "
    "NEW.version, NEW.lease); END;"
    for event in ("INSERT", "UPDATE")
)

# A statement that writes a key at a revision past the stored one takes the revision (so
# one statement can take it and write: :meth:`SqliteStore._put_alone`); the usual way takes
# it first, and the triggers find nothing to do.
_REVISION_TRIGGERS = "".join(
    f"CREATE TEMP TRIGGER kv_{event.lower()}_rev AFTER {event} ON kv BEGIN UPDATE meta "
    "SET value = NEW.mod_rev WHERE name = 'rev' AND value < NEW.mod_rev; END;"
    for event in ("INSERT", "UPDATE")
)

_KV_COLS = "key, value, create_rev, mod_rev, version, lease"
_SELECT_ONE = f"SELECT {_KV_COLS} FROM kv WHERE key = ?"


@functools.cache
def _upsert(n: int) -> str:
    """One statement putting ``n`` keys (a transaction puts each key at most once):
    insert, or update keeping create_rev and counting version."""
    rows = ", ".join(["(?, ?, ?, ?, 1, ?)"] * n)
    return (
        f"INSERT INTO kv ({_KV_COLS}) VALUES {rows} ON CONFLICT (key) DO UPDATE SET "
        "value = excluded.value, mod_rev = excluded.mod_rev, version = version + 1, "
        "lease = excluded.lease RETURNING key, create_rev, version"
    )


@functools.cache
def _put_alone_sql(tests: tuple[tuple[Target, Op], ...]) -> str:
    """One statement putting one key at the next revision if every compare holds (a
    compare reads one key; a missing key reads 0, or NULL for its value: as Compare.check),
    answering the row written (none: a compare failed)."""
    holds = "".join(
        f" AND {'' if t is Target.VALUE else 'COALESCE('}(SELECT {_COLUMN[t]} FROM kv WHERE "
        f"key = ?){'' if t is Target.VALUE else ', 0)'} {op.value} ?"
        for t, op in tests
    )
    return (
        f"INSERT INTO kv ({_KV_COLS}) SELECT ?, ?, value + 1, value + 1, 1, 0 FROM meta "
        f"WHERE name = 'rev'{holds} ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
        "mod_rev = excluded.mod_rev, version = version + 1, lease = excluded.lease "
        "RETURNING create_rev, mod_rev, version"
    )


def _alone(
    compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp]
) -> Put | None:
    """The put of a transaction that is one :func:`_put_alone_sql` statement (else None)."""
    if failure or len(success) != 1:
        return None
    op = success[0]
    return op if isinstance(op, Put) and not op.lease and _small(compare, success) else None


@functools.cache
def _log_deletes(n: int) -> str:
    """One statement writing the history of ``n`` deletes (one round trip, not ``n``)."""
    return "INSERT INTO changes VALUES " + ", ".join(["(?, ?, 1, x'', 0, 0, 0)"] * n)


@functools.cache
def _next_rev(reads: tuple[Target, ...]) -> str:
    """Take the next revision, reading with it the field each of ``reads`` tests of one
    key (NULL: no such key), one statement."""
    cols = "".join(f", (SELECT {_COLUMN[t]} FROM kv WHERE key = ?)" for t in reads)
    return f"UPDATE meta SET value = value + 1 WHERE name = 'rev' RETURNING value{cols}"


_COLUMN = {
    Target.VALUE: "value",
    Target.VERSION: "version",
    Target.CREATE: "create_rev",
    Target.MOD: "mod_rev",
}


def _kv(row: tuple[Any, ...]) -> KeyValue:
    return KeyValue(bytes(row[0]), bytes(row[1]), row[2], row[3], row[4], row[5])


def _small(compare: Sequence[Compare], *branches: Sequence[TxnOp]) -> bool:
    """Whether a transaction is short enough to commit on the loop's thread (inline mode):
    no range (prefix) compare or delete, few operations, little data."""
    if any(c.prefix for c in compare):
        return False
    if sum(len(b) for b in branches) > INLINE_MAX_OPS:
        return False
    size = 0
    for b in branches:
        for op in b:
            if isinstance(op, Put):
                size += len(op.value)
            elif op.prefix:
                return False
    return size <= INLINE_MAX_BYTES


def _where_range(col: str, start: bytes, prefix: bool) -> tuple[str, list[bytes]]:
    if not prefix:
        return f"{col} = ?", [start]
    end = prefix_end(start)
    if not end:
        return f"{col} >= ?", [start]
    return f"{col} >= ? AND {col} < ?", [start, end]


class SqliteStore(StoreHelpers):
    """Open with :meth:`open`; close with :meth:`aclose`."""

    def __init__(
        self, path: Path, synchronous: str, retain_revisions: int, compact_every_s: float
    ) -> None:
        self._path = path
        self._synchronous = synchronous
        self._retain = retain_revisions
        self._compact_every_s = compact_every_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsec-store")
        # Reads: a connection and thread of their own, so they never wait for a commit's
        # fsync, nor commits for a long range (WAL: a read sees every transaction committed
        # before it began).
        self._read_pool = ThreadPoolExecutor(1, thread_name_prefix="dsec-store-read")
        self._reader: sqlite3.Connection | None = None
        self._db: sqlite3.Connection | None = None
        self._hub = WatchHub()
        self._loop = asyncio.get_running_loop()
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False
        self._pending: list[WatchBatch] = []  # batches of the write under way
        # Committed, to publish and answer on the loop in commit order (under ``_lock``):
        self._outbox: collections.deque[_Settled] = collections.deque()
        self._begun = False  # (the write transaction is begun already: inline mode)
        self._rev = 0  # the store revision inside a write (store thread)
        self._queued: collections.deque[_Queued] = collections.deque()  # txns to commit
        self._kicked = False  # a group is submitted to the store thread and not started
        # NORMAL: transactions commit on the loop's thread when the connection is free.
        self._inline = synchronous == "NORMAL"
        self._lock = threading.Lock()  # (held by whichever thread uses the connection)
        self._commits = 0  # since the last WAL checkpoint
        self._checkpointing = False

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        synchronous: str = "FULL",
        retain_revisions: int = 0,
        compact_every_s: float = 60.0,
    ) -> SqliteStore:
        """Open (or create) the store at ``path``.

        ``retain_revisions`` > 0 turns on automatic compaction: every ``compact_every_s`` the
        history is compacted to the current revision minus ``retain_revisions``.
        """
        if synchronous not in ("FULL", "NORMAL"):
            raise InvalidArgument("synchronous must be FULL or NORMAL")
        if retain_revisions < 0:
            raise InvalidArgument("retain_revisions must be >= 0")
        store = cls(path, synchronous, retain_revisions, compact_every_s)
        await store._run(store._connect)
        store._reaper = asyncio.create_task(store._reap())
        return store

    def _connect(self) -> None:
        # (check_same_thread off: in inline mode the loop's thread commits on it too, one
        # thread at a time under ``_lock``)
        # (inline: no busy wait in SQLite, which would block the loop while another
        # process writes; :meth:`_begin` waits on the store thread and gives up on the loop)
        db = sqlite3.connect(
            self._path,
            isolation_level=None,
            timeout=0.0 if self._inline else BUSY_TIMEOUT_S,
            check_same_thread=False,
        )
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={self._synchronous}")
        db.execute("PRAGMA wal_autocheckpoint=0")  # (:meth:`_checkpoint` does them)
        db.executescript(SCHEMA + _HISTORY_TRIGGERS + _REVISION_TRIGGERS)
        self._db = db

    def _reading(self) -> sqlite3.Connection:
        if self._reader is None:
            self._reader = sqlite3.connect(self._path, isolation_level=None, timeout=5.0)
        return self._reader

    def _read_one(self, key: bytes) -> KeyValue | None:
        # fetchall: run the statement to its end, so no read transaction stays open (it
        # would keep WAL checkpoints from restarting the log).
        rows = self._reading().execute(_SELECT_ONE, (key,))
        found = rows.fetchall()
        return _kv(found[0]) if found else None

    async def _run(self, fn: Callable[..., T], *args: Any, reader: bool = False) -> T:
        if self._closed:
            raise StoreUnavailable("the store is closed")
        try:
            if reader:
                return await self._loop.run_in_executor(self._read_pool, fn, *args)
            return await self._loop.run_in_executor(self._pool, self._locked, fn, *args)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        """(On the store thread: ``fn`` with the write connection to itself; what it
        committed is published on the loop, in commit order.)"""
        with self._lock:
            try:
                return fn(*args)
            finally:
                if self._pending:
                    self._outbox.append((self._pending, [], []))
                    self._pending = []
                    self._loop.call_soon_threadsafe(self._settle)

    def _committed(self) -> None:
        """(Under ``_lock``, after each commit) every ``CHECKPOINT_COMMITS``, copy the WAL into
        the database on the store thread, so the next commit starts it over."""
        self._commits += 1
        if self._commits >= CHECKPOINT_COMMITS and not self._checkpointing and not self._closed:
            self._commits, self._checkpointing = 0, True
            self._pool.submit(self._locked, self._checkpoint)

    def _checkpoint(self) -> None:
        """(On the store thread, under ``_lock``: no commit runs meanwhile, so the copy is
        whole and the next commit restarts the WAL.)"""
        try:
            if self._db is not None:
                self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error:
            pass  # (the next one copies what this one did not)
        finally:
            self._checkpointing = False

    # all of the below runs on the store thread

    def _meta(self, name: str, db: sqlite3.Connection | None = None) -> int:
        db = db or self._db
        assert db is not None
        # (fetchall: a statement left unfinished keeps its connection's read snapshot, and
        # so the WAL from starting over after a checkpoint on another connection)
        rows = db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchall()
        return int(rows[0][0])

    def _write(
        self, body: Callable[[sqlite3.Connection, bool], T], compare: Sequence[Compare] = ()
    ) -> T:
        """Run ``body`` in one write transaction. The store revision is read once at its
        start (``self._rev``; :meth:`_apply` advances it), and with it the keys ``compare``
        (single keys) tests: ``body`` gets whether they all hold."""
        db = self._db
        if db is None:
            raise StoreUnavailable("the store is closed")
        if not self._begun:
            self._begin(db, wait=True)
        self._begun = False
        try:
            # (one statement for the usual write, one revision: read the revision and take
            # the next; written again only if the write took none, or several)
            row = db.execute(_next_rev(tuple(c.target for c in compare)), [c.key for c in compare])
            rev, *read = row.fetchall()[0]
            self._rev = start = int(rev) - 1
            out = body(db, all(c.check(v) for c, v in zip(compare, read, strict=True)))
            if self._rev != start + 1:
                db.execute("UPDATE meta SET value = ? WHERE name = 'rev'", (self._rev,))
            db.execute("COMMIT")
        except BaseException:
            self._pending.clear()
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        self._committed()
        return out

    def _begin(self, db: sqlite3.Connection, *, wait: bool) -> bool:
        """``BEGIN IMMEDIATE``; False if another process holds the write lock and not
        ``wait`` (the loop's thread never waits for it), else wait up to BUSY_TIMEOUT_S."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                db.execute("BEGIN IMMEDIATE")
                return True
            except sqlite3.OperationalError as exc:
                busy = "locked" in str(exc) or "busy" in str(exc)
                if busy and not wait:
                    return False
                if not busy or not self._inline or time.monotonic() > deadline:
                    raise
            time.sleep(0.002)

    def _get(self, key: bytes) -> KeyValue | None:
        assert self._db is not None
        rows = self._db.execute(f"SELECT {_KV_COLS} FROM kv WHERE key = ?", (key,)).fetchall()
        return _kv(rows[0]) if rows else None

    def _range(self, prefix: bytes, revision: int, limit: int, start: bytes) -> RangeResult:
        """(On the reading thread: a long range never holds up commits. Its transaction
        reads one snapshot, the revision and the rows alike.)"""
        db = self._reading()
        db.execute("BEGIN")
        try:
            now = self._meta("rev", db)
            where, args = _where_range("key", prefix, True)
            if start > prefix:
                where, args = f"{where} AND key >= ?", [*args, start]
            if revision and revision != now:
                if revision < (compact := self._meta("compact_rev", db)):
                    raise Compacted(f"revision {revision} is compacted", compact)
                if revision > now:
                    raise InvalidArgument(f"revision {revision} is in the future (now {now})")
                sql = (
                    f"SELECT c.key, c.value, c.create_rev, c.rev, c.version, c.lease "
                    f"FROM changes c WHERE {where.replace('key', 'c.key')} AND c.deleted = 0 "
                    f"AND c.rev = (SELECT MAX(rev) FROM changes d WHERE d.key = c.key "
                    f"AND d.rev <= ?) ORDER BY c.key"
                )
                rows = db.execute(sql, [*args, revision]).fetchall()
            else:
                rows = db.execute(
                    f"SELECT {_KV_COLS} FROM kv WHERE {where} ORDER BY key", args
                ).fetchall()
        finally:
            db.execute("COMMIT")
        more = limit > 0 and len(rows) > limit
        kvs = tuple(_kv(r) for r in (rows[:limit] if more else rows))
        return RangeResult(kvs, revision or now, more, len(rows))

    def _covered(self, db: sqlite3.Connection, c: Compare) -> list[KeyValue]:
        if not c.prefix:
            return [_kv(r) for r in db.execute(_SELECT_ONE, (c.key,)).fetchall()]
        where, args = _where_range("key", c.key, c.prefix)
        return [_kv(r) for r in db.execute(f"SELECT {_KV_COLS} FROM kv WHERE {where}", args)]

    def _apply(self, db: sqlite3.Connection, ops: Sequence[TxnOp]) -> tuple[int, list[int]]:
        """Apply ``ops`` at the next revision (inside :meth:`_write`); returns the store
        revision after and deletions."""
        rev = self._rev + 1
        changed: list[Event] = []
        deleted: list[int] = []
        puts: list[Put] = []
        for op in ops:
            if isinstance(op, Put):
                if (
                    op.lease
                    and not db.execute("SELECT 1 FROM leases WHERE id = ?", (op.lease,)).fetchall()
                ):
                    raise LeaseNotFound(f"lease {op.lease:x} not found")
                puts.append(op)
            else:
                where, args = _where_range("key", op.key, op.prefix)
                gone = [bytes(r[0]) for r in db.execute(f"SELECT key FROM kv WHERE {where}", args)]
                db.execute(f"DELETE FROM kv WHERE {where}", args)
                changed.extend(Event(EventType.DELETE, KeyValue(k, b"", 0, rev, 0)) for k in gone)
                deleted.append(len(gone))
        if changed:  # (the deletes' history; the puts' is written by their statement)
            rows = [(rev, e.kv.key) for e in changed]
            if len(rows) <= INLINE_MAX_OPS:
                db.execute(_log_deletes(len(rows)), [v for r in rows for v in r])
            else:
                db.executemany(_log_deletes(1), rows)
        if puts:  # (after the deletes: check_txn allows no key both put and deleted)
            row: list[Any] = []
            for op in puts:
                row += (op.key, op.value, rev, rev, op.lease)
            stored = {bytes(k): (c, v) for k, c, v in db.execute(_upsert(len(puts)), row)}
            for op in puts:
                create, version = stored[op.key]
                kv = KeyValue(op.key, op.value, create, rev, version, op.lease)
                changed.append(Event(EventType.PUT, kv))
        if not changed:
            return rev - 1, deleted
        if len(changed) > 1:
            changed.sort(key=lambda e: e.kv.key)
        self._rev = rev
        self._pending.append(WatchBatch(rev, tuple(changed)))
        return rev, deleted

    def _txn_group(self) -> None:
        """(On the store thread) commit every queued transaction in one write (see the
        module docstring); publish and settle them in one hand-off back to the loop."""
        self._kicked = False  # (before draining: a txn queued after this is submitted again)
        with self._lock:
            committed = self._commit_queued()
        if committed:
            self._loop.call_soon_threadsafe(self._settle)

    def _commit_queued(self) -> bool:
        """Commit every queued transaction in one write (under ``_lock``) and put it in the
        outbox; False if none was queued."""
        items: list[_Queued] = []
        while self._queued:
            items.append(self._queued.popleft())
        if not items:
            return False  # an earlier call committed them
        out: list[TxnResult | BaseException] = []

        # (alone and with single-key compares: they are read with the revision)
        alone = len(items) == 1 and not any(c.prefix for c in items[0][0])

        def one(db: sqlite3.Connection, item: _Queued, held: bool | None = None) -> TxnResult:
            compare, success, failure, _ = item
            ok = all(c.holds(self._covered(db, c)) for c in compare) if held is None else held
            rev, deleted = self._apply(db, success if ok else failure)
            return TxnResult(ok, rev, tuple(deleted))

        def body(db: sqlite3.Connection, held: bool) -> None:
            if len(items) == 1:  # (alone: a failure rolls back the whole write)
                out.append(one(db, items[0], held if alone else None))
                return
            for item in items:
                published, rev = len(self._pending), self._rev
                db.execute("SAVEPOINT txn")
                try:
                    out.append(one(db, item))
                except (DsecError, sqlite3.Error) as exc:
                    db.execute("ROLLBACK TO txn")
                    del self._pending[published:]
                    self._rev = rev
                    out.append(exc)
                db.execute("RELEASE txn")

        try:
            self._write(body, items[0][0] if alone else ())
        except BaseException as exc:
            out = [exc] * len(items)
        self._outbox.append((self._pending, [q[3] for q in items], out))
        self._pending = []
        return True

    def _settle(self) -> None:
        """(On the loop) publish what was committed and answer its transactions, in commit
        order whichever thread committed it: watchers see a commit's changes before its
        writers' txns return, and never a later revision before an earlier one."""
        while self._outbox:
            published, futs, out = self._outbox.popleft()
            for batch in published:
                self._hub.publish(batch)
            for fut, res in zip(futs, out, strict=True):
                if fut.done():
                    continue
                if isinstance(res, TxnResult):
                    fut.set_result(res)
                else:
                    fut.set_exception(self._translate(res))

    def _translate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, DsecError):
            return exc
        if isinstance(exc, sqlite3.OperationalError):
            return StoreUnavailable(f"sqlite store {self._path}: {exc}")
        if isinstance(exc, sqlite3.Error):
            return Internal(f"sqlite store {self._path}: {exc}")
        return exc

    def _grant(self, ttl: int) -> int:
        lease = secrets.randbits(62) + 1
        self._write(
            lambda db, _: db.execute(
                "INSERT INTO leases VALUES (?, ?, ?)", (lease, ttl, time.time() + ttl)
            )
        )
        return lease

    def _keepalive(self, lease: int) -> int:
        def body(db: sqlite3.Connection, _: bool) -> int:
            rows = db.execute("SELECT ttl FROM leases WHERE id = ?", (lease,)).fetchall()
            row = rows[0] if rows else None
            if row is None:
                raise LeaseNotFound(f"lease {lease:x} not found")
            db.execute(
                "UPDATE leases SET expires_at = ? WHERE id = ?", (time.time() + row[0], lease)
            )
            return int(row[0])

        return self._write(body)

    def _revoke(self, lease: int, *, missing_ok: bool = False) -> None:
        def body(db: sqlite3.Connection, _: bool) -> None:
            if db.execute("DELETE FROM leases WHERE id = ?", (lease,)).rowcount == 0:
                if missing_ok:
                    return
                raise LeaseNotFound(f"lease {lease:x} not found")
            keys = [bytes(r[0]) for r in db.execute("SELECT key FROM kv WHERE lease = ?", (lease,))]
            self._apply(db, [Delete(k) for k in keys])

        self._write(body)

    def _expired(self) -> list[int]:
        assert self._db is not None
        rows = self._db.execute("SELECT id FROM leases WHERE expires_at <= ?", (time.time(),))
        return [int(r[0]) for r in rows]

    def _compact(self, revision: int) -> None:
        def body(db: sqlite3.Connection, _: bool) -> None:
            now, compact = self._meta("rev"), self._meta("compact_rev")
            if revision <= compact:
                raise Compacted(f"revision {revision} is already compacted", compact)
            if revision > now:
                raise InvalidArgument(f"revision {revision} is in the future (now {now})")
            db.execute(
                "DELETE FROM changes WHERE rev < ? AND (deleted = 1 OR rev < (SELECT MAX(rev) "
                "FROM changes d WHERE d.key = changes.key AND d.rev <= ?))",
                (revision, revision),
            )
            db.execute("UPDATE meta SET value = ? WHERE name = 'compact_rev'", (revision,))

        self._write(body)

    def _history(self, prefix: bytes, start: int) -> tuple[int, list[WatchBatch]]:
        assert self._db is not None
        now = self._meta("rev")
        if start <= 0:
            return now, []
        if start < (compact := self._meta("compact_rev")):
            raise Compacted(f"watch from {start}: history is compacted", compact)
        where, args = _where_range("key", prefix, True)
        rows = self._db.execute(
            f"SELECT rev, key, deleted, value, create_rev, version, lease FROM changes "
            f"WHERE rev >= ? AND {where} ORDER BY rev, key",
            [start, *args],
        ).fetchall()
        pairs: list[tuple[int, Event]] = []
        for rev, key, dele, value, create, version, lease in rows:
            if dele:
                ev = Event(EventType.DELETE, KeyValue(bytes(key), b"", 0, rev, 0))
            else:
                ev = Event(
                    EventType.PUT, KeyValue(bytes(key), bytes(value), create, rev, version, lease)
                )
            pairs.append((rev, ev))
        return now, group(pairs)

    # the async interface

    async def get(self, key: bytes) -> KeyValue | None:
        return await self._run(self._read_one, key, reader=True)

    async def range(
        self, prefix: bytes, *, revision: int = 0, limit: int = 0, start: bytes = b""
    ) -> RangeResult:
        return await self._run(self._range, prefix, revision, limit, start, reader=True)

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
    ) -> TxnResult:
        check_txn(compare, success, failure)
        if self._closed:
            raise StoreUnavailable("the store is closed")
        if self._inline and not self._queued and (op := _alone(compare, success, failure)):
            done = self._put_here(compare, op)
            if done is not None:
                return done
        fut: asyncio.Future[TxnResult] = self._loop.create_future()
        self._queued.append((compare, success, failure, fut))
        # (committed here: ``fut`` is settled and returns without a pass of the loop, as
        # with the memory store)
        here = self._inline and _small(compare, success, failure) and self._commit_here()
        if not here and not self._kicked:
            # (not awaited: the group settles every future of the queue, this one included;
            # one hand-off back to the loop per commit instead of one per transaction, and
            # none submitted while a submitted group has not started draining the queue)
            self._kicked = True
            self._pool.submit(self._txn_group)
        return await fut

    def _put_here(self, compare: Sequence[Compare], op: Put) -> TxnResult | None:
        """(Inline mode, on the loop) :meth:`_put_alone` if the connection is free."""
        if self._db is None or not self._lock.acquire(blocking=False):
            return None
        try:
            res = self._put_alone(self._db, compare, op)
        finally:
            self._lock.release()
        if res is not None:
            self._settle()
        return res

    def _put_alone(
        self, db: sqlite3.Connection, compare: Sequence[Compare], op: Put
    ) -> TxnResult | None:
        """(Under ``_lock``) put ``op`` in one autocommitted statement if ``compare`` holds;
        None: nothing was written (a compare failed, the write lock is another process's,
        or an error the usual way will meet and report)."""
        if db.in_transaction:
            return None
        args: list[Any] = [op.key, op.value]
        for c in compare:
            args += (c.key, c.operand)
        try:
            rows = db.execute(_put_alone_sql(tuple((c.target, c.op) for c in compare)), args)
            written = rows.fetchall()
        except sqlite3.Error:
            return None
        if not written:
            return None
        create, rev, version = written[0]
        kv = KeyValue(op.key, op.value, create, rev, version)
        self._outbox.append(([WatchBatch(rev, (Event(EventType.PUT, kv),))], [], []))
        self._committed()
        return TxnResult(True, rev)

    def _commit_here(self) -> bool:
        """(Inline mode, on the loop) commit the queue now if the connection is free and
        the write lock can be had without waiting; False: left to the store thread."""
        if self._db is None or not self._lock.acquire(blocking=False):
            return False
        try:
            if not self._queued:  # (a group on the store thread took it already)
                return True
            try:
                self._begun = self._begin(self._db, wait=False)
            except sqlite3.Error:
                self._begun = False
            if not self._begun:
                return False
            self._commit_queued()
        finally:
            self._begun = False
            self._lock.release()
        self._settle()
        return True

    async def lease_grant(self, ttl_s: int) -> int:
        if ttl_s <= 0:
            raise InvalidArgument("a lease needs a positive TTL")
        return await self._run(self._grant, ttl_s)

    async def lease_keepalive(self, lease: int) -> int:
        return await self._run(self._keepalive, lease)

    async def lease_revoke(self, lease: int) -> None:
        await self._run(self._revoke, lease)

    async def compact(self, revision: int) -> None:
        await self._run(self._compact, revision)

    async def _history_async(self, prefix: bytes, start: int) -> tuple[int, list[WatchBatch]]:
        return await self._run(self._history, prefix, start)

    def watch(self, prefix: bytes, *, start_revision: int) -> AsyncGenerator[WatchBatch, None]:
        return self._hub.stream(prefix, start_revision, self._history_async)

    def _auto_compact(self) -> None:
        """(Under ``_lock``, from :meth:`_run`.)"""
        target = self._meta("rev") - self._retain
        if target > self._meta("compact_rev"):
            self._compact(target)

    async def _reap(self) -> None:
        next_compact = time.monotonic() + self._compact_every_s
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                for lease in await self._run(self._expired):
                    await self._run(lambda lease=lease: self._revoke(lease, missing_ok=True))
                if self._retain and time.monotonic() >= next_compact:
                    next_compact = time.monotonic() + self._compact_every_s
                    await self._run(self._auto_compact)
            except StoreUnavailable:
                continue

    async def aclose(self) -> None:
        if self._closed:
            return
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self._hub.close()
        db, self._db = self._db, None
        if db is not None:
            await self._loop.run_in_executor(self._pool, self._locked, db.close)
        reader, self._reader = self._reader, None
        if reader is not None:
            await self._loop.run_in_executor(self._read_pool, reader.close)
        self._closed = True
        self._pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)
