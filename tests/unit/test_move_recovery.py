"""A move (resume on another edge) whose apiserver dies half way is finished by the edges'
reconcile with the iam: the real edge SandboxManager (fake backend) on two edges and the
real iam tables, driven by the apiserver's own resume handler (which dies at a chosen
step) or through the steps ``dsec.apiserver.sandbox_move`` takes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import pytest_asyncio

from dsec.apiserver import sandbox_move
from dsec.apiserver.auth import Principal
from dsec.core import errors
from dsec.core.admission import NodeCapacity
from dsec.core.ids import new_sandbox_id
from dsec.core.lifecycle import State
from dsec.core.spec import MOVE_GRACE_S, SandboxSpec
from dsec.edge.manager import Caller, SandboxManager
from dsec.edge.records import RecordStore
from dsec.edge.service import caller_of, info_to_pb
from dsec.iam.db import IamDb, Project
from dsec.iam.service import DEFAULT_RECONCILE_GRACE_S, MOVE_SETTLE_S
from dsec.obs import Metrics
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.convert import spec_from_pb
from dsec.testing.fake_backend import FakeBackend
from tests.unit.moveapp import COPY, QUIET, Creates, Entry, resume_client

ALICE = Caller(project="alice", subject="alice", admin=False)
ALICE_KEY = Principal(subject="alice", project="alice", role="member", key_id="k1")
pytestmark = QUIET
SPEC = SandboxSpec(backend="microvm", memory_mb=256, timeout_s=3600)


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
                backends={"microvm": b},
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


@pytest.mark.asyncio
async def test_a_sandbox_resumed_at_home_after_its_new_one_ended_is_counted_again(
    world: World,
) -> None:
    """The apiserver renamed the allocation and died, the sandbox was resumed on its own
    edge, and the new one ended (its allocation with it): the sandbox runs at home under its
    own id, counted once, as before the move."""
    old = await world.create("e0a1")
    await world.edges["e0a1"].pause(old, ALICE)
    new = await world.create("f00d", moved_from=old)
    world.iam.move_allocation(old, new)
    await world.edges["e0a1"].resume(old, ALICE)
    await world.edges["f00d"].kill(new, ALICE)
    assert world.iam.usage("alice").sandboxes == 0  # running, and counted nowhere
    world.now += MOVE_SETTLE_S + 1
    await world.reconcile()
    assert (world.state(old), world.state(new)) == (State.RUNNING, State.STOPPED)
    assert world.edges["e0a1"].get(old, ALICE).moved_to == ""
    assert [a.sandbox_id for a in world.iam.allocations()] == [old]
    world.now += max(MOVE_GRACE_S, DEFAULT_RECONCILE_GRACE_S) + 1
    await world.reconcile()
    assert world.state(old) is State.RUNNING
    assert [a.sandbox_id for a in world.iam.allocations()] == [old]
    assert world.iam.usage("alice").sandboxes == 1


class Died(BaseException):
    """The apiserver process ends here: nothing after this step runs, not even its undo."""


class EdgeStub:
    """The edge's gRPC methods the apiserver calls for a move, on the real manager."""

    def __init__(self, manager: SandboxManager) -> None:
        self.m = manager

    @staticmethod
    def _caller(metadata: Any) -> Caller:
        class Context:
            def invocation_metadata(self) -> Any:
                return metadata

        return caller_of(cast(Any, Context()))

    async def GetSandbox(self, ref: pb.SandboxRef, metadata: Any, **_: Any) -> pb.SandboxInfo:
        return info_to_pb(self.m.get(ref.sandbox_id, self._caller(metadata)), self.m.edge_id)

    async def ResumeSandbox(self, ref: pb.SandboxRef, metadata: Any, **_: Any) -> pb.SandboxInfo:
        rec = await self.m.resume(ref.sandbox_id, self._caller(metadata))
        return info_to_pb(rec, self.m.edge_id)

    async def CreateSandbox(
        self, req: pb.CreateSandboxRequest, metadata: Any, **_: Any
    ) -> pb.SandboxInfo:
        assert req.from_snapshot == COPY
        rec = await self.m.create(req.sandbox_id, spec_from_pb(req.spec), project=req.project,
                                  owner=req.owner, caller=self._caller(metadata),
                                  moved_from=req.moved_from)  # fmt: skip
        return info_to_pb(rec, self.m.edge_id)

    async def KillSandbox(self, ref: pb.SandboxRef, metadata: Any, **_: Any) -> pb.SandboxInfo:
        rec = await self.m.kill(ref.sandbox_id, self._caller(metadata))
        return info_to_pb(rec, self.m.edge_id)

    async def EndMovedSandbox(self, req: pb.MovedSandbox, metadata: Any, **_: Any) -> Any:
        rec = await self.m.end_moved(req.sandbox_id, req.moved_to, self._caller(metadata))
        return info_to_pb(rec, self.m.edge_id)


