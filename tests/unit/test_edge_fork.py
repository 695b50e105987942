"""SandboxManager.fork against a fake backend (the real microVM fork runs in integration)."""

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
from dsec.edge.backends.api import SandboxPaths, Started
from dsec.edge.manager import Caller, SandboxManager
from dsec.edge.records import RecordStore
from dsec.obs import Metrics
from dsec.testing.fake_backend import FakeBackend

ALICE = Caller(project="alice", subject="alice", admin=False)


class ForkingBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.fail_fork = False
        self.forked: list[tuple[str, list[str]]] = []

    async def fork(
        self, sandbox_id: str, children: list[tuple[str, SandboxPaths]]
    ) -> list[Started]:
        if self.fail_fork:
            raise errors.SandboxFailed("snapshot failed")
        self.forked.append((sandbox_id, [c for c, _ in children]))
        spec = SandboxSpec(memory_mb=64)
        return [await self.create(cid, spec, paths) for cid, paths in children]


class Env:
    def __init__(self, tmp: Path, backend: FakeBackend, max_sandboxes: int = 10) -> None:
        self.backend = backend
        self.records = RecordStore(tmp / "records.db")
        self.manager = SandboxManager(
            edge_id="e0a1", state_root=tmp / "state", socket_root=tmp / "s",
            backends={"container": backend}, records=self.records,
            capacity=NodeCapacity(cpu_total=64, memory_total_mb=65536, max_sandboxes=max_sandboxes),
            metrics=Metrics("test"), clock=lambda: 1000.0,
        )  # fmt: skip

    async def create(self) -> str:
        sid = new_sandbox_id("e0a1", os.urandom(13))
        spec = SandboxSpec(memory_mb=64)
        await self.manager.create(sid, spec, project="alice", owner="alice", caller=ALICE)
        return sid


@pytest_asyncio.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    e = Env(tmp_path, ForkingBackend(), max_sandboxes=4)
    yield e
    e.manager.close()
    await e.backend.aclose()
    e.records.close()


@pytest.mark.asyncio
async def test_fork_makes_running_children_of_the_same_project(env: Env) -> None:
    parent = await env.create()
    kids = await env.manager.fork(parent, 2, ALICE)
    assert len(kids) == 2
    assert all(k.state is State.RUNNING and k.pid > 0 for k in kids)
    assert {k.project for k in kids} == {"alice"}
    assert len({k.id for k in kids} | {parent}) == 3
    assert env.manager.get(kids[0].id, ALICE).spec == env.manager.get(parent, ALICE).spec


@pytest.mark.asyncio
async def test_fork_refuses_paused_bad_counts_and_full_nodes(env: Env) -> None:
    parent = await env.create()
    with pytest.raises(errors.InvalidArgument):
        await env.manager.fork(parent, 0, ALICE)
    await env.manager.pause(parent, ALICE)
    with pytest.raises(errors.InvalidState):
        await env.manager.fork(parent, 1, ALICE)
    await env.manager.resume(parent, ALICE)
    with pytest.raises(errors.NodeFull):
        await env.manager.fork(parent, 4, ALICE)  # 1 + 4 > 4


@pytest.mark.asyncio
async def test_failed_fork_marks_children_failed(env: Env) -> None:
    parent = await env.create()
    assert isinstance(env.backend, ForkingBackend)
    env.backend.fail_fork = True
    with pytest.raises(errors.SandboxFailed):
        await env.manager.fork(parent, 2, ALICE)
    states = [r.state for r in env.manager.query(ALICE, include_terminated=True) if r.id != parent]
    assert states == [State.FAILED, State.FAILED]
    assert env.manager.get(parent, ALICE).state is State.RUNNING


@pytest.mark.asyncio
async def test_backend_without_fork_is_refused(tmp_path: Path) -> None:
    e = Env(tmp_path, FakeBackend())
    try:
        parent = await e.create()
        with pytest.raises(errors.InvalidArgument, match="cannot fork"):
            await e.manager.fork(parent, 1, ALICE)
    finally:
        e.manager.close()
        await e.backend.aclose()
        e.records.close()
