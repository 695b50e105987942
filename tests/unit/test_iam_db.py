"""IamDb: bootstrap, keys, authentication and quota admission, directly on SQLite."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from dsec.core import errors as e
from dsec.core.audit import AuditEvent
from dsec.core.ids import new_sandbox_id, parse_api_key
from dsec.iam import audit as iam_audit
from dsec.iam.audit import AuditQuery
from dsec.iam.db import DEFAULT_PROJECT, Admission, IamDb, Project
from dsec.store.api import StateStore
from dsec.store.memory import MemoryStore
from dsec.testing.iam_sync import SyncKvIam


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def sid(edge: str, n: int) -> str:
    return new_sandbox_id(edge, n.to_bytes(13, "little"))


@pytest.fixture
def clock() -> Clock:
    return Clock()


async def _memory_store() -> StateStore:
    return MemoryStore()


@pytest.fixture(params=["sqlite", "kv"])
def db(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> Iterator[IamDb]:
    """The SQLite tables, and the same API on the StateStore layout (dsec.iam.kv)."""
    if request.param == "sqlite":
        d = IamDb(tmp_path / "iam.db", clock=clock)
    else:
        d = cast(IamDb, SyncKvIam(_memory_store, clock=clock))
    yield d
    d.close()


def _stored_bytes(db: IamDb, tmp_path: Path) -> str:
    if isinstance(db, IamDb):
        return repr(
            sqlite3.connect(tmp_path / "iam.db").execute("SELECT * FROM api_keys").fetchall()
        )
    kv = cast(SyncKvIam, db).kv
    return repr(cast(SyncKvIam, db)._call(kv.store.range(b"")).kvs)


def test_bootstrap_once(db: IamDb, tmp_path: Path) -> None:
    written: list[tuple[str, str]] = []
    assert db.bootstrap(lambda kid, key: written.append((kid, key)))
    assert db.get_project(DEFAULT_PROJECT).max_sandboxes == 1000
    ((key_id, token),) = written
    p = db.authenticate(token)
    assert (p.subject, p.project, p.role, p.key_id) == ("admin", "default", "admin", key_id)
    assert not db.bootstrap(lambda kid, key: written.append((kid, key)))
    assert len(written) == 1
    # Only the hash of the secret is stored.
    raw = _stored_bytes(db, tmp_path)
    assert key_id in raw
    assert parse_api_key(token)[1] not in raw  # the secret may itself contain "_"


def test_bootstrap_failure_commits_nothing(db: IamDb) -> None:
    def fail(key_id: str, key: str) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError):
        db.bootstrap(fail)
    assert db.list_keys() == []
    assert db.bootstrap(lambda kid, key: None)


def test_keys_lifecycle(db: IamDb, clock: Clock) -> None:
    db.put_project(Project("team-a", 10, 4.0, 4096))
    token, rec = db.create_key("alice", "team-a", "member", "laptop")
    assert token.startswith(f"dsk_{rec.key_id}_")
    assert len(rec.key_id) == 12
    assert db.authenticate(token).subject == "alice"
    clock.now += 1
    _, other = db.create_key("bob", "team-a", "viewer", "")
    assert [k.key_id for k in db.list_keys("team-a")] == [rec.key_id, other.key_id]
    assert db.list_keys("nope") == []
    db.revoke_key(rec.key_id)
    db.revoke_key(rec.key_id)  # idempotent
    assert db.get_key(rec.key_id).revoked
    with pytest.raises(e.Unauthenticated):
        db.authenticate(token)
    with pytest.raises(e.NotFound):
        db.revoke_key("zzzzzzzzzzzz")


@pytest.mark.parametrize(
    "token",
    [
        "",
        "garbage",
        "dsk_abcdefabcdef_" + "A" * 43,  # well-formed, unknown id
        "dsk_ABCDEFABCDEF_" + "A" * 43,  # malformed id
    ],
)
def test_authenticate_refuses(db: IamDb, token: str) -> None:
    with pytest.raises(e.Unauthenticated, match="invalid API key"):
        db.authenticate(token)


def test_authenticate_refuses_wrong_secret(db: IamDb) -> None:
    db.put_project(Project("p", 0, 0, 0))
    token, _ = db.create_key("alice", "p", "admin", "")
    wrong = token[:-1] + ("A" if token[-1] != "A" else "B")
    with pytest.raises(e.Unauthenticated):
        db.authenticate(wrong)


def test_create_key_validation(db: IamDb) -> None:
    db.put_project(Project("p", 0, 0, 0))
    with pytest.raises(e.InvalidArgument):
        db.create_key("alice", "p", "root", "")
    with pytest.raises(e.InvalidArgument):
        db.create_key("", "p", "member", "")
    with pytest.raises(e.NotFound):
        db.create_key("alice", "missing", "member", "")


def test_project_validation(db: IamDb) -> None:
    with pytest.raises(e.InvalidArgument):
        db.put_project(Project("Bad Name", 1, 1, 1))
    with pytest.raises(e.InvalidArgument):
        db.put_project(Project("ok", -1, 1, 1))
    assert db.put_project(Project("ok", 1, 0.5, 2)) == Project("ok", 1, 0.5, 2)
    assert db.put_project(Project("ok", 5, 0, 0)).max_sandboxes == 5
    assert [p.name for p in db.list_projects()] == ["ok"]
    with pytest.raises(e.NotFound):
        db.get_project("missing")


def test_admit_counts_sandboxes(db: IamDb) -> None:
    db.put_project(Project("p", 2, 0, 0))
    assert db.admit("p", sid("ab12", 1), 1.0, 512)
    assert not db.admit("p", sid("ab12", 1), 1.0, 512)  # same id again: no-op
    assert db.admit("p", sid("ab12", 2), 1.0, 512)
    with pytest.raises(e.QuotaExceeded, match="max_sandboxes 2"):
        db.admit("p", sid("ab12", 3), 1.0, 512)
    u = db.usage("p")
    assert (u.sandboxes, u.cpu, u.memory_mb) == (2, 2.0, 1024)
    assert db.release(sid("ab12", 1)) is not None
    assert db.release(sid("ab12", 1)) is None  # idempotent
    assert db.admit("p", sid("ab12", 3), 1.0, 512)


def test_admit_cpu_and_memory_limits_are_exact(db: IamDb) -> None:
    db.put_project(Project("p", 0, 1.0, 1000))
    for i in range(10):
        db.admit("p", sid("ab12", i), 0.1, 100)  # ten times 0.1 is exactly 1.0 here
    with pytest.raises(e.QuotaExceeded, match="max_cpu 1"):
        db.admit("p", sid("ab12", 99), 0.1, 0)
    db.put_project(Project("p", 0, 0, 1000))
    with pytest.raises(e.QuotaExceeded, match="max_memory_mb 1000"):
        db.admit("p", sid("ab12", 99), 0.1, 1)
    assert db.usage("p").cpu == pytest.approx(1.0)


def test_admit_validation(db: IamDb) -> None:
    db.put_project(Project("p", 0, 0, 0))
    db.put_project(Project("q", 0, 0, 0))
    with pytest.raises(e.NotFound):
        db.admit("missing", sid("ab12", 1), 1, 1)
    with pytest.raises(e.InvalidArgument):
        db.admit("p", "sbx-nope", 1, 1)
    with pytest.raises(e.InvalidArgument):
        db.admit("p", sid("ab12", 1), 1, 1, edge_id="cd34")
    with pytest.raises(e.InvalidArgument):
        db.admit("p", sid("ab12", 1), -1, 1)
    db.admit("p", sid("ab12", 1), 1, 1, edge_id="ab12")
    with pytest.raises(e.AlreadyExists):
        db.admit("q", sid("ab12", 1), 1, 1)
    assert db.allocations(edge_id="ab12")[0].edge_id == "ab12"


def test_release_by_edge_only_its_own(db: IamDb) -> None:
    db.put_project(Project("p", 0, 0, 0))
    db.admit("p", sid("ab12", 1), 1, 1)
    with pytest.raises(e.PermissionDenied):
        db.release(sid("ab12", 1), edge_id="cd34")
    assert db.release(sid("ab12", 1), edge_id="ab12") is not None


def test_a_moved_sandbox_keeps_its_one_allocation(db: IamDb, clock: Clock) -> None:
    """Resuming on another edge renames the allocation: usage never changes, even at a
    full quota, and the new edge's reconcile grace covers it."""
    db.put_project(Project("p", 1, 0, 0))
    old, new = sid("ab12", 1), sid("cd34", 2)
    db.admit("p", old, 1, 64)
    with pytest.raises(e.QuotaExceeded):
        db.admit("p", new, 1, 64)  # admitting the moved one as a second would not fit
    clock.now += 60
    moved = db.move_allocation(old, new)
    assert (moved.sandbox_id, moved.edge_id, moved.memory_mb) == (new, "cd34", 64)
    assert db.usage("p").sandboxes == 1
    assert {a.sandbox_id for a in db.allocations()} == {new}
    assert db.move_allocation(old, new).sandbox_id == new  # idempotent
    assert db.reconcile("cd34", [], grace_s=30) == []  # young again on its new edge
    assert db.reconcile("ab12", [], grace_s=30) == []
    db.move_allocation(new, old)  # a failed move gives it back
    assert {a.sandbox_id for a in db.allocations()} == {old}
    with pytest.raises(e.NotFound):
        db.move_allocation(sid("ab12", 9), sid("cd34", 9))
    db.put_project(Project("p", 0, 0, 0))
    db.admit("p", new, 1, 64)
    with pytest.raises(e.AlreadyExists):
        db.move_allocation(old, new)
    with pytest.raises(e.InvalidArgument):
        db.move_allocation(old, "nope")
    with pytest.raises(e.InvalidArgument):
        db.move_allocation(old, old)


