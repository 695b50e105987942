"""A move (resume on another edge) whose apiserver dies half way is finished by the edges'
reconcile with the iam: the real edge SandboxManager (fake backend) on two edges and the
real iam tables, driven through the steps ``dsec.apiserver.sandbox_move`` takes and stopped
where the apiserver would die."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from dsec.core import errors
from dsec.core.admission import NodeCapacity
from dsec.core.ids import new_sandbox_id
from dsec.core.lifecycle import State
from dsec.core.spec import SandboxSpec
from dsec.edge.manager import MOVE_GRACE_S, Caller, SandboxManager
from dsec.edge.records import RecordStore
from dsec.iam.db import IamDb, Project
from dsec.iam.service import DEFAULT_RECONCILE_GRACE_S, MOVE_SETTLE_S
from dsec.obs import Metrics
from dsec.testing.fake_backend import FakeBackend

ALICE = Caller(project="alice", subject="alice", admin=False)
SPEC = SandboxSpec(memory_mb=64, timeout_s=3600)


class World:
    def __init__(self, tmp: Path) -> None:
        self.now = 1000.0
        self.iam = IamDb(tmp / "iam.db", clock=lambda: self.now)
        self.iam.put_project(Project("alice", 0, 0, 0))
        self.backends = {e: FakeBackend() for e in ("e0a1", "f00d")}
        self.records = {e: RecordStore(tmp / e / "records.db") for e in self.backends}
        self.edges = {
            e: SandboxManager(
                edge_id=e,
                state_root=tmp / e / "state",
                socket_root=tmp / e / "s",
                backends={"container": b},
                records=self.records[e],
                capacity=NodeCapacity(cpu_total=2, memory_total_mb=4096, max_sandboxes=10),
                metrics=Metrics("test"),
                on_ended=self._release,
                clock=lambda: self.now,
            )
            for e, b in self.backends.items()
        }

    async def _release(self, sid: str) -> None:
        self.iam.release(sid)

    async def create(self, edge: str, moved_from: str = "") -> str:
        sid = new_sandbox_id(edge, os.urandom(13))
        if not moved_from:  # the apiserver admits a new sandbox first; a move renames instead
            self.iam.admit("alice", sid, SPEC.cpu, SPEC.memory_mb, edge)
        await self.edges[edge].create(sid, SPEC, project="alice", owner="alice", caller=ALICE,
                                      moved_from=moved_from)  # fmt: skip
        return sid

    async def reconcile(self) -> None:
        """Each edge's reconcile loop, with the iam's side of ``Iam.Reconcile``."""
        for edge_id, manager in self.edges.items():
            recs = manager.live_records()
            live = [r.id for r in recs]
            running = [r.id for r in recs if r.state is State.RUNNING]
            self.iam.reconcile(edge_id, live, DEFAULT_RECONCILE_GRACE_S)
            moved, unallocated = self.iam.settle_moves(edge_id, live, MOVE_SETTLE_S, running)
            await manager.settle(moved, unallocated)

    def state(self, sid: str) -> State:
        rec = self.records[sid.split("-")[1]].get(sid)
        assert rec is not None
        return rec.state


@pytest_asyncio.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path)
    yield w
    for e, m in w.edges.items():
        await m.stop_all("test over")
        m.close()
        await w.backends[e].aclose()
        w.records[e].close()
    w.iam.close()


@pytest.mark.asyncio
async def test_the_apiserver_dying_mid_move_leaves_one_counted_sandbox(world: World) -> None:
    old = await world.create("e0a1")
    await world.edges["e0a1"].pause(old, ALICE)

    # 1. dies after starting the target, before renaming the allocation
    lost = await world.create("f00d", moved_from=old)
    assert world.edges["f00d"].get(lost, ALICE).moved_from == old
    with pytest.raises(errors.InvalidArgument, match="not a sandbox id"):
        await world.create("f00d", moved_from="../x")
    world.now += 60
    await world.reconcile()
    assert world.state(lost) is State.RUNNING  # young: the rename may still come
    world.now += MOVE_GRACE_S
    await world.reconcile()
    assert world.state(lost) is State.STOPPED
    assert "did not complete" in world.edges["f00d"].query(ALICE, include_terminated=True)[0].error
    assert world.state(old) is State.PAUSED  # the sandbox is where it was, resumable there
    assert [a.sandbox_id for a in world.iam.allocations()] == [old]

    # 2. dies after renaming the allocation, before ending the source
    new = await world.create("f00d", moved_from=old)
    world.iam.move_allocation(old, new)
    await world.reconcile()
    assert (world.state(old), world.state(new)) == (State.PAUSED, State.RUNNING)
    world.now += MOVE_SETTLE_S + 1
    await world.reconcile()
    assert (world.state(old), world.state(new)) == (State.STOPPED, State.RUNNING)
    with pytest.raises(errors.SandboxNotFound, match=f"moved to another edge as {new}"):
        world.edges["e0a1"].get(old, ALICE)
    assert [a.sandbox_id for a in world.iam.allocations()] == [new]
    assert world.iam.usage("alice").sandboxes == 1
    world.now += MOVE_GRACE_S + 1
    await world.reconcile()  # the moved one holds its allocation: it stays
    assert world.state(new) is State.RUNNING


@pytest.mark.asyncio
async def test_a_sandbox_resumed_at_home_mid_move_keeps_it_and_the_new_one_goes(
    world: World,
) -> None:
    """The apiserver renamed the allocation, the sandbox was resumed on its own edge (by
    another apiserver) before this one could end it, and this one died: the edges do what
    it would have done on finding the sandbox resumed (give the allocation back, kill the
    new one)."""
    old = await world.create("e0a1")
    await world.edges["e0a1"].pause(old, ALICE)
    new = await world.create("f00d", moved_from=old)
    world.iam.move_allocation(old, new)
    await world.edges["e0a1"].resume(old, ALICE)
    world.now += MOVE_SETTLE_S + 1
    await world.reconcile()
    assert world.state(old) is State.RUNNING  # only a paused source is ended as moved
    assert [a.sandbox_id for a in world.iam.allocations()] == [old]
    await world.reconcile()
    assert world.state(new) is State.STOPPED
    assert world.iam.usage("alice").sandboxes == 1
