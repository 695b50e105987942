"""The apiserver daemon: aiohttp application, middlewares and entry point.

``python -m dsec.apiserver --home H --listen 127.0.0.1:8420 --iam ADDR --watcher ADDR``
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from dsec import __version__
from dsec.apiserver import (
    audit,
    backends,
    cluster,
    hostroute,
    images,
    keys,
    openapi,
    projects,
    roles,
    runtime,
    sandboxes,
    snapshots,
    tokens_routes,
    trajectories,
    ws,
)
from dsec.apiserver.auth import Authenticator
from dsec.apiserver.context import CTX, Ctx, ctx, ok
from dsec.apiserver.trajectory_calls import HEADERS as TRAJECTORY_HEADERS
from dsec.apiserver.upstream import Upstream
from dsec.core.errors import DsecError, Internal, InvalidArgument, NotFound
from dsec.obs import Metrics, log
from dsec.paths import Paths
from dsec.rpc.renewal import renew_forever
from dsec.rpc.tls import web_ssl_context
from dsec.trajectory.log import TrajectoryLog
from dsec.trajectory.retention import Retention, run_sweeper
from dsec.trajectory.setup import open_log

_log = logging.getLogger("dsec.apiserver")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PUBLIC_PREFIXES = ("/healthz", "/metrics", "/openapi.json")


async def healthz(request: web.Request) -> web.Response:
    """Liveness of the apiserver itself (no key needed)."""
    return ok({"status": "ok", "version": __version__})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus metrics of this apiserver."""
    c = ctx(request)
    c.metrics.set("iam_batch_calls", c.upstream.iam_batch.calls)
    c.metrics.set("iam_batch_items", c.upstream.iam_batch.items)
    return web.Response(text=c.metrics.render(), content_type="text/plain")


async def openapi_json(request: web.Request) -> web.Response:
    """The OpenAPI document of this API."""
    return ok(openapi.document(all_routes(), __version__))


async def status(request: web.Request) -> web.Response:
    """Platform components and their addresses as the apiserver sees them."""
    c = ctx(request)
    edges = await c.upstream.edges(fresh=True)
    return ok(
        {
            "components": c.components,
            "edges": [
                {"edge_id": e.edge_id, "address": e.address, "healthy": e.healthy} for e in edges
            ],
        }
    )


def all_routes() -> list[tuple[str, str, Any]]:
    return [
        ("GET", "/healthz", healthz),
        ("GET", "/metrics", metrics),
        ("GET", "/openapi.json", openapi_json),
        ("GET", "/v1/status", status),
        ("GET", "/v1/sandboxes/{sandbox_id}/runtime", ws.runtime_ws),
        *sandboxes.ROUTES,
        *snapshots.ROUTES,
        *runtime.ROUTES,
        *keys.ROUTES,
        *audit.ROUTES,
        *tokens_routes.ROUTES,
        *projects.ROUTES,
        *roles.ROUTES,
        *cluster.ROUTES,
        *images.ROUTES,
        *backends.ROUTES,
        *trajectories.ROUTES,
    ]


@web.middleware
async def errors_and_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    c = ctx(request)
    start = time.perf_counter()
    route = (
        request.match_info.route.resource.canonical
        if request.match_info.route.resource
        else "unmatched"
    )
    rid = request.headers.get("X-Request-Id", "")[:64] or os.urandom(8).hex()
    request["request_id"] = rid
    status_code = 500
    try:
        if not request.path.startswith(PUBLIC_PREFIXES):
            request["principal"] = await c.auth.principal(request)
        resp = await handler(request)
        status_code = resp.status
        await audit.record(request, route, status_code, None, rid)
        return resp
    except web.HTTPNotFound:
        err: DsecError = NotFound(f"no route {request.method} {request.path}")
        status_code = err.http_status
        return web.json_response({"error": err.to_wire()}, status=status_code)
    except web.HTTPMethodNotAllowed as exc:
        status_code = 405
        return web.json_response(
            {"error": {"code": "method_not_allowed", "message": str(exc)}}, status=405
        )
    except DsecError as exc:
        status_code = exc.http_status
        await audit.record(request, route, status_code, exc, rid)
        return web.json_response(
            {"error": exc.to_wire()}, status=status_code, headers={"X-Request-Id": rid}
        )
    except (ConnectionResetError, asyncio.CancelledError):
        status_code = 499
        raise
    except Exception as exc:
        _log.exception("unhandled error", extra={"fields": {"request_id": rid}})
        err = Internal(f"internal error (request id {rid}): {type(exc).__name__}")
        return web.json_response({"error": err.to_wire()}, status=500)
    finally:
        c.metrics.observe(
            "http_request", time.perf_counter() - start, route=route, method=request.method
        )
        c.metrics.inc("http_requests", route=route, method=request.method, code=str(status_code))


async def _trajectory_headers(request: web.Request, response: web.StreamResponse) -> None:
    for k, v in request.get(TRAJECTORY_HEADERS, {}).items():
        response.headers[k] = v