def test_a_move_the_apiserver_did_not_finish_is_settled_by_the_edges(
    db: IamDb, clock: Clock
) -> None:
    """The iam remembers a renamed allocation: the source edge, still holding the paused
    sandbox after the grace, is told to end it as moved; a renamed-back move is forgotten,
    and so is a finished one once its source is gone."""
    db.put_project(Project("p", 0, 0, 0))
    old, new, other = sid("ab12", 1), sid("cd34", 2), sid("ab12", 3)
    db.admit("p", old, 1, 64)
    db.admit("p", other, 1, 64)
    stray = sid("ab12", 4)  # live on the edge, never admitted
    live = [old, other, stray]
    assert db.settle_moves("ab12", live, grace_s=300) == ([], [stray])
    db.move_allocation(old, new)
    assert db.settle_moves("ab12", live, grace_s=300) == ([], [old, stray])  # young: not yet
    assert db.settle_moves("cd34", [new], grace_s=300) == ([], [])
    clock.now += 301
    assert db.settle_moves("ab12", live, grace_s=300) == ([(old, new)], [old, stray])
    assert db.settle_moves("ab12", [other], grace_s=300) == ([], [])  # ended: forgotten
    assert db.settle_moves("ab12", live, grace_s=300) == ([], [old, stray])
    db.move_allocation(new, old)  # the allocation went back: the move is forgotten at once
    assert db.settle_moves("ab12", live, grace_s=0) == ([], [stray])
    db.move_allocation(old, new)
    db.move_allocation(new, old)
    clock.now += 301
    assert db.settle_moves("ab12", live, grace_s=300) == ([], [stray])
    db.move_allocation(old, new)  # and then it was resumed at home before being ended:
    assert db.settle_moves("ab12", live, grace_s=300, running=[old]) == ([], [old, stray])
    clock.now += 301  # the allocation goes back to it, as the apiserver would have done
    assert db.settle_moves("ab12", live, grace_s=300, running=[old]) == ([], [stray])
    assert {a.sandbox_id for a in db.allocations()} == {old, other}
    assert db.settle_moves("cd34", [new], grace_s=300) == ([], [new])
    with pytest.raises(e.InvalidArgument):
        db.settle_moves("BAD", [], grace_s=0)


