"""The iam's Ca service and a member's CertRenewer, through a real iam on loopback (mTLS)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from cryptography import x509

from dsec.core.errors import InvalidState, PermissionDenied, Unauthenticated
from dsec.iam import ca_rpcs
from dsec.iam.app import IamApp, IamConfig
from dsec.rpc import reload, trust
from dsec.rpc._gen import ca_pb2 as pb
from dsec.rpc._gen import ca_pb2_grpc as pb_grpc
from dsec.rpc._gen import dsec_pb2 as dpb
from dsec.rpc._gen import dsec_pb2_grpc as dpb_grpc
from dsec.rpc.client import secure_channel
from dsec.rpc.renewal import CertRenewer
from dsec.rpc.tls import Identity, ensure_pki


@dataclass
class Setup:
    ca_pki: Path  # the iam's, with the CA key
    edge_pki: Path  # a member's copy: bundle and its own leaf only
    target: str


@pytest_asyncio.fixture
async def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Setup]:
    monkeypatch.setattr(ca_rpcs, "SETTLE_S", 0.3)
    monkeypatch.setattr(reload, "CHECK_EVERY_S", 0.0)
    home = tmp_path / "iam"
    ensure_pki(home / "pki", [Identity.singleton("iam"), Identity.singleton("admin"),
                              Identity.edge("ed01", ["node1.example"])])  # fmt: skip
    edge = tmp_path / "edge" / "pki"
    edge.mkdir(parents=True)
    for f in ("ca.crt", "ed01.crt", "ed01.key"):
        shutil.copy2(home / "pki" / f, edge / f)
    app = IamApp(IamConfig(home, listen="127.0.0.1:0", metrics_listen=""))
    port = await app.start()
    try:
        yield Setup(home / "pki", edge, f"127.0.0.1:{port}")
    finally:
        await app.stop()


def _admin(s: Setup) -> grpc.aio.Channel:
    return secure_channel(s.ca_pki, "admin", s.target, server=Identity.singleton("iam"))


@pytest.mark.asyncio
async def test_a_member_moves_to_the_new_ca_only_after_everyone_trusts_it(setup: Setup) -> None:
    s = setup
    edge_ch = secure_channel(s.edge_pki, "ed01", s.target, server=Identity.singleton("iam"))
    renewer = CertRenewer(s.edge_pki, "ed01", edge_ch)
    async with _admin(s) as admin_ch, edge_ch:
        ca = pb_grpc.CaStub(admin_ch)
        assert not await renewer.check()  # idle: nothing to change
        old_leaf = (s.edge_pki / "ed01.crt").read_bytes()
        st = await ca.Rotate(pb.CaRotateRequest(), timeout=10)
        assert st.phase == "distributing"
        with pytest.raises(InvalidState, match="already in progress"):
            await ca.Rotate(pb.CaRotateRequest(), timeout=10)
        assert await renewer.check()  # the two-CA bundle arrives; no renewal yet
        assert (s.edge_pki / "ed01.crt").read_bytes() == old_leaf
        with pytest.raises(InvalidState, match="edge/ed01"):
            await ca.Finish(pb.CaFinishRequest(), timeout=10)
        assert not await renewer.check()  # reports that it trusts the new CA: wait SETTLE_S
        assert renewer.renewals == 0
        await asyncio.sleep(0.4)  # everyone has trusted the new CA long enough
        assert await renewer.check()  # renewed now
        view = trust.local_view(s.edge_pki, "ed01")
        assert view.leaf_issuer == st.signing
        assert renewer.renewals == 1
        await renewer.check()  # reports the new certificate on the reloaded channel
        st = await ca.Status(pb.CaStatusRequest(), timeout=10)
        assert st.phase == "ready", st
        renewed = x509.load_pem_x509_certificate((s.edge_pki / "ed01.crt").read_bytes())
        assert ca_rpcs.extra_sans(renewed, Identity.edge("ed01")) == ("node1.example",)
        done = await ca.Finish(pb.CaFinishRequest(), timeout=10)
        assert done.phase == "idle"
        assert not done.old
        await renewer.check()
        assert trust.local_view(s.edge_pki, "ed01").trusted == (st.signing,)


@pytest.mark.asyncio
async def test_members_may_not_rotate_and_force_finishes_past_laggards(setup: Setup) -> None:
    s = setup
    edge_ch = secure_channel(s.edge_pki, "ed01", s.target, server=Identity.singleton("iam"))
    async with _admin(s) as admin_ch, edge_ch:
        with pytest.raises(PermissionDenied):
            await pb_grpc.CaStub(edge_ch).Rotate(pb.CaRotateRequest(), timeout=10)
        renewer = CertRenewer(s.edge_pki, "ed01", edge_ch)
        await renewer.check()
        ca = pb_grpc.CaStub(admin_ch)
        await ca.Rotate(pb.CaRotateRequest(), timeout=10)
        old = {f: (s.edge_pki / f).read_bytes() for f in ("ca.crt", "ed01.crt", "ed01.key")}
        done = await ca.Finish(pb.CaFinishRequest(force=True), timeout=10)
        assert done.phase == "idle"
    # The edge still holds its old certificate: the iam refuses it now.
    laggard = grpc.ssl_channel_credentials(
        (s.ca_pki / "ca.crt").read_bytes(), old["ed01.key"], old["ed01.crt"]
    )
    opts = [("grpc.ssl_target_name_override", Identity.singleton("iam").dns_name)]
    async with grpc.aio.secure_channel(s.target, laggard, options=opts) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await dpb_grpc.IamStub(ch).Release(dpb.ReleaseRequest(sandbox_id="x"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails
    # Its renewer says what to do about it.
    async with secure_channel(s.edge_pki, "ed01", s.target, server=Identity.singleton("iam")) as ch:
        with pytest.raises(Unauthenticated, match="join again"):
            await CertRenewer(s.edge_pki, "ed01", ch).check()