def make_app(
    upstream: Upstream,
    components: dict[str, str],
    *,
    trajectories: TrajectoryLog | None = None,
    retention: Retention | None = None,
    domain: str | None = None,
) -> web.Application:
    middlewares: list[Middleware] = [errors_and_auth]
    if domain:  # <port>-<sandbox id>.<domain> reaches the sandbox's port (hostroute.py)
        middlewares.insert(0, hostroute.middleware(domain, errors_and_auth))
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app[CTX] = Ctx(
        upstream=upstream,
        auth=Authenticator(upstream),
        metrics=Metrics("dsec_apiserver"),
        components=components,
        trajectories=trajectories,
    )
    for method, path, handler in all_routes():
        app.router.add_route(method, path, handler)
    app.on_response_prepare.append(_trajectory_headers)
    sweeper_stop = asyncio.Event()
    sweeper: list[asyncio.Task[None]] = []

    async def on_startup(app: web.Application) -> None:
        await app[CTX].auth.start()
        if trajectories is not None and retention is not None:
            sweeper.append(asyncio.create_task(run_sweeper(trajectories, retention, sweeper_stop)))

    async def on_cleanup(app: web.Application) -> None:
        sweeper_stop.set()
        for task in sweeper:
            await task
        await app[CTX].auth.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def runner(app: web.Application) -> web.AppRunner:
    """The apiserver's runner. A client that goes away mid-request does not cancel its
    handler (said here, not left to aiohttp's default): a recorded runtime call that ran is
    recorded whoever is still listening (``trajectory_calls.py``), with no task per call to
    shield it."""
    return web.AppRunner(app, access_log=None, handler_cancellation=False)


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host or "127.0.0.1", int(port)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    paths = Paths.from_env(args.home)
    upstream = Upstream(paths.pki, iam=args.iam, watcher=args.watcher, placement=args.placement)
    components = {"apiserver": args.listen, "iam": args.iam, "watcher": args.watcher}
    tlog = await open_log(
        args.trajectory_store or f"sqlite:{paths.home / 'trajectory' / 'log.db'}",
        args.trajectory_blobs or paths.home / "trajectory" / "blobs",
        default_quota_bytes=args.trajectory_quota_bytes,
        sync=args.trajectory_sync,
    )
    retention = Retention(
        max_age_s=args.trajectory_max_age_days * 86400, max_bytes=args.trajectory_max_bytes
    )
    app = make_app(upstream, components, trajectories=tlog, retention=retention, domain=args.domain)
    app_runner = runner(app)
    await app_runner.setup()
    host, port = _split(args.listen)
    site = web.TCPSite(
        app_runner, host, port, reuse_address=True, reuse_port=args.reuse_port or None
    )
    await site.start()
    log(_log, "apiserver listening", address=args.listen, domain=args.domain or "")
    if args.tls_listen:
        if not args.domain:
            raise InvalidArgument("--tls-listen needs --domain (the certificate's name)")
        host, port = _split(args.tls_listen)
        ssl_ctx = web_ssl_context(paths.pki, args.domain)
        await web.TCPSite(app_runner, host, port, ssl_context=ssl_ctx, reuse_address=True).start()
        log(_log, "apiserver listening (TLS)", address=args.tls_listen, domain=args.domain)
    renewer = asyncio.create_task(renew_forever(paths.pki, "apiserver", args.iam, stop))
    try:
        await stop.wait()
    finally:
        renewer.cancel()
        await asyncio.gather(renewer, return_exceptions=True)
        await app_runner.cleanup()
        await upstream.aclose()
        await tlog.aclose()
        await tlog.store.aclose()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dsec-apiserver")
    ap.add_argument("--home", type=Path, default=None)
    ap.add_argument("--listen", default="127.0.0.1:8420")
    ap.add_argument("--iam", default="127.0.0.1:8421")
    ap.add_argument("--watcher", default="127.0.0.1:8422")
    ap.add_argument(
        "--domain", default="", help="serve <port>-<sandbox id>.<domain> (host-style routing)"
    )
    ap.add_argument(
        "--tls-listen", default="", help="also serve HTTPS here, with a *.<domain> certificate"
    )
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument(
        "--trajectory-store",
        default="",
        help="sqlite:PATH (default <home>/trajectory/log.db) or etcd:http://HOST:PORT[,...]",
    )
    ap.add_argument("--trajectory-blobs", type=Path, default=None, help="blob directory")
    ap.add_argument(
        "--trajectory-sync",
        choices=["FULL", "NORMAL", "full", "normal"],
        default=os.environ.get("DSEC_TRAJECTORY_SYNC", "FULL"),
        help="SQLite log: FULL fsyncs each step, NORMAL survives apiserver crashes only",
    )
    ap.add_argument("--trajectory-quota-bytes", type=int, default=1024**3)
    ap.add_argument("--trajectory-max-age-days", type=float, default=30.0)
    ap.add_argument("--trajectory-max-bytes", type=int, default=0)
    ap.add_argument("--reuse-port", action="store_true",
                    help="share --listen with other apiservers on this host (SO_REUSEPORT: "
                         "the kernel spreads connections over them, one per core)")  # fmt: skip
    ap.add_argument("--placement", choices=["spread", "pack"], default="spread",
                    help="spread sandboxes over edges, or pack them onto the fewest")  # fmt: skip
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import sys

    from dsec.daemon import run_daemon

    args = parse_args(argv)
    sys.exit(run_daemon("apiserver", lambda stop: serve(args, stop), log_level=args.log_level))