def test_a_moved_sandbox_resumed_at_home_after_the_new_one_ended_is_counted_again(
    db: IamDb, clock: Clock
) -> None:
    """Its move renamed the allocation, then the apiserver died; the sandbox was resumed at
    home and the new one ended (freeing the allocation): it is counted again, once, as the
    move counted it."""
    db.put_project(Project("p", 0, 0, 0))
    old, new = sid("ab12", 1), sid("cd34", 2)
    db.admit("p", old, 1.5, 64)
    db.move_allocation(old, new)
    assert db.release(new) is not None  # the new one ended
    assert db.usage("p").sandboxes == 0
    assert db.settle_moves("ab12", [old], grace_s=300, running=[old]) == ([], [old])  # young
    clock.now += 301
    assert db.settle_moves("ab12", [old], grace_s=300, running=[old]) == ([], [])
    [a] = db.allocations()
    assert (a.sandbox_id, a.project, a.cpu, a.memory_mb) == (old, "p", 1.5, 64)
    assert db.settle_moves("ab12", [old], grace_s=300, running=[old]) == ([], [])  # forgotten
    u = db.usage("p")
    assert (u.sandboxes, u.cpu, u.memory_mb) == (1, 1.5, 64)
    assert db.reconcile("ab12", [old], grace_s=0) == []


