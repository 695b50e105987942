"""``python -m dsec.watcher``: run the watcher daemon."""

from __future__ import annotations

import asyncio
import sys

from dsec.daemon import daemon_arg_parser, resolve_home, run_daemon
from dsec.watcher.app import DEFAULT_LISTEN, DEFAULT_METRICS_LISTEN, WatcherConfig, serve
from dsec.watcher.registry import DEFAULT_TIMEOUT_S


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run the daemon; returns the exit status."""
    parser = daemon_arg_parser(
        "watcher", default_listen=DEFAULT_LISTEN, default_metrics=DEFAULT_METRICS_LISTEN
    )
    parser.add_argument(
        "--health-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds without a report before an edge is unhealthy ({DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--iam", default="", help="the iam's HOST:PORT, to renew our certificate (CA rotation)"
    )
    args = parser.parse_args(argv)
    config = WatcherConfig(
        home=resolve_home(args.home),
        listen=args.listen,
        metrics_listen=args.metrics_listen,
        health_timeout_s=args.health_timeout,
        iam=args.iam,
    )

    async def body(stop: asyncio.Event) -> None:
        await serve(config, stop)

    return run_daemon("watcher", body, log_level=args.log_level)


if __name__ == "__main__":
    sys.exit(main())
