"""The watcher daemon through its real gRPC server on loopback (mTLS, temp home)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio

from dsec.core import errors as e
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.client import secure_channel
from dsec.rpc.tls import Identity, ensure_node_pki, ensure_pki
from dsec.watcher.app import WatcherApp, WatcherConfig


@dataclass
class Watcher:
    app: WatcherApp
    home: Path
    edge_id: str
    target: str

    def channel(self, name: str) -> grpc.aio.Channel:
        return secure_channel(self.home / "pki", name, self.target, component="watcher")


def _config(home: Path, timeout_s: float) -> WatcherConfig:
    return WatcherConfig(
        home, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", health_timeout_s=timeout_s
    )


@pytest_asyncio.fixture
async def watcher(tmp_path: Path) -> AsyncIterator[Watcher]:
    edge_id = ensure_node_pki(tmp_path)
    app = WatcherApp(_config(tmp_path, 2.0))
    port = await app.start()
    try:
        yield Watcher(app, tmp_path, edge_id, f"127.0.0.1:{port}")
    finally:
        await app.stop()


@pytest.mark.asyncio
async def test_report_then_list_then_silence(watcher: Watcher) -> None:
    status = pb.EdgeStatus(edge_id=watcher.edge_id, address="127.0.0.1:8423", sandboxes=2)
    async with watcher.channel(watcher.edge_id) as ch:
        await pb_grpc.WatcherStub(ch).Report(status, timeout=5)
    async with watcher.channel("apiserver") as ch:
        stub = pb_grpc.WatcherStub(ch)
        (view,) = (await stub.ListEdges(pb.Empty(), timeout=5)).edges
        assert (view.status.edge_id, view.status.sandboxes, view.healthy) == (
            watcher.edge_id,
            2,
            True,
        )
        assert view.last_seen > 0
        await asyncio.sleep(2.5)  # longer than the 2 s timeout
        (view,) = (await stub.ListEdges(pb.Empty(), timeout=5)).edges
        assert view.status.edge_id == watcher.edge_id
        assert not view.healthy
    text = watcher.app.metrics.render()
    assert "dsec_watcher_edges 1" in text
    assert "dsec_watcher_edges_healthy 0" in text


@pytest.mark.asyncio
async def test_edge_may_only_report_for_itself(watcher: Watcher) -> None:
    other = "zz00" if watcher.edge_id != "zz00" else "zz01"
    ensure_pki(watcher.home / "pki", [Identity.edge(other)])
    async with watcher.channel(other) as ch:
        stub = pb_grpc.WatcherStub(ch)
        with pytest.raises(e.PermissionDenied, match=other):
            await stub.Report(pb.EdgeStatus(edge_id=watcher.edge_id), timeout=5)
        await stub.Report(pb.EdgeStatus(edge_id=other), timeout=5)
        with pytest.raises(e.PermissionDenied):
            await stub.ListEdges(pb.Empty(), timeout=5)
    for name in ("apiserver", "admin", "iam"):
        async with watcher.channel(name) as ch:
            with pytest.raises(e.PermissionDenied):
                await pb_grpc.WatcherStub(ch).Report(pb.EdgeStatus(edge_id=other), timeout=5)
    async with watcher.channel("admin") as ch:
        edges = (await pb_grpc.WatcherStub(ch).ListEdges(pb.Empty(), timeout=5)).edges
        assert [v.status.edge_id for v in edges] == [other]


@pytest.mark.asyncio
async def test_restart_lists_silent_edges_as_unhealthy(watcher: Watcher) -> None:
    async with watcher.channel(watcher.edge_id) as ch:
        await pb_grpc.WatcherStub(ch).Report(pb.EdgeStatus(edge_id=watcher.edge_id), timeout=5)
    await watcher.app.stop()
    assert (watcher.home / "watcher.json").exists()
    again = WatcherApp(_config(watcher.home, 60))
    port = await again.start()
    try:
        async with secure_channel(watcher.home / "pki", "admin", f"127.0.0.1:{port}") as ch:
            (view,) = (await pb_grpc.WatcherStub(ch).ListEdges(pb.Empty(), timeout=5)).edges
        assert view.status.edge_id == watcher.edge_id
        assert not view.healthy
    finally:
        await again.stop()


@pytest.mark.asyncio
async def test_sweep_logs_and_metrics_endpoint(
    watcher: Watcher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dsec.watcher")
    async with watcher.channel(watcher.edge_id) as ch:
        await pb_grpc.WatcherStub(ch).Report(pb.EdgeStatus(edge_id=watcher.edge_id), timeout=5)
    watcher.app.sweep()
    await asyncio.sleep(2.5)  # longer than the 2 s timeout
    watcher.app.sweep()
    messages = [r.getMessage() for r in caplog.records if r.name == "dsec.watcher"]
    assert messages[-2:] == ["edge healthy", "edge unhealthy"]
    base = f"http://127.0.0.1:{watcher.app.metrics_port}"
    async with httpx.AsyncClient() as http:
        resp = await http.get(f"{base}/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    assert "dsec_watcher_edges_healthy 0" in resp.text
