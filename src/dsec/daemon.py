"""How every OpenDsec daemon runs: logging, signals, the event loop, metrics and health.

A daemon's ``__main__`` parses its flags with :func:`daemon_arg_parser` and hands an
``async def main(stop: asyncio.Event)`` to :func:`run_daemon`, which sets up JSON logging,
turns SIGTERM/SIGINT into ``stop.set()``, runs ``main`` in a fresh event loop (so every
gRPC object is created inside that loop) and returns the process exit status: 0 when
``main`` returns, 1 when it raises. A second signal cancels ``main`` outright.

:func:`serve_metrics` exposes ``GET /metrics`` (Prometheus text) and ``GET /healthz`` for
daemons whose main port speaks gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from dsec.core.errors import DsecError, InvalidArgument, Unavailable
from dsec.obs import Metrics, log, setup_logging
from dsec.paths import Paths

_log = logging.getLogger("dsec.daemon")

_PROM_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DaemonMain = Callable[[asyncio.Event], Awaitable[None]]


def run_daemon(component: str, main: DaemonMain, *, log_level: str = "INFO") -> int:
    """Run ``main(stop)`` until it returns; SIGTERM/SIGINT set ``stop``.

    Args:
        component: the name in every log line, e.g. ``"iam"``.
        main: the daemon body; it should return soon after ``stop`` is set.
        log_level: a logging level name.

    Returns:
        The exit status: 0 after a clean stop, 1 if ``main`` raised.
    """
    setup_logging(component, log_level.upper())
    try:
        asyncio.run(_supervise(component, main))
    except DsecError as e:
        log(_log, "stopped on error", logging.ERROR, error=e.message, code=e.code)
        return 1
    except asyncio.CancelledError:
        log(_log, "stopped forcibly")
        return 1
    except Exception:
        _log.exception("stopped on unexpected error")
        return 1
    log(_log, "stopped")
    return 0


async def _supervise(component: str, main: DaemonMain) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    task = asyncio.current_task()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log(_log, "second signal, cancelling", signal=signal.Signals(signum).name)
            if task is not None:
                task.cancel()
            return
        log(_log, "stopping", signal=signal.Signals(signum).name)
        stop.set()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        log(_log, "starting", component=component)
        await main(stop)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def parse_hostport(value: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) into its parts.

    Raises:
        InvalidArgument: not of that form, or the port is outside 0-65535.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"expected host:port, got {value!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def daemon_arg_parser(
    component: str, *, default_listen: str, default_metrics: str
) -> argparse.ArgumentParser:
    """The flags every daemon shares: ``--home``, ``--listen``, ``--metrics-listen``,
    ``--log-level``; add daemon-specific ones to the returned parser.

    ``--home`` defaults to ``$DSEC_HOME`` or ``/var/lib/dsec``; an empty
    ``--metrics-listen`` disables the metrics endpoint.
    """
    p = argparse.ArgumentParser(prog=f"python -m dsec.{component}", description=f"dsec {component}")
    p.add_argument("--home", type=Path, default=None, help="state directory (default $DSEC_HOME)")
    p.add_argument("--listen", default=default_listen, help=f"gRPC host:port ({default_listen})")
    p.add_argument(
        "--metrics-listen",
        default=default_metrics,
        help=f"HTTP host:port for /metrics and /healthz ({default_metrics}; empty: off)",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p


def resolve_home(home: Path | None) -> Path:
    """The home directory from ``--home`` or the environment (see :class:`dsec.paths.Paths`)."""
    return Paths.from_env(home).home


async def serve_metrics(
    metrics: Metrics,
    host: str,
    port: int,
    *,
    health: Callable[[], bool] | None = None,
) -> web.AppRunner:
    """Serve ``GET /metrics`` and ``GET /healthz`` over HTTP; stop with ``runner.cleanup()``.

    Args:
        metrics: the registry to render.
        host: address to bind (keep it on loopback unless a scraper needs more).
        port: port to bind; 0 picks one (read it with :func:`bound_port`).
        health: returns whether the daemon is healthy; ``/healthz`` answers 503 when not.

    Raises:
        Unavailable: the address cannot be bound.
    """

    async def get_metrics(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render().encode(), headers={"Content-Type": _PROM_TYPE})

    async def get_health(_: web.Request) -> web.Response:
        ok = health() if health is not None else True
        return web.json_response({"ok": ok}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/healthz", get_health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise Unavailable(f"cannot serve metrics on {host}:{port}: {e.strerror}") from e
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The TCP port the first site of ``runner`` listens on."""
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            return int(addr[1])
    raise Unavailable("metrics server is not listening")
