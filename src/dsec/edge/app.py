"""The edge daemon: wiring and periodic loops.

``python -m dsec.edge --home H --listen 127.0.0.1:8423 --watcher ADDR --iam ADDR``

On start it re-adopts every sandbox that survived its previous life; on SIGTERM it leaves
sandboxes running (a restarted edge adopts them again) unless ``--stop-sandboxes-on-exit``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

from dsec import __version__
from dsec.core.admission import NodeCapacity
from dsec.core.errors import DsecError
from dsec.core.lifecycle import State
from dsec.edge.backends.api import Backend
from dsec.edge.manager import SandboxManager
from dsec.edge.net.config import DEFAULT_POOL, NetConfig, edge_pool6
from dsec.edge.net.edgenet import EdgeNetwork
from dsec.edge.records import RecordStore
from dsec.edge.service import EdgeService
from dsec.obs import Metrics, log
from dsec.paths import Paths
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc

_log = logging.getLogger("dsec.edge")

HEARTBEAT_S = 2.0
REAP_S = 1.0
RECONCILE_S = 30.0


def raise_nofile_limit(target: int = 1 << 20) -> int:
    """Raise this process's open-files limit (sandboxes inherit at most it); return it."""
    import resource

    try:
        with open("/proc/sys/fs/nr_open") as f:
            target = min(target, int(f.read()))
    except (OSError, ValueError):
        pass
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for limit in (target, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            return limit
        except (ValueError, OSError):
            continue
    return soft


def node_capacity(args: argparse.Namespace) -> NodeCapacity:
    mem_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
                break
    return NodeCapacity(
        cpu_total=float(os.cpu_count() or 1),
        memory_total_mb=mem_kb // 1024,
        max_sandboxes=args.max_sandboxes,
        cpu_overcommit=args.cpu_overcommit,
        memory_overcommit=args.memory_overcommit,
    )


def candidate_backends(
    paths: Paths,
    edge_id: str,
    network: EdgeNetwork | None = None,
    vmm: str = "auto",
    cgroup_parent: str = "dsec",
) -> list[Backend]:
    """Every backend built into this edge, whether or not it can run on this host."""
    from dsec.edge.backends.container.backend import ContainerBackend
    from dsec.edge.backends.function.backend import FunctionBackend
    from dsec.edge.backends.microvm.backend import MicrovmBackend
    from dsec.edge.backends.vm.backend import VmBackend
    from dsec.edge.images.store import ImageStore

    store = ImageStore(paths.images)
    container = ContainerBackend(
        paths, edge_id, image_store=store, network=network, cgroup_parent=cgroup_parent
    )
    function = FunctionBackend(paths, edge_id, image_store=store, cgroup_parent=cgroup_parent)
    microvm = MicrovmBackend(
        paths, edge_id, image_store=store, vmm=vmm, network=network, cgroup_parent=cgroup_parent
    )
    fullvm = VmBackend(
        paths, edge_id, image_store=store, network=network, cgroup_parent=cgroup_parent
    )
    return [container, function, microvm, fullvm]


def make_backends(candidates: list[Backend]) -> dict[str, Backend]:
    """The candidates that can run here, by name (the others are logged with the reason)."""
    out: dict[str, Backend] = {}
    for backend in candidates:
        avail = backend.availability()
        if avail.available:
            out[backend.name] = backend
        else:
            log(_log, f"{backend.name} backend unavailable", logging.WARNING, reason=avail.reason)
    return out


def status_of(
    manager: SandboxManager,
    cap: NodeCapacity,
    address: str,
    started: float,
    paths: Paths,
    backends: dict[str, Backend],
) -> pb.EdgeStatus:
    load = manager.load()
    disk = shutil.disk_usage(paths.home)
    return pb.EdgeStatus(
        edge_id=manager.edge_id,
        address=address,
        sandboxes=load.sandboxes,
        cpu_total=cap.cpu_total,
        cpu_allocated=load.cpu,
        memory_total_mb=cap.memory_total_mb,
        memory_allocated_mb=load.memory_mb,
        backends=sorted(backends),
        version=__version__,
        started_at=started,
        disk_free_mb=disk.free // (1024 * 1024),
    )


async def _every(seconds: float, fn: object, stop: asyncio.Event, what: str) -> None:
    assert callable(fn)
    while not stop.is_set():
        try:
            await fn()
        except DsecError as exc:
            log(_log, f"{what} failed", logging.WARNING, error=exc.message, code=exc.code)
        except Exception:
            _log.exception("%s failed", what)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from dsec.daemon import serve_metrics
    from dsec.rpc.client import secure_channel
    from dsec.rpc.errors import translated
    from dsec.rpc.renewal import renew_forever
    from dsec.rpc.server import make_server
    from dsec.rpc.tls import ensure_edge_id

    paths = Paths.from_env(args.home)
    nofile = raise_nofile_limit()
    edge_id = args.edge_id or ensure_edge_id(paths.home)
    metrics = Metrics("dsec_edge")
    cap = node_capacity(args)
    network = make_network(args, paths, edge_id)
    real = args.backend == "real"
    candidates = (
        candidate_backends(paths, edge_id, network, args.vmm, args.cgroup_parent)
        if real
        else _fake()
    )
    backends = make_backends(candidates)
    if network is not None:
        for backend in backends.values():
            prepare = getattr(backend, "prepare", None)
            if prepare is not None:
                await prepare()
        await network.start()
    iam_ch = secure_channel(paths.pki, edge_id, args.iam)
    watcher_ch = secure_channel(paths.pki, edge_id, args.watcher)
    iam = pb_grpc.IamStub(iam_ch)
    watcher = pb_grpc.WatcherStub(watcher_ch)

    async def release(sandbox_id: str) -> None:
        async with translated("iam"):
            await iam.Release(pb.ReleaseRequest(sandbox_id=sandbox_id), timeout=10)

    records = RecordStore(paths.home / "edge" / "records.db")
    manager = SandboxManager(
        edge_id=edge_id,
        state_root=paths.home / "edge" / "sandboxes",
        socket_root=paths.run / "sbx",
        backends=backends,
        records=records,
        capacity=cap,
        metrics=metrics,
        on_ended=release,
    )
    await manager.adopt()
    started = time.time()

    def status() -> pb.EdgeStatus:
        return status_of(manager, cap, args.advertise or args.listen, started, paths, backends)

    server = make_server(
        paths.pki,
        edge_id,
        args.listen,
        allowed_roles={"dsec.v1.Edge": {"apiserver", "admin"}},
    )
    from dsec.edge.images.service import EdgeImages
    from dsec.edge.images.store import ImageStore

    images = EdgeImages(
        ImageStore(paths.images), edge_id, paths.home / "registries.json", vm_paths=paths
    )

    async def list_backends() -> pb.BackendList:
        from dsec.edge import backend_report

        reports = await asyncio.to_thread(backend_report.report, candidates, manager.create_times)
        return backend_report.to_pb(edge_id, reports)

    service = EdgeService(manager, status, images, list_backends=list_backends)
    pb_grpc.add_EdgeServicer_to_server(service, server)
    await server.start()
    metrics_runner = (
        await serve_metrics(metrics, *_split(args.metrics_listen)) if args.metrics_listen else None
    )
    log(
        _log,
        "edge listening",
        address=args.listen,
        edge_id=edge_id,
        nofile=nofile,
        backends=sorted(backends),
        adopted=len(manager.live_records()),
    )

    async def heartbeat() -> None:
        async with translated("watcher"):
            await watcher.Report(status(), timeout=5)

    async def reconcile() -> None:
        async with translated("iam"):
            live = manager.live_records()
            reply = await iam.Reconcile(
                pb.ReconcileRequest(
                    edge_id=edge_id,
                    live_sandbox_ids=[r.id for r in live],
                    running_sandbox_ids=[r.id for r in live if r.state is State.RUNNING],
                ),
                timeout=10,
            )
        moved = [(m.sandbox_id, m.moved_to) for m in reply.moved]
        await manager.settle(moved, list(reply.unallocated))

    loops = [
        asyncio.ensure_future(_every(HEARTBEAT_S, heartbeat, stop, "heartbeat")),
        asyncio.ensure_future(_every(REAP_S, manager.reap_expired, stop, "reaper")),
        asyncio.ensure_future(_every(RECONCILE_S, reconcile, stop, "reconcile")),
        asyncio.ensure_future(renew_forever(paths.pki, edge_id, args.iam, stop)),
    ]
    if network is not None:

        async def net_metrics() -> None:
            assert network is not None
            for sid, stats in (await network.counters()).items():
                for name, value in stats.items():
                    metrics.set(f"sandbox_network_{name}", value, sandbox=sid)

        loops.append(asyncio.ensure_future(_every(HEARTBEAT_S, net_metrics, stop, "net")))
    try:
        await stop.wait()
    finally:
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        service.refuse_creates(f"edge {edge_id} is shutting down")  # as stop() refuses calls
        await server.stop(grace=2)
        if args.stop_sandboxes_on_exit:
            await manager.stop_all("edge shut down")
        for backend in backends.values():
            close = getattr(backend, "close", None)
            if close is not None:  # the function pool (it would also stop with the edge)
                await close()
        # After the pool has closed: its cgroups would keep the shared parent from going.
        if args.stop_sandboxes_on_exit and not manager.live_records():
            if network is not None:
                await network.release()
            for backend in backends.values():
                await asyncio.to_thread(backend.release_host_setup)
        if network is not None:
            await network.close()
        manager.close()
        records.close()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        await iam_ch.close()
        await watcher_ch.close()
        log(_log, "edge stopped")


def _fake() -> list[Backend]:
    from dsec.testing.fake_backend import FakeBackend

    return [FakeBackend()]  # named "container", so specs need no change


def make_network(args: argparse.Namespace, paths: Paths, edge_id: str) -> EdgeNetwork | None:
    """The edge's sandbox networking, if ``--net-upstream-dns`` enables it."""
    if not args.net_upstream_dns:
        return None
    cfg = NetConfig(
        pool=args.net_pool,
        upstream_dns=args.net_upstream_dns,
        state_dir=paths.home / "edge" / "net",
        # below the sandboxes dir: that mount is shared into crun's namespace
        netns_dir=paths.home / "edge" / "sandboxes" / ".netns",
        gateway_netns=args.net_gateway_netns or None,
        dns_port=args.net_dns_port,
        warm=args.net_warm,
        pool6=edge_pool6(edge_id) if args.net_pool6 == "auto" else args.net_pool6,
    )
    return EdgeNetwork(edge_id, cfg)


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host or "127.0.0.1", int(port)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dsec-edge")
    ap.add_argument("--home", type=Path, default=None)
    ap.add_argument("--edge-id", default="")
    ap.add_argument("--listen", default="127.0.0.1:8423")
    ap.add_argument(
        "--advertise", default="", help="address the apiserver dials (default --listen)"
    )
    ap.add_argument("--metrics-listen", default="")
    ap.add_argument("--iam", default="127.0.0.1:8421")
    ap.add_argument("--watcher", default="127.0.0.1:8422")
    ap.add_argument("--max-sandboxes", type=int, default=2000)
    ap.add_argument("--cpu-overcommit", type=float, default=16.0)
    ap.add_argument("--memory-overcommit", type=float, default=4.0)
    ap.add_argument("--stop-sandboxes-on-exit", action="store_true")
    ap.add_argument(
        "--cgroup-parent",
        default="dsec",
        help="cgroup every sandbox's cgroup goes under (removed when empty at a stop "
        "with --stop-sandboxes-on-exit)",
    )
    ap.add_argument("--backend", choices=["real", "fake"], default="real",
                    help="fake: dsec.testing.fake_backend (tests and benchmarks only)")  # fmt: skip
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument(
        "--vmm",
        choices=("auto", "firecracker", "qemu"),
        default="auto",
        help="microVM driver: auto takes Firecracker where KVM runs guests, else QEMU",
    )
    net = ap.add_argument_group("sandbox networking (off unless --net-upstream-dns is set)")
    net.add_argument("--net-upstream-dns", default="", help="IPv4:PORT the resolver forwards to")
    net.add_argument("--net-pool", default=DEFAULT_POOL, help="private IPv4 pool, one /30 each")
    net.add_argument(
        "--net-gateway-netns", default="", help="netns file for host ends (default: the edge's)"
    )
    net.add_argument("--net-dns-port", type=int, default=53)
    net.add_argument("--net-warm", type=int, default=4, help="networks kept ready for creates")
    net.add_argument(
        "--net-pool6",
        default="",
        help="unique local IPv6 pool, one /126 each ('auto': a /64 derived from the edge id;"
        " default: sandboxes get no IPv6)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import sys

    from dsec.daemon import run_daemon

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["join"]:
        from dsec.edge.join import main as join_main

        sys.exit(join_main(argv[1:]))
    args = parse_args(argv)
    sys.exit(run_daemon("edge", lambda stop: serve(args, stop), log_level=args.log_level))
