"""``python -m dsec.iam``: run the iam daemon."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from dsec.daemon import daemon_arg_parser, resolve_home, run_daemon
from dsec.iam.app import DEFAULT_LISTEN, DEFAULT_METRICS_LISTEN, IamConfig, serve
from dsec.iam.service import DEFAULT_RECONCILE_GRACE_S


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run the daemon; returns the exit status."""
    parser = daemon_arg_parser(
        "iam", default_listen=DEFAULT_LISTEN, default_metrics=DEFAULT_METRICS_LISTEN
    )
    parser.add_argument(
        "--reconcile-grace",
        type=float,
        default=DEFAULT_RECONCILE_GRACE_S,
        help="seconds an allocation is safe from Reconcile after Admit",
    )
    parser.add_argument(
        "--store",
        default="",
        help="where IAM state lives: empty for <home>/iam.db, or etcd://HOST:PORT,HOST:PORT",
    )
    parser.add_argument(
        "--etcd-tls",
        type=Path,
        default=None,
        help="directory with ca.pem, client.pem and client-key.pem for etcd (mTLS)",
    )
    parser.add_argument(
        "--join-listen",
        default="",
        help="HOST:PORT where nodes redeem bootstrap tokens for certificates (off if empty)",
    )
    args = parser.parse_args(argv)
    config = IamConfig(
        home=resolve_home(args.home),
        listen=args.listen,
        metrics_listen=args.metrics_listen,
        reconcile_grace_s=args.reconcile_grace,
        store=args.store,
        etcd_tls_dir=args.etcd_tls,
        join_listen=args.join_listen,
    )

    async def body(stop: asyncio.Event) -> None:
        await serve(config, stop)

    return run_daemon("iam", body, log_level=args.log_level)


if __name__ == "__main__":
    sys.exit(main())