class Apiserver:
    """The apiserver's upstream (iam and edges) on the world, dying at ``dies_at``."""

    def __init__(self, world: World) -> None:
        self.world, self.dies_at = world, ""
        self.stubs = {e: EdgeStub(m) for e, m in world.edges.items()}
        self.iam = self

    async def MoveAllocation(self, req: pb.MoveAllocationRequest, **_: Any) -> pb.Empty:
        if self.dies_at == "rename":
            raise Died
        self.world.iam.move_allocation(req.from_sandbox_id, req.to_sandbox_id)
        if self.dies_at == "end":
            raise Died
        return pb.Empty()

    async def edge_for(self, sid: str) -> EdgeStub:
        return self.stubs[sid.split("-")[1]]

    async def edges(self, fresh: bool = False) -> list[Entry]:
        return [Entry(e) for e in self.stubs]

    def edge_stub(self, entry: Entry) -> EdgeStub:
        return self.stubs[entry.edge_id]

    def edge_stream(self, entry: Entry) -> Creates:
        return Creates(self.stubs[entry.edge_id])


async def _no_undo(*_: Any, **__: Any) -> None:
    return None  # a dead apiserver undoes nothing


@pytest.mark.parametrize("dies_at", ["rename", "end"])
@pytest.mark.asyncio
async def test_an_apiserver_dying_in_its_resume_handler(
    world: World, monkeypatch: pytest.MonkeyPatch, dies_at: str
) -> None:
    monkeypatch.setattr(sandbox_move, "_undo", _no_undo)
    up = Apiserver(world)
    old = await world.create("e0a1")
    await world.edges["e0a1"].pause(old, ALICE)
    up.dies_at = dies_at
    async with resume_client(up, ALICE_KEY, monkeypatch) as client:
        with pytest.raises(aiohttp.ServerDisconnectedError):  # the caller sees it die
            await client.post(f"/v1/sandboxes/{old}/resume", json={"edge": "f00d"})
    [new] = [r.id for r in world.edges["f00d"].live_records()]
    assert world.edges["f00d"].get(new, ALICE).moved_from == old
    world.now += max(MOVE_GRACE_S, MOVE_SETTLE_S) + 1
    await world.reconcile()
    await world.reconcile()
    if dies_at == "rename":  # the move did not happen: it is paused at home, counted there
        assert (world.state(old), world.state(new)) == (State.PAUSED, State.STOPPED)
        assert [a.sandbox_id for a in world.iam.allocations()] == [old]
        await world.edges["e0a1"].resume(old, ALICE)
    else:  # the move happened: the old id is a tombstone naming the new one
        assert (world.state(old), world.state(new)) == (State.STOPPED, State.RUNNING)
        assert [a.sandbox_id for a in world.iam.allocations()] == [new]
        with pytest.raises(errors.SandboxNotFound, match=new):
            world.edges["e0a1"].get(old, ALICE)
    assert world.iam.usage("alice").sandboxes == 1
