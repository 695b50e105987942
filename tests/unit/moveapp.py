"""The apiserver's resume handlers on a stand-in upstream, for the tests of a move (resume on
another edge): tests/unit/test_apiserver_move.py (fake edges and iam) and
tests/unit/test_move_recovery.py (real edge managers and iam tables). The snapshot copy is
skipped (it runs for real in tests/integration/test_sandbox_move.py): the target starts
from ``COPY``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from dsec.apiserver import sandboxes, snapshot_copy
from dsec.apiserver.app import errors_and_auth
from dsec.apiserver.auth import Authenticator, Principal
from dsec.apiserver.context import CTX, Ctx
from dsec.apiserver.upstream import Upstream
from dsec.obs import Metrics
from dsec.rpc._gen import dsec_pb2 as pb

COPY = "snp-copy"  # the snapshot id the target is started from
# the Ctx app key is set as the real apiserver does; aiohttp warns about it in tests
QUIET = pytest.mark.filterwarnings("ignore::aiohttp.web_exceptions.NotAppKeyWarning")

Client: TypeAlias = "TestClient[web.Request, web.Application]"


@dataclass
class Entry:
    """An edge as the watcher lists it: every one runs microVMs."""

    edge_id: str
    healthy: bool = True

    @property
    def view(self) -> Any:
        return pb.EdgeView(status=pb.EdgeStatus(backends=["microvm"]))


@dataclass
class Creates:
    """The apiserver's creates on an edge (``edge_stream``), over a fake's CreateSandbox."""

    edge: Any

    async def create(self, req: pb.CreateSandboxRequest, metadata: Any, timeout: float) -> Any:
        return await self.edge.CreateSandbox(req, metadata=metadata, timeout=timeout)


class OneCaller:
    """The authenticator: every request is ``principal``'s."""

    def __init__(self, principal: Principal) -> None:
        self._principal = principal

    async def principal(self, request: web.Request) -> Principal:
        return self._principal


async def _copied(request: web.Request, snapshot_id: str, source: Entry, target: Entry,
                  use: Callable[[str], Awaitable[Any]], **kw: Any) -> Any:  # fmt: skip
    assert kw == {"sandbox_id": snapshot_id}  # the pause snapshot of the sandbox itself
    return await use(COPY)


@asynccontextmanager
async def resume_client(
    upstream: Any, principal: Principal, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Client]:
    """A client of an apiserver serving ``POST /v1/sandboxes/{id}/resume`` and
    ``/v1/sandboxes:batch`` on ``upstream`` (``edge_for``, ``edges``, ``edge_stub``,
    ``iam`` ...), every caller being ``principal``."""
    monkeypatch.setattr(snapshot_copy, "on_edge", _copied)
    app = web.Application(middlewares=[errors_and_auth])
    app[CTX] = Ctx(upstream=cast(Upstream, upstream),
                   auth=cast(Authenticator, OneCaller(principal)),
                   metrics=Metrics("test"), components={})  # fmt: skip
    app.router.add_post("/v1/sandboxes/{sandbox_id}/resume", sandboxes.resume)
    app.router.add_post("/v1/sandboxes:batch", sandboxes.batch)
    async with TestClient(TestServer(app)) as client:
        yield client