def test_move_rows_from_before_they_kept_the_allocation_are_read(tmp_path: Path) -> None:
    """A database whose ``moves`` table predates the amounts gets the columns; its rows have
    none, so a source resumed at home after its new sandbox ended stays unallocated."""
    old, new = sid("ab12", 1), sid("cd34", 2)
    raw = sqlite3.connect(tmp_path / "iam.db")
    raw.execute("CREATE TABLE moves (old TEXT PRIMARY KEY, new TEXT NOT NULL, "
                "edge_id TEXT NOT NULL, at REAL NOT NULL)")  # fmt: skip
    raw.execute("INSERT INTO moves VALUES (?, ?, 'ab12', 0)", (old, new))
    raw.commit()
    raw.close()
    db = IamDb(tmp_path / "iam.db", clock=Clock())
    try:
        db.put_project(Project("p", 0, 0, 0))
        assert db.settle_moves("ab12", [old], grace_s=300, running=[old]) == ([], [old])
        assert db.allocations() == []
    finally:
        db.close()
    IamDb(tmp_path / "iam.db").close()  # opened again: the columns are there already


def test_reconcile_drops_dead_allocations_after_grace(db: IamDb, clock: Clock) -> None:
    db.put_project(Project("p", 0, 0, 0))
    for i in range(3):
        db.admit("p", sid("ab12", i), 1, 1)
    db.admit("p", sid("cd34", 9), 1, 1)
    clock.now += 60
    db.admit("p", sid("ab12", 7), 1, 1)  # young: the edge may not know it yet
    gone = db.reconcile("ab12", [sid("ab12", 0)], grace_s=30)
    assert sorted(gone) == sorted([sid("ab12", 1), sid("ab12", 2)])
    left = {a.sandbox_id for a in db.allocations()}
    assert left == {sid("ab12", 0), sid("ab12", 7), sid("cd34", 9)}
    with pytest.raises(e.InvalidArgument):
        db.reconcile("BAD", [], grace_s=0)


def test_two_connections_never_overcommit(tmp_path: Path) -> None:
    """Admission holds across processes/connections: BEGIN IMMEDIATE serializes them."""
    setup = IamDb(tmp_path / "iam.db")
    setup.put_project(Project("p", 50, 0, 0))
    setup.close()
    admitted: list[str] = []
    lock = threading.Lock()

    def worker(offset: int) -> None:
        conn = IamDb(tmp_path / "iam.db")
        try:
            for i in range(40):
                s = sid("ab12", offset * 1000 + i)
                try:
                    conn.admit("p", s, 0.5, 10)
                except e.QuotaExceeded:
                    continue
                with lock:
                    admitted.append(s)
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check = IamDb(tmp_path / "iam.db")
    assert len(admitted) == 50
    assert check.usage("p").sandboxes == 50
    check.close()


def test_admit_many_decides_each_in_order(db: IamDb) -> None:
    db.put_project(Project("p", 2, 0, 0))
    results = db.admit_many(
        [
            Admission("p", sid("ab12", 1), 1, 1),
            Admission("p", "bad id", 1, 1),
            Admission("p", sid("ab12", 1), 1, 1),  # repeat of the first: no-op
            Admission("missing", sid("ab12", 2), 1, 1),
            Admission("p", sid("ab12", 3), 1, 1),
            Admission("p", sid("ab12", 4), 1, 1),  # third sandbox: over the limit
        ]
    )
    assert results[0] is True
    assert isinstance(results[1], e.InvalidArgument)
    assert results[2] is False
    assert isinstance(results[3], e.NotFound)
    assert results[4] is True
    assert isinstance(results[5], e.QuotaExceeded)
    assert {a.sandbox_id for a in db.allocations()} == {sid("ab12", 1), sid("ab12", 3)}


