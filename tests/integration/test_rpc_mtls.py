"""A real grpc.aio server on 127.0.0.1 with certificates from ensure_pki: who gets in, who
is refused, and how errors cross the wire. Needs only loopback (no root)."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from dsec.core import errors as e
from dsec.core.errors import ERRORS_BY_CODE
from dsec.obs import Metrics
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.client import secure_channel
from dsec.rpc.errors import CODE_KEY, translated
from dsec.rpc.options import (
    CLIENT_KEEPALIVE_MS,
    MIN_PING_INTERVAL_MS,
    client_options,
    server_options,
)
from dsec.rpc.server import make_server, peer_identity, server_port
from dsec.rpc.tls import (
    Identity,
    channel_credentials,
    default_identities,
    ensure_pki,
    read_pki,
    server_credentials,
)

ALLOWED = {
    "dsec.v1.Iam": {"apiserver"},
    "/dsec.v1.Iam/Authenticate": {"apiserver", "admin"},
    "dsec.v1.Edge": {"apiserver"},
}


class FakeIam(pb_grpc.IamServicer):
    async def Authenticate(self, request: pb.AuthenticateRequest, context: Any) -> pb.Principal:
        peer = peer_identity(context)
        return pb.Principal(subject=peer.spiffe_id, role=peer.role, key_id=peer.name)

    async def GetUsage(self, request: pb.ProjectRef, context: Any) -> pb.Usage:
        cls = ERRORS_BY_CODE[request.project]
        raise cls(f"raised {cls.__name__} - with ünïcode")

    async def ListKeys(self, request: pb.ListKeysRequest, context: Any) -> pb.KeyList:
        raise RuntimeError("a bug in the handler")


class FakeEdge(pb_grpc.EdgeServicer):
    async def Stream(
        self, request_iterator: AsyncIterator[pb.RuntimeFrame], context: Any
    ) -> AsyncIterator[pb.RuntimeFrame]:
        async for frame in request_iterator:
            if frame.kind == 0:
                raise e.ProcessNotFound("no process 42")
            yield pb.RuntimeFrame(sandbox_id=frame.sandbox_id, kind=frame.kind, data=b"echo")


@dataclass
class Served:
    pki: Path
    target: str
    metrics: Metrics


@pytest_asyncio.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    pki = tmp_path / "pki"
    ensure_pki(pki, default_identities("ab12"))
    metrics = Metrics("test")
    server = make_server(pki, "iam", "127.0.0.1:0", ALLOWED, metrics=metrics)
    # The fakes implement only what the tests call; the rest answer UNIMPLEMENTED.
    pb_grpc.add_IamServicer_to_server(FakeIam(), server)  # type: ignore[abstract]
    pb_grpc.add_EdgeServicer_to_server(FakeEdge(), server)  # type: ignore[abstract]
    await server.start()
    try:
        yield Served(pki, f"127.0.0.1:{server_port(server)}", metrics)
    finally:
        await server.stop(None)


@pytest.mark.asyncio
async def test_allowed_role_gets_in_and_handler_sees_peer(served: Served) -> None:
    async with secure_channel(served.pki, "apiserver", served.target) as ch:
        got = await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(), timeout=5)
    assert got.subject == "spiffe://dsec/apiserver/apiserver"
    async with secure_channel(served.pki, "admin", served.target) as ch:
        got = await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(), timeout=5)
    assert (got.role, got.key_id) == ("admin", "admin")
    assert (
        'test_rpc_requests_total{code="OK",method="Iam/Authenticate"} 2' in served.metrics.render()
    )


@pytest.mark.asyncio
async def test_other_role_is_permission_denied(served: Served) -> None:
    async with secure_channel(served.pki, "ab12", served.target) as ch:
        with pytest.raises(e.PermissionDenied, match="spiffe://dsec/edge/ab12"):
            await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(), timeout=5)
    # A method entry overrides the service entry: admin may Authenticate but not GetUsage.
    async with secure_channel(served.pki, "admin", served.target) as ch:
        with pytest.raises(e.PermissionDenied):
            await pb_grpc.IamStub(ch).GetUsage(pb.ProjectRef(project="not_found"), timeout=5)
    # On the wire it is PERMISSION_DENIED with the exact code in the trailers.
    ca, key, cert = read_pki(served.pki, "ab12")
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    async with grpc.aio.secure_channel(served.target, creds) as raw:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.IamStub(raw).Authenticate(pb.AuthenticateRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (CODE_KEY, "permission_denied") in tuple(info.value.trailing_metadata() or ())


@pytest.mark.asyncio
async def test_client_without_cert_cannot_connect(served: Served) -> None:
    ca, _, _ = read_pki(served.pki, "apiserver")
    creds = grpc.ssl_channel_credentials(root_certificates=ca)
    async with grpc.aio.secure_channel(served.target, creds) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.asyncio
async def test_client_cert_from_another_ca_cannot_connect(served: Served, tmp_path: Path) -> None:
    other = tmp_path / "other-pki"
    ensure_pki(other, [Identity.singleton("apiserver")])
    ca, _, _ = read_pki(served.pki, "apiserver")
    _, key, cert = read_pki(other, "apiserver")
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
    async with grpc.aio.secure_channel(served.target, creds) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # And a client of the other CA does not trust our server either.
    async with secure_channel(other, "apiserver", served.target) as ch:
        with pytest.raises(e.Unavailable):
            await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(), timeout=5)


@pytest.mark.asyncio
async def test_client_can_pin_the_server_identity(served: Served) -> None:
    iam = Identity.singleton("iam")
    async with secure_channel(served.pki, "apiserver", served.target, server=iam) as ch:
        await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(), timeout=5)
    watcher = Identity.singleton("watcher")
    async with secure_channel(served.pki, "apiserver", served.target, server=watcher) as ch:
        with pytest.raises(e.Unavailable, match="watcher"):
            await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(), timeout=5)


@pytest.mark.asyncio
async def test_every_error_class_crosses_the_wire(served: Served) -> None:
    async with secure_channel(served.pki, "apiserver", served.target) as ch:
        stub = pb_grpc.IamStub(ch)
        for code, cls in sorted(ERRORS_BY_CODE.items()):
            with pytest.raises(e.DsecError) as info:
                await stub.GetUsage(pb.ProjectRef(project=code), timeout=5)
            assert type(info.value) is cls, code
            assert info.value.message == f"raised {cls.__name__} - with ünïcode"


@pytest.mark.asyncio
async def test_unexpected_exception_is_internal_and_logged(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="dsec.rpc.server"):
        async with secure_channel(served.pki, "apiserver", served.target) as ch:
            with pytest.raises(e.Internal) as info:
                await pb_grpc.IamStub(ch).ListKeys(pb.ListKeysRequest(), timeout=5)
    assert "RuntimeError" in info.value.message
    assert "a bug in the handler" not in info.value.message  # details stay in the log
    assert any(r.exc_info and "a bug in the handler" in str(r.exc_info[1]) for r in caplog.records)


@pytest.mark.asyncio
async def test_streaming_handler_errors_translate(served: Served) -> None:
    # The client never writes after the server may have finished: with grpc.aio a write that
    # races the server's status can replace it with INTERNAL (grpc/grpc#36066).
    echoed = asyncio.Event()

    async def frames() -> AsyncIterator[pb.RuntimeFrame]:
        yield pb.RuntimeFrame(sandbox_id="s", kind=74)
        await echoed.wait()
        yield pb.RuntimeFrame(sandbox_id="s", kind=0)
        await asyncio.Event().wait()  # the server ends the call

    async def nothing() -> AsyncIterator[pb.RuntimeFrame]:
        await asyncio.Event().wait()
        yield pb.RuntimeFrame()  # not reached

    got: list[bytes] = []

    async def relay(ch: grpc.aio.Channel, requests: AsyncIterator[pb.RuntimeFrame]) -> None:
        async with translated("edge"):
            async for frame in pb_grpc.EdgeStub(ch).Stream(requests, timeout=5):
                got.append(frame.data)
                echoed.set()

    async with secure_channel(served.pki, "apiserver", served.target) as ch:
        with pytest.raises(e.ProcessNotFound, match="no process 42"):
            await relay(ch, frames())
    assert got == [b"echo"]
    async with secure_channel(served.pki, "ab12", served.target) as ch:
        with pytest.raises(e.PermissionDenied):
            await relay(ch, nothing())


@pytest.mark.asyncio
async def test_unreachable_peer_is_unavailable_naming_it(served: Served) -> None:
    async with secure_channel(served.pki, "apiserver", "127.0.0.1:1", component="iam") as ch:
        with pytest.raises(e.Unavailable, match=r"iam \(127\.0\.0\.1:1\) is unavailable"):
            await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(), timeout=2)


@pytest.mark.asyncio
async def test_bind_failure_is_unavailable(served: Served) -> None:
    with pytest.raises(e.Unavailable, match="cannot listen"):
        make_server(served.pki, "iam", served.target, ALLOWED)


@pytest.mark.asyncio
async def test_unary_round_trip_latency(served: Served) -> None:
    async with secure_channel(served.pki, "apiserver", served.target) as ch:
        stub = pb_grpc.IamStub(ch)
        await stub.Authenticate(pb.AuthenticateRequest(), timeout=5)
        samples = []
        for _ in range(1000):
            t0 = time.perf_counter()
            await stub.Authenticate(pb.AuthenticateRequest(api_key="x" * 60), timeout=5)
            samples.append(time.perf_counter() - t0)
    median_ms = statistics.median(samples) * 1000
    print(f"\nmTLS unary round trip (fake handler): median {median_ms:.3f} ms over 1000 calls")
    assert median_ms < 50


async def _stays_connected(pki: Path, keepalive_ms: int, floor_ms: int, idle_s: float) -> bool:
    """Idle a channel with these keepalive settings; did the server keep the connection?"""
    server = grpc.aio.server(options=server_options(min_ping_interval_ms=floor_ms))
    pb_grpc.add_IamServicer_to_server(FakeIam(), server)  # type: ignore[abstract]
    port = server.add_secure_port("127.0.0.1:0", server_credentials(pki, "iam"))
    await server.start()
    try:
        creds = channel_credentials(pki, "apiserver")
        opts = client_options(keepalive_ms=keepalive_ms)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=opts) as ch:
            await pb_grpc.IamStub(ch).Authenticate(pb.AuthenticateRequest(), timeout=5)
            deadline = time.monotonic() + idle_s
            while time.monotonic() < deadline:
                if ch.get_state() != grpc.ChannelConnectivity.READY:
                    return False
                await asyncio.sleep(0.02)
            return True
    finally:
        await server.stop(None)


@pytest.mark.asyncio
async def test_keepalive_settings_agree(served: Served) -> None:
    # The real settings scaled down 20x (gRPC will not ping much more often than once a
    # second): client pings every 1 s, server floor 0.5 s; three pings in 3.5 s are fine.
    assert CLIENT_KEEPALIVE_MS > MIN_PING_INTERVAL_MS
    assert await _stays_connected(served.pki, keepalive_ms=1000, floor_ms=500, idle_s=3.5)
    # Control: a client pinging more often than the server's floor is cut off after the
    # third ping (GOAWAY too_many_pings), as happened with gRPC's default 5-minute floor
    # (about 3 s in; it returns then, the 10 s leave a loaded machine room).
    assert not await _stays_connected(served.pki, keepalive_ms=1000, floor_ms=5000, idle_s=10)
