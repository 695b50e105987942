"""The E2B-compatible gateway daemon.

``python -m dsec.gateway --listen 127.0.0.1:3000 --api-url http://127.0.0.1:8420``

One address serves both planes: a request naming a sandbox (``E2b-Sandbox-Id`` header, as
the SDK sends with ``E2B_SANDBOX_URL``, or a ``<port>-<id>.<domain>`` Host) goes to the
envd side (``envd.py``), anything else to the control plane (``control.py``). The gateway
keeps no state: every call is made to OpenDsec's public API with the caller's key.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from dsec import __version__
from dsec.core.errors import DsecError, InvalidArgument
from dsec.gateway import control, envd, snapshots
from dsec.gateway.control import GATEWAY, Gateway, dsec_error_response, error_response
from dsec.gateway.upstream import Clients, target
from dsec.obs import log
from dsec.paths import Paths
from dsec.rpc.tls import web_ssl_context

_log = logging.getLogger("dsec.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "version": __version__})


@web.middleware
async def route(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        where = target(request)
    except DsecError as exc:
        return envd.http_error(exc)
    if where is not None:
        return await envd.dispatch(request, *where)
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error_response(404, f"no route {request.method} {request.path}")
    except web.HTTPMethodNotAllowed:
        return error_response(405, f"method {request.method} not allowed on {request.path}")
    except DsecError as exc:
        return dsec_error_response(request, exc)
    except (ConnectionError, asyncio.CancelledError):
        raise
    except Exception as exc:
        _log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}", retry=False)


def make_app(gateway: Gateway) -> web.Application:
    app = web.Application(middlewares=[route], client_max_size=64 * 1024 * 1024)
    app[GATEWAY] = gateway
    app.router.add_get("/healthz", healthz)
    for method, path, handler in [*control.ROUTES, *snapshots.ROUTES]:
        app.router.add_route(method, path, handler)
    return app


def _templates(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, image = pair.partition("=")
        if not sep or not name or not image:
            raise InvalidArgument(f"--template wants NAME=IMAGE, got {pair!r}")
        out[name] = image
    return out


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call: too much
    gateway = Gateway(
        Clients(args.api_url),
        domain=args.domain,
        cpu=args.cpu,
        memory_mb=args.memory_mb,
        templates=_templates(args.template),
    )
    runner = web.AppRunner(make_app(gateway), access_log=None)
    await runner.setup()
    host, _, port = args.listen.rpartition(":")
    site = web.TCPSite(runner, host or "127.0.0.1", int(port), reuse_address=True)
    await site.start()
    log(_log, "gateway listening", address=args.listen, api_url=args.api_url)
    if args.tls_listen:
        # E2B_DOMAIN mode: https://api.<domain> and https://<port>-<id>.<domain>
        ssl_ctx = web_ssl_context(Paths.from_env(args.home).pki, args.domain)
        host, _, port = args.tls_listen.rpartition(":")
        tls_site = web.TCPSite(runner, host or "127.0.0.1", int(port), ssl_context=ssl_ctx)
        await tls_site.start()
        log(_log, "gateway listening (TLS)", address=args.tls_listen, domain=args.domain)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await gateway.aclose()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dsec-gateway", description=__doc__)
    ap.add_argument("--home", type=Path, default=None)
    ap.add_argument("--listen", default="127.0.0.1:3000")
    ap.add_argument("--api-url", default="http://127.0.0.1:8420")
    ap.add_argument("--domain", default="localhost", help="sandbox domain E2B clients are told")
    ap.add_argument(
        "--tls-listen", default="", help="also serve HTTPS here (*.<domain> cert of the cluster CA)"
    )
    ap.add_argument("--cpu", type=float, default=1.0, help="cores of every sandbox")
    ap.add_argument("--memory-mb", type=int, default=512, help="memory of every sandbox")
    ap.add_argument(
        "--template", action="append", default=[], help="NAME=IMAGE: an E2B template's image"
    )
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from dsec.daemon import run_daemon

    args = parse_args(argv)
    sys.exit(run_daemon("gateway", lambda stop: serve(args, stop), log_level=args.log_level))
