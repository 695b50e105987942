"""``POST /v1/sandboxes:batch`` with the apiserver's real middleware and a fake upstream:
the calls fan out concurrently, each sandbox gets its own result and audit entry, bad
requests are refused before anything is done."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from dsec.apiserver import sandboxes
from dsec.apiserver.app import errors_and_auth
from dsec.apiserver.auth import Authenticator, Principal
from dsec.apiserver.context import CTX, Ctx
from dsec.apiserver.upstream import Upstream
from dsec.core.errors import PermissionDenied, SandboxNotFound
from dsec.obs import Metrics
from dsec.rpc._gen import dsec_pb2 as pb

ALICE = Principal(subject="alice", project="acme/rl", role="member", key_id="k1")
OURS = [f"sbx-e0a1-{c * 20}" for c in "abcd"]
THEIRS = "sbx-e0a1-" + "x" * 20
# the apiserver keeps plain string keys on requests (its daemon does not turn warnings into errors)
pytestmark = pytest.mark.filterwarnings("ignore::aiohttp.web_exceptions.NotAppKeyWarning")


@dataclass
class FakeEdge:
    """Pause calls wait until ``fan_out`` of them are in flight at once."""

    fan_out: int
    in_flight: int = 0
    most: int = 0
    all_in: asyncio.Event = field(default_factory=asyncio.Event)

    async def PauseSandbox(self, ref: pb.SandboxRef, metadata: Any, timeout: float) -> Any:
        if ref.sandbox_id == THEIRS:
            raise SandboxNotFound(f"no sandbox {ref.sandbox_id}")
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight >= self.fan_out:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), 5)
        self.in_flight -= 1
        return pb.SandboxInfo(id=ref.sandbox_id, project="acme/rl/exp", state="paused")

    async def ListSandboxes(
        self, req: pb.ListSandboxesRequest, metadata: Any, timeout: float
    ) -> Any:
        assert req.project == "acme/rl"
        return pb.SandboxList(
            sandboxes=[pb.SandboxInfo(id=s, created_at=i) for i, s in enumerate(OURS[:2])]
        )


@dataclass
class FakeIam:
    audit: list[pb.AuditEntry] = field(default_factory=list)

    async def audit_entry(self, entry: pb.AuditEntry) -> None:
        self.audit.append(entry)


@dataclass
class FakeIamBatch:  # the apiserver's queue to the iam (dsec.apiserver.iam_batch)
    iam: FakeIam

    async def audit(self, entry: pb.AuditEntry) -> None:
        await self.iam.audit_entry(entry)


@dataclass
class FakeEntry:
    edge_id: str = "e0a1"
    healthy: bool = True


class FakeUpstream:
    def __init__(self, edge: FakeEdge) -> None:
        self.edge, self.iam = edge, FakeIam()
        self.iam_batch = FakeIamBatch(self.iam)

    async def edge_for(self, sid: str) -> FakeEdge:
        if not sid.startswith("sbx-e0a1-"):
            raise SandboxNotFound(f"no sandbox {sid!r} (malformed sandbox id)")
        return self.edge

    async def edges(self, fresh: bool = False) -> list[FakeEntry]:
        return [FakeEntry()]

    def edge_stub(self, entry: FakeEntry) -> FakeEdge:
        return self.edge


class FakeAuth:
    async def principal(self, request: web.Request) -> Principal:
        return ALICE


async def client_for(upstream: FakeUpstream) -> TestClient[web.Request, web.Application]:
    app = web.Application(middlewares=[errors_and_auth])
    app[CTX] = Ctx(
        upstream=cast(Upstream, upstream),
        auth=cast(Authenticator, FakeAuth()),
        metrics=Metrics("test"),
        components={},
    )
    app.router.add_post("/v1/sandboxes:batch", sandboxes.batch)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest_asyncio.fixture
async def setup() -> AsyncIterator[tuple[FakeUpstream, TestClient[web.Request, web.Application]]]:
    upstream = FakeUpstream(FakeEdge(fan_out=len(OURS)))
    client = await client_for(upstream)
    yield upstream, client
    await client.close()


@pytest.mark.asyncio
async def test_fans_out_and_answers_one_result_per_sandbox(
    setup: tuple[FakeUpstream, TestClient[web.Request, web.Application]],
) -> None:
    upstream, client = setup
    ids = [*OURS, THEIRS, "garbage", OURS[0]]
    resp = await client.post("/v1/sandboxes:batch", json={"action": "pause", "ids": ids})
    assert resp.status == 200
    results = (await resp.json())["results"]
    assert [r["id"] for r in results] == [*OURS, THEIRS, "garbage"]  # duplicates once
    assert [r["ok"] for r in results] == [True] * 4 + [False, False]
    assert results[0]["sandbox"]["state"] == "paused"
    assert results[4]["error"]["code"] == "sandbox_not_found"
    assert "malformed" in results[5]["error"]["message"]
    assert upstream.edge.most == len(OURS)  # all four were in flight together
    audit = sorted((e.target, e.action, e.result, e.project) for e in upstream.iam.audit)
    assert audit == sorted(
        [(s, "sandbox.pause", "ok", "acme/rl/exp") for s in OURS]
        + [(THEIRS, "sandbox.pause", "sandbox_not_found", "acme/rl"),
           ("garbage", "sandbox.pause", "sandbox_not_found", "acme/rl")]
    )  # fmt: skip
    assert all(e.actor == "alice (key k1)" for e in upstream.iam.audit)


@pytest.mark.asyncio
async def test_by_project() -> None:
    upstream = FakeUpstream(FakeEdge(fan_out=2))
    client = await client_for(upstream)
    try:
        resp = await client.post(
            "/v1/sandboxes:batch", json={"action": "pause", "project": "acme/rl"}
        )
        assert [r["id"] for r in (await resp.json())["results"]] == OURS[:2]
        resp = await client.post("/v1/sandboxes:batch", json={"action": "kill", "project": "acme"})
        assert resp.status == PermissionDenied.http_status
        assert "needs the member role on project" in (await resp.json())["error"]["message"]
    finally:
        await client.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"action": "stop", "ids": OURS}, "'action' must be one of"),
        ({"action": "kill"}, "exactly one of"),
        ({"action": "kill", "ids": OURS, "project": "acme/rl"}, "exactly one of"),
        ({"action": "kill", "ids": [1, 2]}, "list of sandbox ids"),
        ({"action": "kill", "ids": OURS, "all": True}, "unknown batch field"),
        ({"action": "kill", "ids": [f"sbx-e0a1-{i:020d}" for i in range(1001)]}, "at most 1000"),
        ({"action": "kill", "project": "Bad Name"}, "project"),
    ],
)
async def test_bad_requests_do_nothing(
    setup: tuple[FakeUpstream, TestClient[web.Request, web.Application]],
    body: dict[str, Any],
    why: str,
) -> None:
    upstream, client = setup
    resp = await client.post("/v1/sandboxes:batch", json=body)
    assert resp.status == 400
    assert why in (await resp.json())["error"]["message"]
    assert upstream.edge.most == 0
    assert upstream.iam.audit == []
