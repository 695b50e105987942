"""``dsec cluster token create``, ``dsec edge join`` and ``dsec iam``: running a cluster."""

from __future__ import annotations

import sys

import click

from dsec.cli.output import json_option, print_json, state


@click.group("cluster")
def cluster_group() -> None:
    """Cluster membership (platform admin)."""


@cluster_group.group("token")
def token() -> None:
    """One-time bootstrap tokens for joining nodes."""


@token.command("create")
@click.option("--ttl", type=click.IntRange(min=1), default=3600, help="Seconds it stays valid.")
@json_option
def create_token(ttl: int, as_json: bool) -> None:
    """Create a token; give it to `dsec edge join --bootstrap-token` on the new node."""
    made = state().client().create_join_token(ttl)
    if as_json:
        print_json(made)
        return
    click.echo(made["token"])
    click.echo(
        "on the new node: dsec edge join --bootstrap-token <token> --cluster <iam join address>",
        err=True,
    )


@click.group("edge")
def edge_group() -> None:
    """This machine as an edge of a cluster."""


@edge_group.command(
    "join", context_settings={"ignore_unknown_options": True, "allow_extra_args": True}
)
@click.pass_context
def edge_join(ctx: click.Context) -> None:
    """Exchange a bootstrap token for this node's certificate (the key stays here).

    Flags: --bootstrap-token T --cluster HOST:PORT [--home H] [--edge-id ID] [--san ADDR].
    """
    from dsec.edge.join import main

    sys.exit(main(list(ctx.args)))


@click.command("iam", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def iam_command(ctx: click.Context) -> None:
    """Run an iam daemon (flags of `python -m dsec.iam`, e.g. --store etcd://H:P,H:P)."""
    from dsec.iam.__main__ import main

    sys.exit(main(list(ctx.args)))
