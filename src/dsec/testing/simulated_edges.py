"""SIMULATED edges, for the scale benchmark (``bench/cluster.py``) only.

Each simulated edge is a real ``dsec.v1.Edge`` gRPC server with its own mTLS identity (a
leaf of the cluster CA) that reports heartbeats to the watcher like a real edge and keeps
the final say on admission: it reserves CPU and memory against its capacity and answers
"node full" when a sandbox does not fit. It runs no sandboxes: a create only books the
resources and returns a running SandboxInfo; a kill frees them. Creates come the way they
come to a real edge: on the apiserver's kept ``CreateStream``, served by the real edge's
code (:class:`dsec.edge.create_stream.CreateStreamServicer`) over this ``CreateSandbox``.
Many of them share one process (``python -m dsec.testing.simulated_edges``), so 100 edges
fit on a laptop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from dsec.core.errors import InvalidArgument, NodeFull, SandboxNotFound
from dsec.core.ids import RANDOM_BYTES, edge_of, new_sandbox_id
from dsec.edge.create_stream import CreateStreamServicer
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.client import secure_channel
from dsec.rpc.server import make_server, server_port

HEARTBEAT_S = 2.0
_Ctx = grpc.aio.ServicerContext[Any, Any]


@dataclass
class SimulatedEdge(CreateStreamServicer):
    """One simulated edge's books: what it has reserved, against what it has."""

    edge_id: str
    address: str = ""
    cpu_total: float = 64.0
    memory_total_mb: int = 256 * 1024
    max_sandboxes: int = 5000
    sandboxes: dict[str, pb.SandboxInfo] = field(default_factory=dict)
    cpu_used: float = 0.0
    memory_used_mb: int = 0
    started: float = field(default_factory=time.time)

    def preload(self, count: int, project: str, cpu: float, memory_mb: int) -> list[str]:
        """Book ``count`` sandboxes that are already running; returns their ids."""
        ids = []
        spec = pb.SandboxSpec(cpu=cpu, memory_mb=memory_mb)
        for _ in range(count):
            sid = new_sandbox_id(self.edge_id, os.urandom(RANDOM_BYTES))
            self._book(sid, spec, project, "preloaded")
            ids.append(sid)
        return ids

    def _book(self, sid: str, spec: pb.SandboxSpec, project: str, owner: str) -> pb.SandboxInfo:
        now = time.time()
        info = pb.SandboxInfo(id=sid, project=project, owner=owner, state="running", spec=spec,
                              edge_id=self.edge_id, created_at=now, started_at=now)  # fmt: skip
        self.sandboxes[sid] = info
        self.cpu_used += spec.cpu
        self.memory_used_mb += spec.memory_mb
        return info

    def status(self) -> pb.EdgeStatus:
        return pb.EdgeStatus(
            edge_id=self.edge_id, address=self.address, sandboxes=len(self.sandboxes),
            cpu_total=self.cpu_total, cpu_allocated=self.cpu_used,
            memory_total_mb=self.memory_total_mb, memory_allocated_mb=self.memory_used_mb,
            backends=["container"], version="simulated", started_at=self.started,
            disk_free_mb=1 << 20,
        )  # fmt: skip

    async def CreateSandbox(
        self, request: pb.CreateSandboxRequest, context: _Ctx
    ) -> pb.SandboxInfo:
        if edge_of(request.sandbox_id) != self.edge_id:
            raise InvalidArgument(f"sandbox {request.sandbox_id} is not for edge {self.edge_id}")
        if request.sandbox_id in self.sandboxes:
            return self.sandboxes[request.sandbox_id]
        spec = request.spec
        if (len(self.sandboxes) >= self.max_sandboxes
                or self.memory_used_mb + spec.memory_mb > self.memory_total_mb * 4
                or self.cpu_used + spec.cpu > self.cpu_total * 16):  # fmt: skip
            raise NodeFull(f"simulated edge {self.edge_id} is full")
        return self._book(request.sandbox_id, spec, request.project, request.owner)

    async def GetSandbox(self, request: pb.SandboxRef, context: _Ctx) -> pb.SandboxInfo:
        info = self.sandboxes.get(request.sandbox_id)
        if info is None:
            raise SandboxNotFound(f"no sandbox {request.sandbox_id}")
        return info

    async def KillSandbox(self, request: pb.SandboxRef, context: _Ctx) -> pb.SandboxInfo:
        info = await self.GetSandbox(request, context)
        del self.sandboxes[request.sandbox_id]
        self.cpu_used -= info.spec.cpu
        self.memory_used_mb -= info.spec.memory_mb
        return pb.SandboxInfo(**{**_fields(info), "state": "killed"})

    async def ListSandboxes(
        self, request: pb.ListSandboxesRequest, context: _Ctx
    ) -> pb.SandboxList:
        return pb.SandboxList(sandboxes=[])  # 100k entries are not the point of the benchmark

    async def Status(self, request: pb.Empty, context: _Ctx) -> pb.EdgeStatus:
        return self.status()


def _fields(info: pb.SandboxInfo) -> dict[str, Any]:
    return {f.name: getattr(info, f.name) for f in info.DESCRIPTOR.fields if f.name != "state"}


async def run(pki: Path, edge_ids: list[str], watcher: str, preload: int,
              stop: asyncio.Event) -> None:  # fmt: skip
    # The servicer implements only the calls the control plane makes (no runtime calls).
    edges = [SimulatedEdge(e) for e in edge_ids]  # type: ignore[abstract]
    servers = []
    for e in edges:
        e.preload(preload, "bench/preloaded", 0.1, 64)
        server = make_server(pki, e.edge_id, "127.0.0.1:0",
                             allowed_roles={"dsec.v1.Edge": {"apiserver", "admin"}})  # fmt: skip
        pb_grpc.add_EdgeServicer_to_server(e, server)
        await server.start()
        e.address = f"127.0.0.1:{server_port(server)}"
        servers.append(server)
    # heartbeats' failures are ignored, so their channels skip the error-translating
    # interceptor (a task and ~0.2 ms of CPU per call, 50 calls a second for 100 edges)
    channels = [secure_channel(pki, e.edge_id, watcher, translate=False) for e in edges]
    stubs = [pb_grpc.WatcherStub(ch) for ch in channels]

    async def heartbeats() -> None:
        while not stop.is_set():
            await asyncio.gather(
                *(s.Report(e.status(), timeout=5) for s, e in zip(stubs, edges, strict=True)),
                return_exceptions=True,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEARTBEAT_S)

    beat = asyncio.create_task(heartbeats())
    try:
        await stop.wait()
    finally:
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        for e in edges:
            e.refuse_creates(f"simulated edge {e.edge_id} is shutting down")
        for s in servers:
            await s.stop(1)
        for ch in channels:
            await ch.close()


def main(argv: list[str] | None = None) -> int:
    from dsec.daemon import run_daemon

    ap = argparse.ArgumentParser(prog="dsec-simulated-edges")
    ap.add_argument("--pki", type=Path, required=True, help="holds ca.crt and <edge id>.crt/.key")
    ap.add_argument("--edges", required=True, help="comma-separated edge ids")
    ap.add_argument("--watcher", required=True)
    ap.add_argument("--preload", type=int, default=0, help="running sandboxes per edge at start")
    args = ap.parse_args(argv)
    ids = [e for e in args.edges.split(",") if e]
    return run_daemon(
        "simulated-edges",
        lambda stop: run(args.pki, ids, args.watcher, args.preload, stop),
        log_level="WARNING",
    )


if __name__ == "__main__":
    sys.exit(main())