def test_role_grants(db: IamDb) -> None:
    db.bootstrap(lambda kid, key: None)
    assert [(g.project, g.subject, g.role) for g in db.list_grants("admin")] == [
        ("*", "admin", "admin")
    ]
    db.put_project(Project("org", 0, 0, 0))
    db.put_project(Project("org/team", 0, 0, 0))
    db.grant_role("org", "alice", "viewer")
    db.grant_role("org/team", "alice", "admin")
    db.grant_role("org/team", "bob", "member")
    db.grant_role("org", "alice", "member")  # replaces her viewer grant on org
    assert [(g.project, g.role) for g in db.list_grants("alice")] == [
        ("org", "member"),
        ("org/team", "admin"),
    ]
    assert {g.subject for g in db.list_grants(project="org/team")} == {"alice", "bob"}
    db.grant_role("org/team", "bob", "")  # taken away
    assert db.list_grants("bob") == []
    with pytest.raises(e.NotFound):
        db.grant_role("missing", "alice", "member")
    with pytest.raises(e.InvalidArgument):
        db.grant_role("org", "alice", "root")
    with pytest.raises(e.InvalidArgument):
        db.grant_role("org", "", "member")
    db.delete_project("org/team")  # its grants go with it
    assert [g.project for g in db.list_grants("alice")] == ["org"]
    actions = [x.action for x in db.query_audit(AuditQuery(action="role."))]
    assert actions == ["role.grant"] * 4 + ["role.remove"]


def test_a_database_from_before_roles_keeps_its_platform_admin(tmp_path: Path) -> None:
    d = IamDb(tmp_path / "old.db")
    assert d.bootstrap(lambda _k, _t: None)
    raw = sqlite3.connect(tmp_path / "old.db")
    with raw:
        raw.execute("DELETE FROM grants")  # as written by a version without roles
    raw.close()
    assert not d.bootstrap(lambda _k, _t: None)
    assert ("*", "admin", "admin") in {(g.project, g.subject, g.role) for g in d.list_grants()}


def _summed(path: Path) -> dict[str, tuple[int, int, int]]:
    """Usage per project summed from the allocation rows, and as project_usage keeps it."""
    raw = sqlite3.connect(path)
    try:
        rows = raw.execute(
            "SELECT project, count(*), sum(cpu_milli), sum(memory_mb) FROM allocations "
            "GROUP BY project"
        ).fetchall()
        kept = raw.execute("SELECT * FROM project_usage WHERE sandboxes > 0").fetchall()
    finally:
        raw.close()
    from_rows = {r[0]: (r[1], r[2], r[3]) for r in rows}
    assert {r[0]: (r[1], r[2], r[3]) for r in kept} == from_rows
    return from_rows


def test_project_usage_follows_the_allocation_rows(tmp_path: Path, clock: Clock) -> None:
    d = IamDb(tmp_path / "iam.db", clock=clock)
    d.put_project(Project("org", 0, 0, 0))
    d.put_project(Project("org/a", 3, 0, 0))
    d.put_project(Project("org/b", 0, 0, 0))
    for i in range(3):
        d.admit("org/a", sid("ab12", i), 0.5, 10)
    over = Admission("org/a", sid("cd34", 2), 1, 20)  # a fourth in org/a: refused
    d.admit_many([Admission("org/b", sid("cd34", 1), 1, 20), over])
    assert _summed(tmp_path / "iam.db") == {"org/a": (3, 1500, 30), "org/b": (1, 1000, 20)}
    d.release(sid("ab12", 0))
    clock.now += 60
    d.reconcile("cd34", [], grace_s=30)
    assert _summed(tmp_path / "iam.db") == {"org/a": (2, 1000, 20)}
    assert (d.usage("org").sandboxes, d.usage("org").memory_mb) == (2, 20)
    d.put_project(Project("org", 2, 0, 0))  # the parent's quota bounds the subtree
    with pytest.raises(e.QuotaExceeded):
        d.admit("org/b", sid("cd34", 3), 1, 1)
    d.close()


