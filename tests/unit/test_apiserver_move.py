"""``POST /v1/sandboxes/{id}/resume`` onto another edge, the apiserver's orchestration with
fake edges and iam (the copy itself is ``snapshot_copy``, run for real in
``tests/integration/test_sandbox_move.py``): the allocation is renamed, never admitted
twice; a source that refuses to end the sandbox (resumed there meanwhile) gets it back;
the fallback when the sandbox's own edge is full."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio

from dsec.apiserver import sandbox_move
from dsec.apiserver.auth import Principal
from dsec.core.errors import DsecError, InvalidState, NodeFull, QuotaExceeded, Unavailable
from dsec.core.spec import MOVE_GRACE_S
from dsec.rpc._gen import dsec_pb2 as pb
from tests.unit.moveapp import COPY, QUIET, Client, Creates, Entry, resume_client

ALICE = Principal(subject="alice", project="acme", role="member", key_id="k1")
OLD = "sbx-e0a1-" + "a" * 20
pytestmark = QUIET


@dataclass
class FakeEdge:
    edge_id: str
    calls: list[tuple[str, str]] = field(default_factory=list)
    resume_error: DsecError | None = None
    end_error: DsecError | None = None

    def _info(self, sid: str, state: str) -> pb.SandboxInfo:
        spec = pb.SandboxSpec(backend="microvm", memory_mb=256, cpu=1)
        return pb.SandboxInfo(id=sid, project="acme", owner="alice", state=state,
                              edge_id=self.edge_id, spec=spec)  # fmt: skip

    async def GetSandbox(self, ref: pb.SandboxRef, **_: Any) -> pb.SandboxInfo:
        return self._info(ref.sandbox_id, "paused")

    async def ResumeSandbox(self, ref: pb.SandboxRef, **_: Any) -> pb.SandboxInfo:
        self.calls.append(("resume", ref.sandbox_id))
        if self.resume_error is not None:
            raise self.resume_error
        return self._info(ref.sandbox_id, "running")

    async def CreateSandbox(self, req: pb.CreateSandboxRequest, **_: Any) -> pb.SandboxInfo:
        self.calls.append(("create", req.sandbox_id))
        assert req.from_snapshot == COPY
        assert req.moved_from  # its edge kills it if the apiserver dies before the rename
        assert req.moved_from in FakeIam().allocations | {OLD2}
        assert (req.project, req.owner, req.spec.backend) == ("acme", "alice", "microvm")
        return self._info(req.sandbox_id, "running")

    async def KillSandbox(self, ref: pb.SandboxRef, **_: Any) -> pb.SandboxInfo:
        self.calls.append(("kill", ref.sandbox_id))
        return self._info(ref.sandbox_id, "stopped")

    async def EndMovedSandbox(self, req: pb.MovedSandbox, **_: Any) -> pb.SandboxInfo:
        self.calls.append(("end", f"{req.sandbox_id}>{req.moved_to}"))
        if self.end_error is not None:
            raise self.end_error
        return self._info(req.sandbox_id, "stopped")


@dataclass
class FakeIam:
    allocations: set[str] = field(default_factory=lambda: {OLD})
    error: DsecError | None = None

    async def MoveAllocation(self, req: pb.MoveAllocationRequest, **_: Any) -> pb.Empty:
        if self.error is not None:
            raise self.error
        self.allocations.remove(req.from_sandbox_id)
        self.allocations.add(req.to_sandbox_id)
        return pb.Empty()


@dataclass
class FakeIamBatch:  # the apiserver's queue to the iam: audit entries
    audit_entries: list[pb.AuditEntry] = field(default_factory=list)

    async def audit(self, entry: pb.AuditEntry) -> None:
        self.audit_entries.append(entry)


class Placement:
    full = False  # no other edge has room

    def order(self, edges: list[Entry], backend: str, memory_mb: int, limit: int) -> list[Entry]:
        if self.full:
            raise Unavailable("no edge has room")
        return edges[:limit]


class FakeUpstream:
    def __init__(self) -> None:
        self.src, self.dst = FakeEdge("e0a1"), FakeEdge("f00d")
        self.iam, self.placement, self.iam_batch = FakeIam(), Placement(), FakeIamBatch()

    async def edge_for(self, sid: str) -> FakeEdge:
        return self.src

    async def edges(self, fresh: bool = False) -> list[Entry]:
        return [Entry("e0a1"), Entry("f00d")]

    def edge_stub(self, entry: Entry) -> FakeEdge:
        return self.src if entry.edge_id == "e0a1" else self.dst

    def edge_stream(self, entry: Entry) -> Creates:
        return Creates(self.edge_stub(entry))


@pytest_asyncio.fixture
async def setup(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[FakeUpstream, Client]]:
    upstream = FakeUpstream()
    async with resume_client(upstream, ALICE, monkeypatch) as client:
        yield upstream, client


@pytest.mark.asyncio
async def test_a_move_renames_the_allocation_and_ends_the_source(
    setup: tuple[FakeUpstream, Client],
) -> None:
    up, client = setup
    resp = await client.post(f"/v1/sandboxes/{OLD}/resume", json={"edge": "f00d"})
    assert resp.status == 200, await resp.text()
    new = (await resp.json())["id"]
    assert new.startswith("sbx-f00d-")
    assert up.iam.allocations == {new}  # renamed: never one more, never one less
    assert up.dst.calls == [("create", new)]
    assert up.src.calls == [("end", f"{OLD}>{new}")]
    bad = await client.post(f"/v1/sandboxes/{OLD}/resume", json={"edge": "f00d", "x": 1})
    assert bad.status == 400


@pytest.mark.asyncio
async def test_a_sandbox_resumed_at_home_meanwhile_stays_there(
    setup: tuple[FakeUpstream, Client],
) -> None:
    up, client = setup
    up.src.end_error = InvalidState(f"sandbox {OLD} is running, not paused")
    resp = await client.post(f"/v1/sandboxes/{OLD}/resume", json={"edge": "f00d"})
    assert resp.status == 409
    new = up.dst.calls[0][1]
    assert up.dst.calls == [("create", new), ("kill", new)]
    assert up.iam.allocations == {OLD}  # given back


@pytest.mark.asyncio
async def test_an_iam_refusal_kills_the_new_one_and_keeps_the_allocation(
    setup: tuple[FakeUpstream, Client],
) -> None:
    up, client = setup
    up.iam.error = QuotaExceeded("no")
    resp = await client.post(f"/v1/sandboxes/{OLD}/resume", json={"edge": "f00d"})
    assert resp.status == 429
    new = up.dst.calls[0][1]
    assert up.dst.calls == [("create", new), ("kill", new)]
    assert up.src.calls == []  # the source was never asked to end it
    assert up.iam.allocations == {OLD}


@pytest.mark.asyncio
async def test_its_own_edge_full_moves_it_and_otherwise_resumes_at_home(
    setup: tuple[FakeUpstream, Client],
) -> None:
    up, client = setup
    resp = await client.post(f"/v1/sandboxes/{OLD}/resume")
    assert (await resp.json())["id"] == OLD
    assert up.dst.calls == []
    up.src.resume_error = NodeFull("node runs its maximum of 2 sandboxes")
    resp = await client.post(f"/v1/sandboxes/{OLD}/resume")
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["edge_id"] == "f00d"
    assert up.iam.allocations == {body["id"]}


OLD2 = "sbx-e0a1-" + "b" * 20


@pytest.mark.asyncio
async def test_a_batch_resume_moves_microvms_whose_edge_is_full_as_a_single_resume_does(
    setup: tuple[FakeUpstream, Client],
) -> None:
    up, client = setup
    up.iam.allocations = {OLD, OLD2}
    up.src.resume_error = NodeFull("node runs its maximum of 2 sandboxes")
    resp = await client.post("/v1/sandboxes:batch", json={"action": "resume", "ids": [OLD, OLD2]})
    assert resp.status == 200, await resp.text()
    results = (await resp.json())["results"]
    assert [(r["id"], r["ok"]) for r in results] == [(OLD, True), (OLD2, True)]
    new = [r["sandbox"]["id"] for r in results]
    assert all(n.startswith("sbx-f00d-") for n in new)
    assert up.iam.allocations == set(new)  # each renamed once
    assert sorted(up.src.calls) == sorted(
        [("resume", OLD), ("resume", OLD2), ("end", f"{OLD}>{new[0]}"), ("end", f"{OLD2}>{new[1]}")]
    )
    assert len(up.iam_batch.audit_entries) == 2


@pytest.mark.asyncio
async def test_a_batch_resume_with_no_edge_to_move_to_says_node_full_per_sandbox(
    setup: tuple[FakeUpstream, Client],
) -> None:
    up, client = setup
    up.src.resume_error = NodeFull("node runs its maximum of 2 sandboxes")
    up.placement.full = True
    resp = await client.post("/v1/sandboxes:batch", json={"action": "resume", "ids": [OLD]})
    assert resp.status == 200, await resp.text()
    [result] = (await resp.json())["results"]
    assert (result["ok"], result["error"]["code"]) == (False, "node_full")
    assert "maximum of 2" in result["error"]["message"]
    assert up.dst.calls == []
    assert up.iam.allocations == {OLD}


@pytest.mark.asyncio
async def test_a_move_too_slow_to_rename_in_time_is_given_up(
    setup: tuple[FakeUpstream, Client],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its new sandbox's edge kills it MOVE_GRACE_S after the start if it holds no
    allocation by then: an apiserver that got near that renames nothing."""
    up, client = setup
    clock = iter([0.0, MOVE_GRACE_S / 2 + 1])
    monkeypatch.setattr(sandbox_move, "monotonic", lambda: next(clock))
    resp = await client.post(f"/v1/sandboxes/{OLD}/resume", json={"edge": "f00d"})
    assert resp.status == 504, await resp.text()
    assert "took too long" in (await resp.json())["error"]["message"]
    new = up.dst.calls[0][1]
    assert up.dst.calls == [("create", new), ("kill", new)]
    assert up.src.calls == []
    assert up.iam.allocations == {OLD}
