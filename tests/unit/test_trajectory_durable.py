"""A recorded call is answered only once its step is committed (``FULL``: the commit
includes the WAL's fsync, and runs on the store thread, never on the event loop).

The SQLite connection that writes is wrapped so that each ``COMMIT`` is seen (and, for
``FULL``, held until the test lets it finish): a call answered before its commit returned
(say, an append left to a background task), a commit made without ``synchronous=FULL``, or
one with its fsync made on the loop's thread fails these tests.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from dsec.apiserver import app as apiserver_app
from dsec.apiserver import relay
from dsec.apiserver import trajectory_calls as traj
from dsec.apiserver.auth import Principal
from dsec.apiserver.context import Ctx
from dsec.obs import Metrics
from dsec.store.sqlite import SqliteStore
from dsec.trajectory.blobs import FileBlobStore
from dsec.trajectory.log import TrajectoryLog
from tests.unit.servekit import serving
from tests.waits import auntil

SBX = "sbx-durable-test"


class _Watched:
    """The store's write connection, with every commit noted (thread, order) and, while
    ``hold`` is clear, held before it runs: a COMMIT, or a write outside a transaction (an
    autocommitted statement: its rows are fetched, and so it is committed, right after)."""

    def __init__(self, db: sqlite3.Connection, events: list[str]) -> None:
        self._db = db
        self.events = events
        self.hold = threading.Event()
        self.hold.set()
        self.threads: list[int] = []

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql == "COMMIT" or (sql.startswith("INSERT") and not self._db.in_transaction):
            self.hold.wait(10)
            self.threads.append(threading.get_ident())
            cur = self._db.execute(sql, *args)
            self.events.append("committed")
            return cur
        return self._db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


@pytest_asyncio.fixture(params=["FULL", "NORMAL"])
async def env(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Ctx, _Watched, str]]:
    sync = str(request.param)
    store = await SqliteStore.open(tmp_path / "log.db", synchronous=sync)
    tlog = TrajectoryLog(store, FileBlobStore(tmp_path / "blobs"), default_quota_bytes=1 << 30)
    t, _ = await tlog.open("p", "run/durable", spec={})
    await tlog.bind(t.id, SBX)
    events: list[str] = []
    assert store._db is not None
    watched = _Watched(store._db, events)
    monkeypatch.setattr(store, "_db", watched)

    async def ran(*args: Any, **kwargs: Any) -> relay.Reply:
        events.append("ran")
        return relay.Reply({"exit_code": 0}, b"out", b"", [], False)

    monkeypatch.setattr(relay, "call", ran)
    c = Ctx(upstream=None, auth=None, metrics=Metrics("test"), components={}, trajectories=tlog)  # type: ignore[arg-type]
    yield c, watched, sync
    watched.hold.set()
    await tlog.aclose()
    await store.aclose()


async def _call(c: Ctx, cmd: str) -> relay.Reply:
    p = Principal("u", "p", "member", "k")
    return await traj.call(make_mocked_request("POST", "/"), c, p, SBX, {"op": "exec", "cmd": cmd})


def _steps_in_file(path: Path) -> int:
    """Steps another connection reads from the file (not this store's cache)."""
    db = sqlite3.connect(path)
    try:
        sql = "SELECT COUNT(*) FROM kv WHERE instr(key, CAST('/s/' AS BLOB)) > 0"
        return int(db.execute(sql).fetchone()[0])
    finally:
        db.close()


@pytest.mark.asyncio
async def test_a_recorded_call_is_answered_after_its_commit(
    env: tuple[Ctx, _Watched, str], tmp_path: Path
) -> None:
    c, watched, sync = env
    level = watched.execute("PRAGMA synchronous").fetchone()[0]
    assert level == (2 if sync == "FULL" else 1), f"synchronous={level} with {sync}"
    for i in range(3):  # (the first looks the binding up; the next record from the cache)
        await _call(c, f"echo {i}")
        watched.events.append("answered")
    assert watched.events == ["ran", "committed", "answered"] * 3, watched.events
    assert _steps_in_file(tmp_path / "log.db") == 3, "the steps are in the file"
    loop_thread = threading.get_ident()
    if sync == "FULL":  # (an fsync must never block the loop)
        assert loop_thread not in watched.threads
    else:  # (NORMAL: a small commit has no fsync and is made on the loop)
        assert loop_thread in watched.threads


@pytest.mark.asyncio
async def test_the_answer_waits_while_the_commit_is_held(
    env: tuple[Ctx, _Watched, str],
) -> None:
    """FULL: the COMMIT (with its fsync) is held on the store thread; NORMAL: the write
    connection is held (as by a WAL checkpoint), so the commit waits on the store thread.
    Either way the call must not be answered until the commit returned."""
    c, watched, sync = env
    tlog = c.trajectories
    assert tlog is not None
    store = tlog.store
    assert isinstance(store, SqliteStore)
    await _call(c, "echo warm")  # (binding looked up, record cached)
    if sync == "FULL":
        watched.hold.clear()
    else:
        assert store._lock.acquire(timeout=5)
    try:
        call = asyncio.ensure_future(_call(c, "echo held"))
        # until it ran (its step is held) or answered (wrongly)
        await auntil(lambda: watched.events[-1] == "ran" or call.done(), "the call ran")
        await asyncio.sleep(0.2)  # (time for a wrong answer to come)
        assert watched.events[-1] == "ran", watched.events
        assert not call.done(), "answered before its step's commit returned"
    finally:
        if sync == "FULL":
            watched.hold.set()
        else:
            store._lock.release()
    await asyncio.wait_for(call, 10)
    assert watched.events[-2:] == ["ran", "committed"]


@pytest.mark.asyncio
async def test_a_call_whose_client_went_away_is_still_recorded(
    env: tuple[Ctx, _Watched, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client closes its connection while the call runs: the apiserver's runner does
    not cancel the handler (no task shields the call), so the call that ran is recorded.
    Cancelling handlers on a lost connection (aiohttp's ``handler_cancellation=True``)
    cancels the call at the edge's answer and fails this test."""
    c, watched, _ = env
    running, release = asyncio.Event(), asyncio.Event()

    async def slow(*args: Any, **kwargs: Any) -> relay.Reply:
        running.set()
        await release.wait()
        watched.events.append("ran")
        return relay.Reply({"exit_code": 0}, b"late", b"", [], False)

    monkeypatch.setattr(relay, "call", slow)
    p = Principal("u", "p", "member", "k")

    requests: list[web.Request] = []

    async def handler(request: web.Request) -> web.Response:
        requests.append(request)
        await traj.call(request, c, p, SBX, {"op": "exec", "cmd": "echo late"})
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/", handler)
    async with serving(apiserver_app.runner(app)) as port:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
            await asyncio.wait_for(running.wait(), 5)
            writer.close()  # (the client goes away mid-call)
            await writer.wait_closed()
            for _ in range(500):  # (until the server saw the connection lost)
                if requests[0].transport is None:
                    break
                await asyncio.sleep(0.01)
            assert requests[0].transport is None, "the server did not see the client go"
            release.set()
            tlog = c.trajectories
            assert tlog is not None
            t = await tlog.for_sandbox(SBX)
            assert t is not None
            for _ in range(500):  # (FULL: the store thread notes its commit after it)
                if (await tlog.get(t.id)).steps and "committed" in watched.events:
                    break
                await asyncio.sleep(0.01)
            assert watched.events == ["ran", "committed"], watched.events
            step = await tlog.step(t.id, 0)
            assert step is not None
            assert step.result["stdout"] == "bGF0ZQ==", step  # (b"late")
        finally:
            release.set()
