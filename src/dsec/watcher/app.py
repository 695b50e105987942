"""Wiring of the watcher daemon: PKI, saved edge view, gRPC server, health sweeps, metrics.

:class:`WatcherApp` starts and stops the daemon inside a running event loop (tests use it
directly); :func:`serve` runs it until a stop event is set (``python -m dsec.watcher``).
Once a second a sweep logs every edge whose health changed and refreshes the gauges; the
view is saved to ``<home>/watcher.json`` when it changed, at most every few seconds, and
at stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web

from dsec.daemon import bound_port, parse_hostport, serve_metrics
from dsec.obs import Metrics, log
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.renewal import renew_forever
from dsec.rpc.server import make_server, server_port
from dsec.rpc.tls import Identity, ensure_pki
from dsec.watcher.registry import DEFAULT_TIMEOUT_S, EdgeRegistry
from dsec.watcher.service import ALLOWED_ROLES, WatcherService

_log = logging.getLogger("dsec.watcher")

DEFAULT_LISTEN = "127.0.0.1:8422"
DEFAULT_METRICS_LISTEN = "127.0.0.1:9422"
SWEEP_S = 1.0
SAVE_EVERY_S = 5.0
STOP_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class WatcherConfig:
    """Everything the watcher is told at start; empty ``metrics_listen`` disables metrics."""

    home: Path
    listen: str = DEFAULT_LISTEN
    metrics_listen: str = DEFAULT_METRICS_LISTEN
    health_timeout_s: float = DEFAULT_TIMEOUT_S
    iam: str = ""  # where to renew our certificate during a CA rotation (empty: never)

    @property
    def state_path(self) -> Path:
        return self.home / "watcher.json"

    @property
    def pki_dir(self) -> Path:
        return self.home / "pki"


class WatcherApp:
    """The running watcher daemon."""

    def __init__(self, config: WatcherConfig) -> None:
        self.config = config
        self.metrics = Metrics("dsec_watcher")
        self.registry = EdgeRegistry(config.health_timeout_s)
        self.service = WatcherService(self.registry, metrics=self.metrics)
        self.port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bring the daemon up; returns the gRPC port it listens on."""
        cfg = self.config
        cfg.home.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(ensure_pki, cfg.pki_dir, [Identity.singleton("watcher")])
        loaded = self.registry.load(cfg.state_path)
        if loaded:
            log(_log, "loaded saved edges (unhealthy until they report)", edges=loaded)
        self.service.update_gauges()
        server = make_server(
            cfg.pki_dir, "watcher", cfg.listen, ALLOWED_ROLES, metrics=self.metrics
        )
        pb_grpc.add_WatcherServicer_to_server(self.service, server)
        await server.start()
        self._server = server
        self.port = server_port(server)
        if cfg.metrics_listen:
            host, port = parse_hostport(cfg.metrics_listen)
            self._metrics_runner = await serve_metrics(self.metrics, host, port)
            self.metrics_port = bound_port(self._metrics_runner)
        self._sweeper = asyncio.create_task(self._sweep_forever())
        log(_log, "listening", listen=cfg.listen, port=self.port, timeout_s=cfg.health_timeout_s)
        return self.port

    async def stop(self) -> None:
        """Stop serving, then save the view."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
            self._server = None
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        self._save()

    def sweep(self) -> None:
        """Log health changes and refresh the gauges (run once a second)."""
        for t in self.registry.sweep(time.monotonic()):
            level = logging.INFO if t.healthy else logging.WARNING
            state = "healthy" if t.healthy else "unhealthy"
            log(_log, f"edge {state}", level, edge_id=t.edge_id, last_seen=t.last_seen)
        self.service.update_gauges()

    async def _sweep_forever(self) -> None:
        last_save = time.monotonic()
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep()
            if self.registry.dirty and time.monotonic() - last_save >= SAVE_EVERY_S:
                self._save()
                last_save = time.monotonic()

    def _save(self) -> None:
        if not self.registry.dirty:
            return
        try:
            self.registry.save(self.config.state_path)
        except OSError as e:
            log(_log, "cannot save edge view", logging.WARNING, error=str(e))


async def serve(config: WatcherConfig, stop: asyncio.Event) -> None:
    """Run the watcher until ``stop`` is set."""
    app = WatcherApp(config)
    renewer: asyncio.Task[None] | None = None
    try:
        await app.start()
        if config.iam:
            renewer = asyncio.create_task(
                renew_forever(config.pki_dir, "watcher", config.iam, stop)
            )
        await stop.wait()
    finally:
        if renewer is not None:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
        await app.stop()
