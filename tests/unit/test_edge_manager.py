"""The edge's lifecycle engine against a fake backend (the real one runs in tests/e2e)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core import errors
from dsec.core.admission import NodeCapacity
from dsec.core.ids import new_sandbox_id
from dsec.core.lifecycle import State
from dsec.core.spec import SandboxSpec
from dsec.edge.manager import Caller, SandboxManager
from dsec.edge.records import RecordStore
from dsec.obs import Metrics
from dsec.testing.fake_backend import FakeBackend

ADMIN = Caller(project="", subject="root", admin=True)
ALICE = Caller(project="alice", subject="alice", admin=False)
BOB = Caller(project="bob", subject="bob", admin=False)


class Env:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.backend = FakeBackend()
        self.ended: list[str] = []
        self.now = 1000.0
        self.records = RecordStore(tmp / "records.db")
        self.manager = self.make()

    def make(self, max_sandboxes: int = 10) -> SandboxManager:
        async def on_ended(sid: str) -> None:
            self.ended.append(sid)

        return SandboxManager(
            edge_id="e0a1", state_root=self.tmp / "state", socket_root=self.tmp / "s",
            backends={"container": self.backend}, records=self.records,
            capacity=NodeCapacity(cpu_total=2, memory_total_mb=4096, max_sandboxes=max_sandboxes),
            metrics=Metrics("test"), on_ended=on_ended, clock=lambda: self.now,
        )  # fmt: skip

    async def create(self, caller: Caller = ALICE, timeout_s: int = 300) -> str:
        sid = new_sandbox_id("e0a1", os.urandom(13))
        project = caller.project or "alice"
        await self.manager.create(
            sid,
            SandboxSpec(memory_mb=64, timeout_s=timeout_s),
            project=project,
            owner=caller.subject,
            caller=caller,
        )
        return sid


@pytest_asyncio.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    e = Env(tmp_path)
    yield e
    e.manager.close()
    await e.backend.aclose()
    e.records.close()


@pytest.mark.asyncio
async def test_create_get_list_kill_and_project_isolation(env: Env) -> None:
    sid = await env.create()
    rec = env.manager.get(sid, ALICE)
    assert rec.state is State.RUNNING
    assert rec.pid > 0
    assert [r.id for r in env.manager.query(ALICE)] == [sid]
    assert env.manager.query(BOB) == []
    with pytest.raises(errors.SandboxNotFound):
        env.manager.get(sid, BOB)
    with pytest.raises(errors.SandboxNotFound):
        await env.manager.kill(sid, BOB)
    done = await env.manager.kill(sid, ALICE)
    assert done.state is State.STOPPED
    assert env.backend.destroyed == [sid]
    assert env.ended == [sid]
    assert env.records.get(sid) == done
    assert (await env.manager.kill(sid, ALICE)).state is State.STOPPED  # idempotent
    with pytest.raises(errors.InvalidState):
        env.manager.agent_socket(sid, ALICE)


@pytest.mark.asyncio
async def test_failed_create_is_rolled_back_and_reported(env: Env) -> None:
    env.backend.fail_next_create = "crun said no"
    with pytest.raises(errors.SandboxFailed, match="crun said no"):
        await env.create()
    [rec] = env.records.all()
    assert rec.state is State.FAILED
    assert "crun said no" in rec.error
    assert env.backend.destroyed == [rec.id]
    assert env.ended == [rec.id]
    assert env.manager.live_records() == []


@pytest.mark.asyncio
async def test_admission_and_foreign_ids(env: Env) -> None:
    env.manager = env.make(max_sandboxes=1)
    await env.create()
    with pytest.raises(errors.NodeFull):
        await env.create()
    with pytest.raises(errors.PermissionDenied):
        await env.manager.create(
            new_sandbox_id("e0a1", os.urandom(13)),
            SandboxSpec(),
            project="bob",
            owner="alice",
            caller=ALICE,
        )
    with pytest.raises(errors.SandboxNotFound, match="does not belong"):
        await env.manager.create(
            new_sandbox_id("zzzz", os.urandom(13)),
            SandboxSpec(),
            project="alice",
            owner="alice",
            caller=ALICE,
        )


@pytest.mark.asyncio
async def test_expired_sandboxes_are_stopped(env: Env) -> None:
    keep = await env.create(timeout_s=100)
    gone = await env.create(timeout_s=10)
    env.now += 50
    await env.manager.reap_expired()
    assert env.manager.get(gone, ALICE).state is State.STOPPED
    assert env.manager.get(gone, ALICE).error == "timeout"
    assert env.manager.get(keep, ALICE).state is State.RUNNING
    await env.manager.set_timeout(keep, 1000, ALICE)
    env.now += 500
    await env.manager.reap_expired()
    assert env.manager.get(keep, ALICE).state is State.RUNNING


@pytest.mark.asyncio
async def test_on_timeout_pause_pauses_keeps_and_resume_restarts_the_timeout(env: Env) -> None:
    from dsec.edge.manager import PAUSED_KEEP_S

    sid = new_sandbox_id("e0a1", os.urandom(13))
    spec = SandboxSpec(memory_mb=64, timeout_s=10, on_timeout="pause")
    await env.manager.create(sid, spec, project="alice", owner="alice", caller=ALICE)
    env.now += 11
    await env.manager.reap_expired()
    rec = env.manager.get(sid, ALICE)
    assert rec.state is State.PAUSED
    assert env.backend.states[sid].value == "paused"
    assert rec.expires_at == env.now + PAUSED_KEEP_S
    env.now += 3600  # paused: its timeout no longer ends it
    await env.manager.reap_expired()
    assert env.manager.get(sid, ALICE).state is State.PAUSED
    rec = await env.manager.resume(sid, ALICE)
    assert rec.state is State.RUNNING
    assert rec.expires_at == env.now + 10
    env.now += PAUSED_KEEP_S + 11  # paused again at the new timeout, ended after the keep
    await env.manager.reap_expired()
    assert env.manager.get(sid, ALICE).state is State.PAUSED
    env.now += PAUSED_KEEP_S + 1
    await env.manager.reap_expired()
    assert env.manager.get(sid, ALICE).state is State.STOPPED


@pytest.mark.asyncio
async def test_on_timeout_pause_is_refused_by_a_backend_that_cannot_pause(env: Env) -> None:
    from dsec.edge.backends.api import Capabilities

    env.backend.capabilities = lambda: Capabilities(pause=False)  # type: ignore[method-assign]
    sid = new_sandbox_id("e0a1", os.urandom(13))
    spec = SandboxSpec(memory_mb=64, on_timeout="pause")
    with pytest.raises(errors.InvalidArgument, match="cannot pause"):
        await env.manager.create(sid, spec, project="alice", owner="alice", caller=ALICE)
    assert env.manager.live_records() == []
    assert not env.backend.states
    with pytest.raises(errors.SandboxNotFound):
        env.manager.get(sid, ALICE)
    with pytest.raises(errors.InvalidArgument, match="on_timeout"):
        SandboxSpec(on_timeout="hibernate")


@pytest.mark.asyncio
async def test_a_dying_init_fails_the_sandbox_and_releases_it(env: Env) -> None:
    sid = await env.create()
    env.backend.inits[sid].kill()
    for _ in range(500):  # FAILED is recorded first, then the sandbox is destroyed and released
        if env.ended and env.manager.get(sid, ALICE).state is State.FAILED:
            break
        await asyncio.sleep(0.01)
    rec = env.manager.get(sid, ALICE)
    assert rec.state is State.FAILED
    assert "exited" in rec.error
    assert sid in env.backend.destroyed
    assert env.ended == [sid]


@pytest.mark.asyncio
async def test_kill_while_creating_leaves_nothing(env: Env) -> None:
    env.backend.create_delay = 0.2
    sid = new_sandbox_id("e0a1", os.urandom(13))
    create = asyncio.ensure_future(
        env.manager.create(
            sid, SandboxSpec(memory_mb=64), project="alice", owner="alice", caller=ALICE
        )
    )
    await asyncio.sleep(0.05)
    assert env.manager.get(sid, ALICE).state is State.CREATING
    killed = await env.manager.kill(sid, ALICE)
    with pytest.raises(errors.InvalidState, match="killed while it was being created"):
        await create
    assert killed.state is State.STOPPED
    assert env.backend.running == {}
    assert env.backend.inits == {}
    assert env.manager.live_records() == []


@pytest.mark.asyncio
async def test_restart_readopts_running_and_finishes_half_done_work(env: Env) -> None:
    alive = await env.create()
    lost = await env.create()
    env.manager.close()  # the edge dies: no teardown, records stay as they were
    env.backend.inits[lost].kill()  # ... and a sandbox dies while it is down
    await env.backend.inits[lost].wait()
    # Records of a create and a stop that were cut off by the crash:
    half = await env.create()
    await env.backend.destroy(half, env.manager.paths(half))
    half_rec = env.records.get(half)
    assert half_rec is not None
    env.records.put(replace(half_rec, state=State.CREATING))
    env.backend.destroyed.clear()
    env.ended.clear()

    env.manager = env.make()
    await env.manager.adopt()
    assert env.manager.get(alive, ADMIN).state is State.RUNNING
    assert alive not in env.backend.destroyed  # re-adopted, never killed
    assert env.manager.get(lost, ADMIN).state is State.FAILED
    assert env.manager.get(half, ADMIN).state is State.FAILED
    assert set(env.ended) == {lost, half}
    assert {r.id for r in env.manager.live_records()} == {alive}


@pytest.mark.asyncio
async def test_trajectory_mark_refuses_unbound_calls_and_survives_a_restart(env: Env) -> None:
    sid = await env.create()
    env.manager.check_unbound(sid, ALICE)  # not marked: an "unbound" call may run
    with pytest.raises(errors.SandboxNotFound):  # another project's sandbox
        env.manager.mark_trajectory(sid, "t1", BOB)
    env.manager.mark_trajectory(sid, "t1", ALICE)
    with pytest.raises(errors.TrajectoryBound):
        env.manager.check_unbound(sid, ALICE)
    env.manager.close()
    env.manager = env.make()
    await env.manager.adopt()
    with pytest.raises(errors.TrajectoryBound):
        env.manager.check_unbound(sid, ALICE)  # the mark is in the sandbox's record
    env.manager.mark_trajectory(sid, "", ALICE)
    env.manager.check_unbound(sid, ALICE)
    assert "dsec.trajectory" not in env.manager.get(sid, ALICE).spec.metadata


@pytest.mark.asyncio
async def test_trajectory_epoch_refuses_calls_of_an_earlier_binding(env: Env) -> None:
    sid = await env.create()
    env.manager.mark_trajectory(sid, "t1", ALICE, "e1")
    env.manager.check_epoch(sid, "e1", ALICE)  # the apiserver's cached record is current
    env.manager.mark_trajectory(sid, "t1", ALICE, "e2")  # re-opened (or rebound) elsewhere
    with pytest.raises(errors.TrajectoryBound):
        env.manager.check_epoch(sid, "e1", ALICE)
    env.manager.check_epoch(sid, "e2", ALICE)
    with pytest.raises(errors.SandboxNotFound):
        env.manager.check_epoch(sid, "e2", BOB)
    env.manager.mark_trajectory(sid, "", ALICE)  # removed: no epoch is current
    with pytest.raises(errors.TrajectoryBound):
        env.manager.check_epoch(sid, "e2", ALICE)
    assert "dsec.trajectory.epoch" not in env.manager.get(sid, ALICE).spec.metadata


@pytest.mark.asyncio
async def test_a_sandbox_moved_away_ends_only_if_paused_and_leaves_a_tombstone(env: Env) -> None:
    sid = await env.create()
    new = new_sandbox_id("ffff", os.urandom(13))
    with pytest.raises(errors.InvalidState, match="not paused"):
        await env.manager.end_moved(sid, new, ALICE)  # resumed here meanwhile: it stays
    assert env.manager.get(sid, ALICE).state is State.RUNNING
    await env.manager.pause(sid, ALICE)
    with pytest.raises(errors.SandboxNotFound):
        await env.manager.end_moved(sid, new, BOB)
    rec = await env.manager.end_moved(sid, new, ALICE)
    assert rec.state is State.STOPPED
    assert env.backend.destroyed == [sid]
    assert env.ended == [sid]  # the iam release is a no-op: the allocation moved first
    for call in (
        lambda: env.manager.get(sid, ALICE),
        lambda: env.manager.agent_socket(sid, ALICE),
    ):
        with pytest.raises(errors.SandboxNotFound, match=f"moved to another edge as {new}"):
            call()
    with pytest.raises(errors.SandboxNotFound, match=new):
        await env.manager.kill(sid, ALICE)
    with pytest.raises(errors.SandboxNotFound, match=f"^no sandbox {sid}$"):
        env.manager.get(sid, BOB)  # other projects learn nothing
    [listed] = env.manager.query(ALICE, include_terminated=True)
    assert (listed.moved_to, listed.error) == (new, "")
    assert env.records.get(sid) == listed  # durable: a restarted edge still names the new id
    assert await env.manager.end_moved(sid, new, ALICE) == listed  # a repeated end: the same
    with pytest.raises(errors.SandboxNotFound, match=new):
        await env.manager.end_moved(sid, new_sandbox_id("ffff", os.urandom(13)), ALICE)


@pytest.mark.asyncio
async def test_a_sandbox_being_resumed_here_is_not_ended_by_a_move(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = await env.create()
    await env.manager.pause(sid, ALICE)
    go = asyncio.Event()
    resume = env.backend.resume

    async def slow(sandbox_id: str) -> None:
        await go.wait()
        await resume(sandbox_id)

    monkeypatch.setattr(env.backend, "resume", slow)
    task = asyncio.create_task(env.manager.resume(sid, ALICE))
    await asyncio.sleep(0.01)
    with pytest.raises(errors.InvalidState, match="resuming"):
        await env.manager.end_moved(sid, new_sandbox_id("ffff", os.urandom(13)), ALICE)
    go.set()
    assert (await task).state is State.RUNNING


@pytest.mark.asyncio
async def test_a_paused_sandbox_that_no_longer_fits_is_not_resumed(env: Env) -> None:
    """Back with less capacity, the edge refuses to resume beside the running ones (the
    apiserver then resumes a microVM on another edge)."""
    keep, paused = await env.create(), await env.create()
    await env.manager.pause(paused, ALICE)
    env.manager.close()
    env.manager = env.make(max_sandboxes=1)
    await env.manager.adopt()
    assert env.manager.get(paused, ALICE).state is State.PAUSED
    with pytest.raises(errors.NodeFull):
        await env.manager.resume(paused, ALICE)
    assert env.manager.get(paused, ALICE).state is State.PAUSED
    await env.manager.kill(keep, ALICE)
    assert (await env.manager.resume(paused, ALICE)).state is State.RUNNING