def test_a_database_from_before_project_usage_gets_its_sums(tmp_path: Path) -> None:
    d = IamDb(tmp_path / "old.db")
    d.put_project(Project("p", 3, 0, 0))
    for i in range(2):
        d.admit("p", sid("ab12", i), 0.25, 64)
    d.close()
    raw = sqlite3.connect(tmp_path / "old.db")
    with raw:  # as written by a version without the per-project sums
        for trigger in ("add", "sub", "move"):
            raw.execute(f"DROP TRIGGER project_usage_{trigger}")
        raw.execute("DROP TABLE project_usage")
    raw.close()
    d = IamDb(tmp_path / "old.db")
    assert _summed(tmp_path / "old.db") == {"p": (2, 500, 128)}
    d.admit("p", sid("ab12", 2), 0.25, 64)
    with pytest.raises(e.QuotaExceeded, match="max_sandboxes 3"):
        d.admit("p", sid("ab12", 3), 0.25, 64)
    d.close()
    d = IamDb(tmp_path / "old.db")  # opened again: the sums are not added twice
    assert _summed(tmp_path / "old.db") == {"p": (3, 750, 192)}
    d.close()


def test_admissions_and_audit_entries_commit_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = IamDb(tmp_path / "iam.db")
    d.put_project(Project("p", 1, 0, 0))
    before = d.verify_audit()[0]
    event = AuditEvent(ts=0, actor="admin (key k)", action="sandbox.create", project="p")
    verdicts, entries = d.admit_and_append(
        [Admission("p", sid("ab12", 1), 1, 1), Admission("p", sid("ab12", 2), 1, 1)],
        [event, event],
    )
    assert verdicts[0] is True
    assert isinstance(verdicts[1], e.QuotaExceeded)
    assert [x.seq for x in entries] == [before + 1, before + 2]
    assert entries[0].ts > 0
    assert d.verify_audit() == (before + 2, None, entries[1].hash)

    def broken(*_: object, **__: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(iam_audit, "append_many", broken)
    d.release(sid("ab12", 1))
    with pytest.raises(sqlite3.OperationalError):
        d.admit_and_append([Admission("p", sid("ab12", 3), 1, 1)], [event])
    assert d.allocations() == []  # the admission went with the failed audit entry
    d.close()


def test_on_a_store_a_failed_audit_append_leaves_the_admissions_standing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a StateStore admissions and audit entries commit in separate transactions: when
    the entries fail, the admissions (already committed) still get their verdicts."""
    from dsec.iam.kv import KvIam

    async def run() -> None:
        kv = KvIam(MemoryStore())
        await kv.put_project(Project("p", 1, 0, 0))

        async def broken(events: object) -> list[AuditEvent]:
            raise e.StoreUnavailable("etcd: no leader")

        monkeypatch.setattr(kv, "append_audit_many", broken)
        event = AuditEvent(ts=1.0, actor="admin (key k)", action="sandbox.create")
        verdicts, entries = await kv.admit_and_append(
            [Admission("p", sid("ab12", 1), 1, 1), Admission("p", sid("ab12", 2), 1, 1)],
            [event],
        )
        assert verdicts[0] is True
        assert isinstance(verdicts[1], e.QuotaExceeded)
        assert len(entries) == 1
        assert isinstance(entries[0], e.StoreUnavailable)
        assert [a.sandbox_id for a in await kv.allocations()] == [sid("ab12", 1)]

    asyncio.run(run())


def test_an_admission_writes_no_index_of_allocations_by_project(tmp_path: Path) -> None:
    d = IamDb(tmp_path / "iam.db")
    d.put_project(Project("p", 10, 0, 0))
    d.admit("p", sid("ab12", 1), 1.0, 64)
    d.close()
    raw = sqlite3.connect(tmp_path / "iam.db")  # as a database from before left it
    raw.execute("CREATE INDEX allocations_by_project ON allocations(project, cpu_milli, memory_mb)")
    raw.close()
    d = IamDb(tmp_path / "iam.db")
    try:
        indexes = {
            r[0] for r in d._db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        }
        assert "allocations_by_project" not in indexes  # usage comes from project_usage
        assert "allocations_by_edge" in indexes  # reconcile reads an edge's allocations
        d.admit("p", sid("ab12", 2), 1.0, 64)
        assert d.usage("p").sandboxes == 2
    finally:
        d.close()
