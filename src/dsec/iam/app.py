"""Wiring of the iam daemon: PKI, database, first-start bootstrap, gRPC server, metrics.

:class:`IamApp` starts and stops the whole daemon inside a running event loop (tests use it
directly); :func:`serve` runs it until a stop event is set (``python -m dsec.iam``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web

from dsec.daemon import bound_port, parse_hostport, serve_metrics
from dsec.iam.ca_rpcs import CA_ALLOWED_ROLES, CaService
from dsec.iam.join_rpcs import JoinService, join_server
from dsec.iam.service import ALLOWED_ROLES, DEFAULT_RECONCILE_GRACE_S, IamService
from dsec.iam.signing import load_or_create
from dsec.iam.state import open_state
from dsec.obs import Metrics, log
from dsec.rpc._gen import ca_pb2_grpc
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc
from dsec.rpc.renewal import check_interval
from dsec.rpc.server import make_server, server_port
from dsec.rpc.tls import Identity, ensure_pki
from dsec.store.api import StateStore

_log = logging.getLogger("dsec.iam")

DEFAULT_LISTEN = "127.0.0.1:8421"
DEFAULT_METRICS_LISTEN = "127.0.0.1:9421"
STOP_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class IamConfig:
    """Everything the iam daemon is told at start.

    ``metrics_listen`` empty disables the metrics endpoint. ``store`` is where the state
    lives: empty for ``<home>/iam.db``, or ``etcd://HOST:PORT,...`` for a replicated IAM
    (then ``etcd_tls_dir`` holds ``ca.pem``, ``client.pem`` and ``client-key.pem``).
    """

    home: Path
    listen: str = DEFAULT_LISTEN
    metrics_listen: str = DEFAULT_METRICS_LISTEN
    reconcile_grace_s: float = DEFAULT_RECONCILE_GRACE_S
    store: str = ""
    etcd_tls_dir: Path | None = None
    join_listen: str = ""  # where nodes redeem bootstrap tokens (TLS, no client cert)

    @property
    def db_path(self) -> Path:
        return self.home / "iam.db"

    @property
    def admin_key_path(self) -> Path:
        return self.home / "admin.key"

    @property
    def pki_dir(self) -> Path:
        return self.home / "pki"


class IamApp:
    """The running iam daemon."""

    def __init__(self, config: IamConfig) -> None:
        self.config = config
        self.metrics = Metrics("dsec_iam")
        self.port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._service: IamService | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._store: StateStore | None = None
        self._join_server: grpc.aio.Server | None = None
        self.join_port = 0

    async def start(self) -> int:
        """Bring the daemon up; returns the gRPC port it listens on."""
        cfg = self.config
        cfg.home.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(ensure_pki, cfg.pki_dir, [Identity.singleton("iam")])
        state, self._store = await open_state(cfg.store, cfg.home, etcd_tls_dir=cfg.etcd_tls_dir)
        signing = await asyncio.to_thread(load_or_create, cfg.pki_dir / "token-signing.key")
        self._service = IamService(
            state, metrics=self.metrics, reconcile_grace_s=cfg.reconcile_grace_s, signing=signing,
            pki_dir=cfg.pki_dir,
        )  # fmt: skip
        if await state.bootstrap(self._write_admin_key):
            log(_log, "bootstrapped: created project 'default' and an admin key")
        roles = {**ALLOWED_ROLES, **CA_ALLOWED_ROLES}
        server = make_server(cfg.pki_dir, "iam", cfg.listen, roles, metrics=self.metrics)
        self.port = server_port(server)
        pb_grpc.add_IamServicer_to_server(self._service, server)
        ca_pb2_grpc.add_CaServicer_to_server(
            CaService(cfg.pki_dir, self.metrics, check_interval()), server
        )
        await server.start()
        self._server = server
        if cfg.join_listen:
            service = JoinService(state, cfg.pki_dir, self.metrics)
            self._join_server, self.join_port = join_server(cfg.pki_dir, cfg.join_listen, service)
            await self._join_server.start()
            log(_log, "join listening", listen=cfg.join_listen, port=self.join_port)
        if cfg.metrics_listen:
            host, port = parse_hostport(cfg.metrics_listen)
            self._metrics_runner = await serve_metrics(self.metrics, host, port)
            self.metrics_port = bound_port(self._metrics_runner)
        log(
            _log,
            "listening",
            listen=cfg.listen,
            port=self.port,
            store=cfg.store or str(cfg.db_path),
        )
        return self.port

    async def stop(self) -> None:
        """Drain in-flight calls (up to 5 s), then close everything."""
        if self._join_server is not None:
            await self._join_server.stop(STOP_GRACE_S)
            self._join_server = None
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
            self._server = None
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        if self._service is not None:
            await self._service.close()
            self._service = None
        if self._store is not None:
            await self._store.aclose()
            self._store = None

    def _write_admin_key(self, key_id: str, api_key: str) -> None:
        """Write the bootstrap admin key to ``<home>/admin.key`` (0600), atomically."""
        path = self.config.admin_key_path
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(api_key + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        log(_log, "bootstrap admin key written", path=str(path), key_id=key_id)


async def serve(config: IamConfig, stop: asyncio.Event) -> None:
    """Run the iam daemon until ``stop`` is set."""
    app = IamApp(config)
    try:
        await app.start()
        await stop.wait()
    finally:
        await app.stop()
