"""The iam daemon through its real gRPC server on loopback (mTLS, temp home)."""

from __future__ import annotations

import asyncio
import stat
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio

from dsec.core import errors as e
from dsec.core.ids import new_sandbox_id
from dsec.iam.app import IamApp, IamConfig
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.client import secure_channel
from dsec.rpc.tls import ensure_node_pki
from tests.waits import auntil


def sid(edge: str, n: int) -> str:
    return new_sandbox_id(edge, n.to_bytes(13, "little"))


@dataclass
class Iam:
    app: IamApp
    home: Path
    edge_id: str
    target: str

    def channel(self, name: str) -> grpc.aio.Channel:
        return secure_channel(self.home / "pki", name, self.target, component="iam")


@pytest_asyncio.fixture
async def iam(tmp_path: Path) -> AsyncIterator[Iam]:
    edge_id = ensure_node_pki(tmp_path)
    app = IamApp(IamConfig(tmp_path, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"))
    port = await app.start()
    try:
        yield Iam(app, tmp_path, edge_id, f"127.0.0.1:{port}")
    finally:
        await app.stop()


@pytest.mark.asyncio
async def test_bootstrap_admin_key_authenticates(iam: Iam) -> None:
    key_file = iam.home / "admin.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    token = key_file.read_text().strip()
    async with iam.channel("apiserver") as ch:
        stub = pb_grpc.IamStub(ch)
        p = await stub.Authenticate(pb.AuthenticateRequest(api_key=token), timeout=5)
        assert (p.subject, p.project, p.role) == ("admin", "default", "admin")
        for bad in ("", "nonsense", token[:-2] + "zz", "dsk_aaaaaaaaaaaa_" + "b" * 43):
            with pytest.raises(e.Unauthenticated):
                await stub.Authenticate(pb.AuthenticateRequest(api_key=bad), timeout=5)


@pytest.mark.asyncio
async def test_key_management(iam: Iam) -> None:
    async with iam.channel("admin") as ch:
        stub = pb_grpc.IamStub(ch)
        await stub.PutProject(pb.Project(name="team", max_sandboxes=5), timeout=5)
        made = await stub.CreateKey(
            pb.CreateKeyRequest(subject="alice", project="team", role="member", name="ci"),
            timeout=5,
        )
        p = await stub.Authenticate(pb.AuthenticateRequest(api_key=made.api_key), timeout=5)
        assert (p.subject, p.project, p.role, p.key_id) == ("alice", "team", "member", made.key_id)
        listed = await stub.ListKeys(pb.ListKeysRequest(project="team"), timeout=5)
        assert [(k.key_id, k.name, k.revoked) for k in listed.keys] == [(made.key_id, "ci", False)]
        assert len((await stub.ListKeys(pb.ListKeysRequest(), timeout=5)).keys) == 2
        await stub.RevokeKey(pb.KeyRef(key_id=made.key_id), timeout=5)
        with pytest.raises(e.Unauthenticated):
            await stub.Authenticate(pb.AuthenticateRequest(api_key=made.api_key), timeout=5)
        with pytest.raises(e.NotFound):
            await stub.RevokeKey(pb.KeyRef(key_id="nosuchkey000"), timeout=5)
        with pytest.raises(e.InvalidArgument):
            await stub.CreateKey(pb.CreateKeyRequest(subject="x", project="team", role="god"))
        names = [p.name for p in (await stub.ListProjects(pb.Empty(), timeout=5)).projects]
        assert names == ["default", "team"]


@pytest.mark.asyncio
async def test_concurrent_admits_never_overcommit(iam: Iam) -> None:
    async with iam.channel("apiserver") as ch:
        stub = pb_grpc.IamStub(ch)
        await stub.PutProject(pb.Project(name="rl", max_sandboxes=400), timeout=5)
        for i in range(100):  # 100 already in use: 300 remain
            await stub.Admit(pb.AdmitRequest(project="rl", sandbox_id=sid("ab12", i)), timeout=5)

        refusals: list[str] = []

        async def admit(i: int) -> bool:
            req = pb.AdmitRequest(project="rl", sandbox_id=sid("ab12", 1000 + i), cpu=0.5)
            try:
                await stub.Admit(req, timeout=30)
            except e.QuotaExceeded as exc:
                refusals.append(exc.message)
                return False
            return True

        t0 = time.perf_counter()
        results = await asyncio.gather(*(admit(i) for i in range(500)))
        elapsed = time.perf_counter() - t0
        assert sum(results) == 300
        assert len(refusals) == 200
        assert all("max_sandboxes 400" in m for m in refusals)
        usage = await stub.GetUsage(pb.ProjectRef(project="rl"), timeout=5)
        assert (usage.sandboxes, usage.max_sandboxes) == (400, 400)
        assert usage.cpu == pytest.approx(150.0)
        print(f"\n500 concurrent Admit over mTLS: {elapsed:.2f} s, {500 / elapsed:.0f} admits/s")
        # Repeating an admitted id is a no-op, even at the limit.
        await stub.Admit(pb.AdmitRequest(project="rl", sandbox_id=sid("ab12", 0)), timeout=5)


@pytest.mark.asyncio
async def test_role_rules(iam: Iam) -> None:
    own, other = sid(iam.edge_id, 1), sid("zz00" if iam.edge_id != "zz00" else "zz01", 2)
    async with iam.channel("apiserver") as ch:
        stub = pb_grpc.IamStub(ch)
        for s in (own, other):
            await stub.Admit(pb.AdmitRequest(project="default", sandbox_id=s), timeout=5)
    async with iam.channel(iam.edge_id) as ch:
        edge = pb_grpc.IamStub(ch)
        with pytest.raises(e.PermissionDenied):
            await edge.Admit(pb.AdmitRequest(project="default", sandbox_id=own), timeout=5)
        with pytest.raises(e.PermissionDenied):
            await edge.Authenticate(pb.AuthenticateRequest(api_key="x"), timeout=5)
        with pytest.raises(e.PermissionDenied):
            await edge.Release(pb.ReleaseRequest(sandbox_id=other), timeout=5)
        with pytest.raises(e.PermissionDenied):
            await edge.Reconcile(pb.ReconcileRequest(edge_id="zz00"), timeout=5)
        await edge.Release(pb.ReleaseRequest(sandbox_id=own), timeout=5)
        await edge.Release(pb.ReleaseRequest(sandbox_id=own), timeout=5)  # idempotent
        reply = await edge.Reconcile(
            pb.ReconcileRequest(edge_id=iam.edge_id, live_sandbox_ids=[own]), timeout=5
        )
        assert (list(reply.unallocated), list(reply.moved)) == ([own], [])  # released above
    async with iam.channel("watcher") as ch:
        with pytest.raises(e.PermissionDenied):
            await pb_grpc.IamStub(ch).GetUsage(pb.ProjectRef(project="default"), timeout=5)
    async with iam.channel("admin") as ch:
        usage = await pb_grpc.IamStub(ch).GetUsage(pb.ProjectRef(project="default"), timeout=5)
        assert usage.sandboxes == 1


@pytest.mark.asyncio
async def test_restart_keeps_state_and_does_not_bootstrap_again(iam: Iam) -> None:
    token = (iam.home / "admin.key").read_text()
    await iam.app.stop()
    again = IamApp(IamConfig(iam.home, listen="127.0.0.1:0", metrics_listen=""))
    port = await again.start()
    try:
        assert (iam.home / "admin.key").read_text() == token
        async with secure_channel(iam.home / "pki", "apiserver", f"127.0.0.1:{port}") as ch:
            req = pb.AuthenticateRequest(api_key=token.strip())
            assert (await pb_grpc.IamStub(ch).Authenticate(req, timeout=5)).role == "admin"
    finally:
        await again.stop()


@pytest.mark.asyncio
async def test_metrics_endpoint(iam: Iam) -> None:
    async with iam.channel("apiserver") as ch:
        with pytest.raises(e.Unauthenticated):
            await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(api_key="x"), timeout=5)
    base = f"http://127.0.0.1:{iam.app.metrics_port}"
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{base}/metrics")).text
        assert (await http.get(f"{base}/healthz")).json() == {"ok": True}
    assert 'dsec_iam_authentications_total{result="refused"} 1' in text
    assert 'code="UNAUTHENTICATED",method="Iam/Authenticate"' in text


@pytest.mark.asyncio
async def test_authenticate_round_trip_latency(iam: Iam) -> None:
    token = (iam.home / "admin.key").read_text().strip()
    async with iam.channel("apiserver") as ch:
        stub = pb_grpc.IamStub(ch)
        req = pb.AuthenticateRequest(api_key=token)
        await stub.Authenticate(req, timeout=5)
        samples = []
        for _ in range(1000):
            t0 = time.perf_counter()
            await stub.Authenticate(req, timeout=5)
            samples.append(time.perf_counter() - t0)
    ms = sorted(s * 1000 for s in samples)
    print(
        f"\nAuthenticate over mTLS (SQLite lookup): median {statistics.median(ms):.3f} ms, "
        f"p99 {ms[989]:.3f} ms over 1000 sequential calls"
    )
    assert statistics.median(ms) < 50


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["unary", "stream", "unary: the iam has no stream"])
async def test_apiserver_batches_admissions_and_audit(
    iam: Iam, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    """500 concurrent creates' admissions and audit entries through the apiserver's
    IamBatch (as AdmitMany calls, or messages of its AdmitStream; an iam without the stream
    gets calls): exactly the remaining quota admitted, every entry chained, far fewer calls."""
    from dsec.apiserver import iam_batch
    from dsec.apiserver.iam_batch import IamBatch

    if via.startswith("unary: "):  # a method this iam does not serve: UNIMPLEMENTED
        monkeypatch.setattr(iam_batch, "METHOD", "/dsec.v1.Iam/AdmitStreamOfTheFuture")
    plain = secure_channel(iam.home / "pki", "apiserver", iam.target, translate=False)
    async with iam.channel("apiserver") as ch, plain:
        stub = pb_grpc.IamStub(ch)
        await stub.PutProject(pb.Project(name="rl", max_sandboxes=400), timeout=5)
        for i in range(100):
            await stub.Admit(pb.AdmitRequest(project="rl", sandbox_id=sid("ab12", i)), timeout=5)
        calls = 0
        real = stub.AdmitMany

        def counting(*args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(stub, "AdmitMany", counting)
        batch = IamBatch(stub, channel=None if via == "unary" else plain)
        refusals: list[str] = []

        async def create(i: int) -> str:
            req = pb.AdmitRequest(project="rl", sandbox_id=sid("ab12", 1000 + i), cpu=0.5)
            try:
                await batch.admit(req)
                result = "ok"
            except e.QuotaExceeded as exc:
                refusals.append(exc.message)
                result = exc.code
            await batch.audit(pb.AuditEntry(action="sandbox.create", project="rl",
                                            target=req.sandbox_id, result=result,
                                            actor="alice (key k1)"))  # fmt: skip
            return result

        results = await asyncio.gather(*(create(i) for i in range(500)))
        assert results.count("ok") == 300
        assert results.count("quota_exceeded") == 200
        assert all("max_sandboxes 400" in m for m in refusals)
        assert batch.calls < 250, batch.calls  # two items per create, coalesced
        assert calls == (0 if via == "stream" else batch.calls)
        usage = await stub.GetUsage(pb.ProjectRef(project="rl"), timeout=5)
        assert usage.sandboxes == 400
        got = await stub.QueryAudit(pb.AuditQuery(action="sandbox.create", limit=1000), timeout=5)
        assert len(got.entries) == 500
        assert {x.actor for x in got.entries} == {
            "alice (key k1) via spiffe://dsec/apiserver/apiserver"
        }
        assert sorted(x.result for x in got.entries) == sorted(results)
        verdict = await stub.VerifyAudit(pb.Empty(), timeout=30)
        assert verdict.broken_at == 0
        # A project that does not exist: that admission fails alone, with its own error.
        bad = batch.admit(pb.AdmitRequest(project="nope", sandbox_id=sid("ab12", 9000)))
        good = batch.admit(pb.AdmitRequest(project="rl", sandbox_id=sid("ab12", 0)))
        out = await asyncio.gather(bad, good, return_exceptions=True)
        assert isinstance(out[0], e.NotFound)
        assert out[1] is None
        await batch.aclose()


@pytest.mark.asyncio
async def test_admission_stream_is_authorized_and_reopened_after_it_broke(iam: Iam) -> None:
    from dsec.apiserver.iam_batch import IamBatch

    def plain(name: str) -> grpc.aio.Channel:
        return secure_channel(iam.home / "pki", name, iam.target, translate=False)

    async with plain("apiserver") as ch, plain(iam.edge_id) as edge_ch:
        stub = pb_grpc.IamStub(ch)
        await stub.PutProject(pb.Project(name="rl", max_sandboxes=10), timeout=5)
        # an edge may not admit (the stream is refused as a call would be), nor by calls
        for refused in (IamBatch(pb_grpc.IamStub(edge_ch), channel=edge_ch),
                        IamBatch(pb_grpc.IamStub(edge_ch))):  # fmt: skip
            with pytest.raises(e.PermissionDenied, match=f"edge/{iam.edge_id}"):
                await refused.admit(pb.AdmitRequest(project="rl", sandbox_id=sid("ab12", 1)))
        batch = IamBatch(stub, channel=ch)
        assert batch._kept is not None
        await batch.admit(pb.AdmitRequest(project="rl", sandbox_id=sid("ab12", 1)))
        first = batch._kept.current
        assert first is not None
        assert not first.broken
        first.call.cancel()  # the stream breaks (a lost connection, the iam restarting)
        await auntil(lambda: first.broken, "the stream broken", 5)
        assert first.broken
        await batch.admit(pb.AdmitRequest(project="rl", sandbox_id=sid("ab12", 2)))
        assert batch._kept.current is not None
        assert batch._kept.current is not first  # a new one
        with pytest.raises(e.QuotaExceeded):  # the iam's refusals come back as its errors
            await asyncio.gather(*(batch.admit(pb.AdmitRequest(
                project="rl", sandbox_id=sid("ab12", 10 + i))) for i in range(9)))  # fmt: skip
        assert (await stub.GetUsage(pb.ProjectRef(project="rl"), timeout=5)).sandboxes == 10
        await batch.aclose()
