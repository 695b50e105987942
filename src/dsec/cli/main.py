"""The ``dsec`` command: the root group, global options and error handling.

Sandbox commands live in ``sandbox.py``/``files.py``, keys in ``keys.py``; the platform
commands (``up``, ``down``, ``status``, ``setup``) are registered from ``platform.py`` when
that module is present. Every :class:`~dsec.core.errors.DsecError` ends the command with one
line on stderr and exit code 2 (the caller's fault) or 1 (the platform's); Ctrl-C exits 130.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from dsec import __version__
from dsec.cli.audit import audit_group
from dsec.cli.backends import backends
from dsec.cli.ca import ca_group
from dsec.cli.cluster import cluster_group, edge_group, iam_command
from dsec.cli.e2b import e2b_group
from dsec.cli.images import image_group, registry_group
from dsec.cli.keys import keys_group, whoami
from dsec.cli.output import EXIT_INTERRUPTED, CliState, report
from dsec.cli.projects import project_group, quota_group
from dsec.cli.sandbox import sandbox_group
from dsec.cli.snapshots import snapshot_group
from dsec.cli.tokens import token_group, user_group
from dsec.cli.trajectory import trajectory_group
from dsec.core.errors import DsecError


class DsecGroup(click.Group):
    """A group that reports :class:`DsecError` as one line and a matching exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DsecError as exc:
            ctx.exit(report(exc))
        except KeyboardInterrupt:
            click.echo("dsec: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)


@click.group(cls=DsecGroup, invoke_without_command=True)
@click.option("--api-url", envvar=None, default=None, help="apiserver URL [env DSEC_API_URL].")
@click.option("--api-key", envvar=None, default=None, help="API key [env DSEC_API_KEY].")
@click.version_option(__version__, prog_name="dsec")
@click.pass_context
def cli(ctx: click.Context, api_url: str | None, api_key: str | None) -> None:
    """OpenDsec: self-hosted sandboxes for agents and code execution.

    With no configuration, commands use the platform started by `dsec up` on this machine.
    """
    st = ctx.ensure_object(CliState)
    if api_url:
        st.api_url = api_url
    if api_key:
        st.api_key = api_key
    ctx.call_on_close(st.close)
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


cli.add_command(sandbox_group)
cli.add_command(snapshot_group)
cli.add_command(keys_group)
cli.add_command(whoami)
cli.add_command(audit_group)
cli.add_command(token_group)
cli.add_command(user_group)
cli.add_command(project_group)
cli.add_command(quota_group)
cli.add_command(e2b_group)
cli.add_command(image_group)
cli.add_command(registry_group)
cli.add_command(backends)
cli.add_command(trajectory_group)
cli.add_command(cluster_group)
cli.add_command(edge_group)
cli.add_command(iam_command)
cli.add_command(ca_group)


def _register_platform_commands(group: click.Group) -> None:
    """Add ``up``/``down``/``status``/``setup`` from ``dsec.cli.platform`` if it exists."""
    try:
        platform = importlib.import_module("dsec.cli.platform")
    except ImportError as exc:
        if exc.name != "dsec.cli.platform":
            raise  # the module exists but one of its own imports failed
        return
    platform.register(group)


_register_platform_commands(cli)


def main() -> None:
    """Entry point of the ``dsec`` console script."""
    cli(prog_name="dsec")


if __name__ == "__main__":
    main()
