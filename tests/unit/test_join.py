"""Joining a node: bootstrap token -> CSR -> certificate from the cluster CA, over TLS."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography import x509

from dsec.core import errors as e
from dsec.edge.join import join_cluster
from dsec.iam.app import IamApp, IamConfig
from dsec.rpc import join
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.client import secure_channel
from dsec.rpc.tls import ensure_node_pki


@pytest_asyncio.fixture
async def iam(tmp_path: Path) -> AsyncIterator[IamApp]:
    ensure_node_pki(tmp_path / "iam")
    app = IamApp(IamConfig(tmp_path / "iam", listen="127.0.0.1:0", metrics_listen="",
                           join_listen="127.0.0.1:0"))  # fmt: skip
    await app.start()
    yield app
    await app.stop()


async def _token(app: IamApp, ttl: int = 600) -> str:
    pki = app.config.pki_dir
    async with secure_channel(pki, "admin", f"127.0.0.1:{app.port}") as ch:
        got = await pb_grpc.IamStub(ch).CreateJoinToken(
            pb.CreateJoinTokenRequest(ttl_s=ttl), timeout=5
        )
    return got.token


@pytest.mark.asyncio
async def test_join_issues_a_certificate_for_a_key_that_stays_on_the_node(
    iam: IamApp, tmp_path: Path
) -> None:
    token = await _token(iam)
    assert join.ca_fingerprint((iam.config.pki_dir / "ca.crt").read_bytes()) in token
    node = tmp_path / "node"
    addr = f"127.0.0.1:{iam.join_port}"
    edge_id = await join_cluster(node, token, addr, sans=["10.1.2.3"])
    cert = x509.load_pem_x509_certificate((node / "pki" / f"{edge_id}.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((iam.config.pki_dir / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"spiffe://dsec/edge/{edge_id}" in sans.get_values_for_type(
        x509.UniformResourceIdentifier
    )
    assert stat.S_IMODE((node / "pki" / f"{edge_id}.key").stat().st_mode) == 0o600
    assert not (iam.config.pki_dir / f"{edge_id}.key").exists()  # the key never left the node
    # The node can now call the iam over mTLS as that edge.
    async with secure_channel(node / "pki", edge_id, f"127.0.0.1:{iam.port}") as ch:
        await pb_grpc.IamStub(ch).Reconcile(
            pb.ReconcileRequest(edge_id=edge_id, live_sandbox_ids=[]), timeout=5
        )
    # One time only; the same id cannot join twice.
    with pytest.raises(e.Unauthenticated, match="used"):
        await join_cluster(tmp_path / "again", token, addr)
    with pytest.raises(e.AlreadyExists):
        await join_cluster(tmp_path / "dup", await _token(iam), addr, edge_id=edge_id)


@pytest.mark.asyncio
async def test_join_refuses_bad_tokens_and_impostors(iam: IamApp, tmp_path: Path) -> None:
    addr = f"127.0.0.1:{iam.join_port}"
    token = await _token(iam)
    tid, secret, fp = join.parse_token(token)
    with pytest.raises(e.Unauthenticated):
        await join_cluster(tmp_path / "a", join.format_token(tid, "x" * 43, fp), addr)
    with pytest.raises(e.Unauthenticated, match="CA hash"):
        await join_cluster(tmp_path / "b", join.format_token(tid, secret, "0" * 64), addr)
    with pytest.raises(e.InvalidArgument):
        await join_cluster(tmp_path / "c", "nonsense", addr)
    assert not (tmp_path / "b" / "pki").exists()
    expired = await _token(iam, ttl=1)
    await asyncio.sleep(1.2)
    with pytest.raises(e.Unauthenticated, match="expired"):
        await join_cluster(tmp_path / "d", expired, addr)
    await join_cluster(tmp_path / "ok", token, addr)  # the real one still works
