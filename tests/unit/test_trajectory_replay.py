"""Replay decisions of the apiserver (``apiserver.trajectory_calls.replay``) on an
in-memory log: match, end of log, and both mismatch policies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import make_mocked_request

from dsec.apiserver.trajectory_calls import HEADERS, Bound, replay
from dsec.core.errors import TrajectoryMismatch
from dsec.store.memory import MemoryStore
from dsec.testing.trajectory_checks import step
from dsec.trajectory.blobs import FileBlobStore
from dsec.trajectory.canon import canonical
from dsec.trajectory.log import TrajectoryLog

SBX = "sbx-replay-test"


@pytest_asyncio.fixture
async def tlog(tmp_path: Path) -> AsyncIterator[TrajectoryLog]:
    store = MemoryStore()
    tlog = TrajectoryLog(store, FileBlobStore(tmp_path / "blobs"))
    t, _ = await tlog.open("p", "run/1", spec={})
    await tlog.bind(t.id, SBX)
    for cmd in ("echo a", "echo b", "echo c"):
        await tlog.append(t.id, step(cmd, cmd[-1]))
    yield tlog
    await store.aclose()


async def _call(tlog: TrajectoryLog, cmd: str) -> tuple[object, dict[str, str]]:
    found = await tlog.lookup(SBX)
    assert found is not None
    request = make_mocked_request("POST", "/")
    got = await replay(request, tlog, Bound(*found), canonical({"op": "exec", "cmd": cmd}))
    return got, request.get(HEADERS, {})


async def _reopen(tlog: TrajectoryLog, on_mismatch: str = "diverge") -> None:
    await tlog.open("p", "run/1", spec={}, on_mismatch=on_mismatch)


@pytest.mark.asyncio
async def test_recording_trajectory_does_not_replay(tlog: TrajectoryLog) -> None:
    got, headers = await _call(tlog, "echo a")
    assert got is None
    assert headers == {}


@pytest.mark.asyncio
async def test_matching_calls_replay_then_the_log_ends(tlog: TrajectoryLog) -> None:
    await _reopen(tlog)
    for n, cmd in enumerate(("echo a", "echo b", "echo c")):
        got, headers = await _call(tlog, cmd)
        assert got is not None
        assert getattr(got, "n") == n  # noqa: B009
        assert headers["X-Dsec-Trajectory-Mode"] == "replayed"
        assert headers["X-Dsec-Trajectory-Step"] == str(n)
    t = await tlog.for_sandbox(SBX)
    assert t is not None
    assert (t.mode, t.cursor, t.replayed) == ("record", 3, 3)
    got, _ = await _call(tlog, "echo d")  # beyond the log: runs for real
    assert got is None


@pytest.mark.asyncio
async def test_timeout_is_not_part_of_the_match(tlog: TrajectoryLog) -> None:
    await _reopen(tlog)
    found = await tlog.lookup(SBX)
    assert found is not None
    req = {"op": "exec", "cmd": "echo a", "timeout": 999}
    got = await replay(make_mocked_request("POST", "/"), tlog, Bound(*found), canonical(req))
    assert got is not None


@pytest.mark.asyncio
async def test_mismatch_with_fail_policy_raises_and_keeps_the_log(tlog: TrajectoryLog) -> None:
    await _reopen(tlog, "fail")
    await _call(tlog, "echo a")
    with pytest.raises(TrajectoryMismatch, match="step 1") as exc_info:
        await _call(tlog, "echo B")
    assert "'echo b'" in str(exc_info.value)
    t = await tlog.for_sandbox(SBX)
    assert t is not None
    assert t.steps == 3
    assert (t.mode, t.cursor) == ("replay", 1)
    assert t.divergence is not None
    assert t.divergence["field"] == "cmd"
    assert (t.divergence["recorded"], t.divergence["actual"]) == ("echo b", "echo B")
    got, _ = await _call(tlog, "echo b")  # the right call still replays
    assert got is not None


@pytest.mark.asyncio
async def test_mismatch_with_diverge_cuts_the_log_there(tlog: TrajectoryLog) -> None:
    t0 = await tlog.for_sandbox(SBX)
    assert t0 is not None
    checkpoints = [{"step": 1, "image": "i1"}, {"step": 3, "image": "i3"}]
    await tlog.update(t0.id, lambda x: replace(x, checkpoints=checkpoints))
    await _reopen(tlog)
    await _call(tlog, "echo a")
    got, headers = await _call(tlog, "echo x")
    assert got is None
    assert headers["X-Dsec-Trajectory-Mode"] == "mismatch"
    assert headers["X-Dsec-Trajectory-Mismatch"] == "cmd"
    t = await tlog.for_sandbox(SBX)
    assert t is not None
    assert (t.steps, t.mode, t.cursor) == (1, "record", 1)
    assert t.divergence is not None
    assert t.divergence["sandbox_ahead_by"] == 2
    assert [k["step"] for k in t.checkpoints] == [1], "checkpoints after the cut are dropped"
    assert await tlog.step(t.id, 1) is None
