"""The trajectory log checks on the in-memory and SQLite state stores (etcd:
tests/integration/test_trajectory_etcd.py), and the canonical form of requests."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core.errors import InvalidArgument
from dsec.store.api import KeyValue
from dsec.store.etcd import EtcdStore
from dsec.store.memory import MemoryStore
from dsec.store.sqlite import SqliteStore
from dsec.testing.trajectory_checks import CHECKS
from dsec.trajectory.blobs import FileBlobStore
from dsec.trajectory.canon import canonical, field_at, first_difference
from dsec.trajectory.log import TrajectoryLog, _bytes_by_project
from dsec.trajectory.setup import open_log, open_store


@pytest_asyncio.fixture(params=["memory", "sqlite"])
async def tlog(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TrajectoryLog]:
    if request.param == "memory":
        store: MemoryStore | SqliteStore = MemoryStore()
    else:
        store = await SqliteStore.open(tmp_path / "log.db")
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


def test_usage_sums_decode_only_records_written_since_the_last_sum() -> None:
    def rec(key: bytes, project: str, size: int, rev: int) -> KeyValue:
        return KeyValue(key, json.dumps({"project": project, "bytes": size}).encode(), 1, rev, 1)

    first = (rec(b"t/a", "p", 10, 5), rec(b"t/b", "p/q", 7, 6))
    sums, sized = _bytes_by_project(first, {})
    assert sums == {"p": 10, "p/q": 7}
    # b is unchanged (same mod_revision): its size comes from the last sum, not its value
    idle_b = KeyValue(b"t/b", b"not json", 1, 6, 1)
    sums, sized = _bytes_by_project((rec(b"t/a", "p", 25, 9), idle_b), sized)
    assert sums == {"p": 25, "p/q": 7}
    sums, _ = _bytes_by_project((rec(b"t/b", "p/q", 3, 11),), sized)  # a removed, b written
    assert sums == {"p/q": 3}
