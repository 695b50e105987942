"""The trajectory log checks on the in-memory and SQLite state stores (etcd:
tests/integration/test_trajectory_etcd.py), and the canonical form of requests."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from dsec.core.errors import InvalidArgument
from dsec.store.api import Event, EventType, KeyValue
from dsec.store.etcd import EtcdStore
from dsec.store.memory import MemoryStore
from dsec.store.sqlite import SqliteStore
from dsec.testing.trajectory_checks import CHECKS, step
from dsec.trajectory.blobs import FileBlobStore
from dsec.trajectory.canon import canonical, field_at, first_difference
from dsec.trajectory.log import PREFIX, RECORD_EVERY, Trajectory, TrajectoryLog, _Usage
from dsec.trajectory.setup import open_log, open_store


@pytest_asyncio.fixture(params=["memory", "sqlite", "sqlite-normal"])
async def tlog(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TrajectoryLog]:
    if request.param == "memory":
        store: MemoryStore | SqliteStore = MemoryStore()
    else:
        sync = "NORMAL" if request.param == "sqlite-normal" else "FULL"
        store = await SqliteStore.open(tmp_path / "log.db", synchronous=sync)
    yield TrajectoryLog(store, FileBlobStore(tmp_path / "blobs"))
    await store.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(CHECKS))
async def test_log(tlog: TrajectoryLog, name: str) -> None:
    await CHECKS[name](tlog, f"team/{secrets.token_hex(3)}")


@pytest.mark.asyncio
async def test_sqlite_log_survives_reopen(tmp_path: Path) -> None:
    store = await SqliteStore.open(tmp_path / "log.db")
    tlog = TrajectoryLog(store, FileBlobStore(tmp_path / "blobs"))
    t, _ = await tlog.open("p", "r/1", spec={})
    await CHECKS["record_then_replay"](tlog, "q")
    await store.aclose()
    store = await SqliteStore.open(tmp_path / "log.db")
    tlog = TrajectoryLog(store, FileBlobStore(tmp_path / "blobs"))
    assert (await tlog.get(t.id)).name == "r/1"
    assert len(await tlog.list()) == 2
    await store.aclose()


def test_canonical_ignores_timeout_none_and_key_order() -> None:
    a = canonical({"op": "exec", "cmd": "ls", "timeout": 5, "env": {"B": "2", "A": "1"}})
    b = canonical({"env": {"A": "1", "B": "2"}, "cmd": "ls", "op": "exec", "cwd": None})
    assert a == b
    assert "timeout" not in a


def test_canonical_digests_payloads() -> None:
    a = canonical({"op": "files.write", "path": "/f"}, b"one")
    b = canonical({"op": "files.write", "path": "/f"}, b"two")
    assert a != b
    assert a["payload"]["size"] == 3
    assert a["payload"]["sha256"].startswith("sha256:")
    assert canonical({"op": "exec", "cmd": "x"}, b"") != canonical({"op": "exec", "cmd": "x"})


@pytest.mark.parametrize(
    ("recorded", "actual", "path"),
    [
        ({"cmd": "ls"}, {"cmd": "ls"}, None),
        ({"cmd": "ls"}, {"cmd": "ls -l"}, "cmd"),
        ({"cmd": ["a", "b"]}, {"cmd": ["a", "c"]}, "cmd[1]"),
        ({"cmd": ["a"]}, {"cmd": ["a", "b"]}, "cmd"),
        ({"env": {"A": "1"}}, {"env": {"A": "2"}}, "env.A"),
        ({"op": "exec"}, {"op": "exec", "cwd": "/"}, "cwd"),
        (
            {"payload": {"sha256": "x", "size": 1}},
            {"payload": {"sha256": "y", "size": 1}},
            "payload.sha256",
        ),
        ("a", "b", "."),
    ],
)
def test_first_difference(recorded: object, actual: object, path: str | None) -> None:
    assert first_difference(recorded, actual) == path


def test_field_at() -> None:
    obj = {"cmd": ["a", "b"], "env": {"A": "1"}}
    assert field_at(obj, "cmd[1]") == "b"
    assert field_at(obj, "env.A") == "1"
    assert field_at(obj, "cwd") is None
    assert field_at(obj, "cmd[5]") is None


@pytest.mark.asyncio
async def test_open_store_urls(tmp_path: Path) -> None:
    tlog = await open_log(f"sqlite:{tmp_path / 'a' / 'log.db'}", tmp_path / "b", sync="normal")
    assert isinstance(tlog.store, SqliteStore)
    await tlog.store.aclose()
    etcd = await open_store("etcd:http://127.0.0.1:2379,127.0.0.1:2380")
    assert isinstance(etcd, EtcdStore)
    await etcd.aclose()
    for bad in ("", "sqlite:", "redis:x", "etcd:"):
        with pytest.raises(InvalidArgument):
            await open_store(bad)


def test_usage_takes_the_newest_news_and_decodes_only_what_others_wrote() -> None:
    def ev(key: bytes, value: bytes, rev: int, kind: EventType = EventType.PUT) -> Event:
        return Event(kind, KeyValue(key, value, 1, rev, 1))

    def rec(project: str, size: int) -> bytes:
        return json.dumps({"project": project, "bytes": size}).encode()

    u = _Usage(MemoryStore())
    u.note(b"t/a", 5, "p", 10)
    u.note(b"t/a", 4, "p", 99)  # older than what is known: ignored
    assert u.bytes == {"p": 10}
    # its own write's event (same revision) is not decoded; another's is
    u._seen = {b"t/a": ev(b"t/a", b"not json", 5), b"t/b": ev(b"t/b", rec("p/q", 7), 6)}
    u.fold()
    assert u.bytes == {"p": 10, "p/q": 7}
    assert u.subtree == {"p": 17, "p/q": 7}, "a project's sum holds its subtree's"
    u.note(b"t/a", 9, "p", None)  # removed at 9 ...
    u._seen = {b"t/a": ev(b"t/a", rec("p", 12), 8)}  # ... an older write seen late
    u.fold()
    assert u.bytes == {"p": 0, "p/q": 7}
    u._seen = {b"t/b": ev(b"t/b", b"", 11, EventType.DELETE), b"t/a": ev(b"t/a", rec("p", 3), 12)}
    u.fold()  # a recreated, b removed by another
    assert u.bytes == {"p": 3, "p/q": 0}
    assert u.subtree == {"p": 3, "p/q": 0}


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_usage_is_summed_once_then_follows_every_writer(kind: str, tmp_path: Path) -> None:
    store: MemoryStore | SqliteStore = (
        MemoryStore() if kind == "memory" else await SqliteStore.open(tmp_path / "log.db")
    )
    ranges = 0
    real_range = store.range

    async def counting(prefix: bytes, **kw: Any) -> object:
        nonlocal ranges
        ranges += prefix == PREFIX + b"t/"  # (not the reads of one record's tail)
        return await real_range(prefix, **kw)

    store.range = counting  # type: ignore[assignment,method-assign]
    mine = TrajectoryLog(store, FileBlobStore(tmp_path / "blobs"))
    other = TrajectoryLog(store, FileBlobStore(tmp_path / "blobs"))  # another apiserver
    try:
        a, _ = await mine.open("org/a", "a", spec={})
        b, _ = await other.open("org/b", "b", spec={})
        for i in range(2 * RECORD_EVERY):  # (the records are written at the last step)
            await mine.check_quota("org/a")
            await mine.append(a.id, step(f"a{i}", "x" * i))
            await other.append(b.id, step(f"b{i}", "y" * i))
        for _ in range(100):  # the other's last appends arrive with the watch
            if (
                await mine.usage("org")
                == (await mine.get(a.id)).bytes + (await mine.get(b.id)).bytes
            ):
                break
            await asyncio.sleep(0.01)
        assert await mine.usage("org/b") == (await other.get(b.id)).bytes > 0
        assert ranges == 2, f"{ranges} ranges over every record (one per log object expected)"
        await other.remove(b.id)
        for _ in range(100):
            if await mine.usage("org/b") == 0:
                break
            await asyncio.sleep(0.01)
        assert await mine.usage("org/b") == 0
        assert await mine.usage("org") == (await mine.get(a.id)).bytes
    finally:
        await mine.aclose()
        await store.aclose()


def test_record_encoding_is_the_fields_json_through_appends() -> None:
    """A record's encoding is exactly the compact JSON of its fields in order, fresh,
    appended, or replaced."""
    t = Trajectory(
        id="t1",
        project="a/b",
        name='run "42"/é',
        created_at=1.5,
        updated_at=2.25,
        sandbox_id="sbx-1",
        epoch="e1",
        checkpoints=[{"step": 3, "image": "traj-t1:s3"}],
        divergence={"step": 1, "field": "cmd"},
        spec={"image": "base", "env": {"A": "1"}, "memory_mb": 256},
    )

    def plain(x: Trajectory) -> bytes:
        fields = {k: getattr(x, k) for k in Trajectory.__dataclass_fields__}
        return json.dumps(fields, separators=(",", ":")).encode()

    assert t.encode() == plain(t)
    x = t
    for i in range(3):
        x = x.appended(100 + i, 10.0 + i / 3)
        assert x.encode() == plain(x)
        assert Trajectory.from_json(json.loads(x.encode())) == x
    assert (x.steps, x.bytes, x.cursor, x.mode) == (3, 303, 3, "record")
    y = replace(x, epoch="e2", mode="replay", cursor=0, updated_at=float(10**20))
    assert y.encode() == plain(y)
    assert b'"epoch":"e2"' in y.appended(1, 11.0).encode()
    assert t.encode() == plain(t), "the original keeps its own text"
